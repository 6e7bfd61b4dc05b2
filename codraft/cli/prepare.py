"""`codraft prepare smollm2`: a real model, converted offline into a safetensors folder."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    sp = sub.add_parser("prepare", help="prepare a real model offline (SmolLM2-135M-Instruct)")
    sp.add_argument("model", choices=["smollm2"])
    sp.add_argument("--out", default=None, help="output folder (default: the codraft cache)")
    sp.add_argument("--force", action="store_true", help="convert again even if prepared")
    commands["prepare"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.prepare import prepare_smollm2

    if args.model != "smollm2":
        print(f"unknown model {args.model!r}; expected: smollm2", file=sys.stderr)
        return 2
    prepared = prepare_smollm2(args.out, force=args.force)
    state = "converted" if prepared.converted else "already prepared"
    print(f"{prepared.path} ({state}; weights sha256 {prepared.weights_sha256[:16]}...)")
    return 0
