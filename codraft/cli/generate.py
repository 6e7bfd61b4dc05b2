"""`codraft generate`: speculative generation with vLLM against the same run without it."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    from codraft.server.generate import add_arguments

    sp = sub.add_parser(
        "generate",
        help="speculative generation with vLLM: a target, an EAGLE-3 draft, real prompts",
    )
    add_arguments(sp)
    commands["generate"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.server.generate import main

    return main(args)
