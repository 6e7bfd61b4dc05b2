"""`codraft tiny-model OUT`: a tiny random target model and tokenizer (tests, quick tries)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    sp = sub.add_parser("tiny-model", help="write a tiny random target model + tokenizer")
    sp.add_argument("out")
    sp.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    sp.add_argument("--seed", type=int, default=0)
    commands["tiny-model"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.testing import make_tiny_target

    print(make_tiny_target(args.out, arch=args.arch, seed=args.seed))
    return 0
