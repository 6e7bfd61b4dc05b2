"""`codraft` command line: one subcommand per job; each lives in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _prepare(args: argparse.Namespace) -> int:
    from codraft.prepare import prepare_smollm2

    if args.model != "smollm2":
        print(f"unknown model {args.model!r}; expected: smollm2", file=sys.stderr)
        return 2
    prepared = prepare_smollm2(args.out, force=args.force)
    state = "converted" if prepared.converted else "already prepared"
    print(f"{prepared.path} ({state}; weights sha256 {prepared.weights_sha256[:16]}...)")
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from codraft.testing import make_tiny_target

    print(make_tiny_target(args.out, arch=args.arch, seed=args.seed))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from server.generate import main as generate_main

    return generate_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codraft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    sp = sub.add_parser("prepare", help="prepare a real model offline (SmolLM2-135M-Instruct)")
    sp.add_argument("model", choices=["smollm2"])
    sp.add_argument("--out", default=None, help="output folder (default: the codraft cache)")
    sp.add_argument("--force", action="store_true", help="convert again even if prepared")
    commands["prepare"] = _prepare

    sp = sub.add_parser("tiny-model", help="write a tiny random target model + tokenizer")
    sp.add_argument("out")
    sp.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    sp.add_argument("--seed", type=int, default=0)
    commands["tiny-model"] = _tiny

    from server.generate import add_arguments as add_generate_arguments

    sp = sub.add_parser(
        "generate",
        help="speculative generation with vLLM: a target, an EAGLE-3 draft, real prompts",
    )
    add_generate_arguments(sp)
    commands["generate"] = _generate

    p.set_defaults(_commands=commands)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    raise SystemExit(args._commands[args.command](args))


if __name__ == "__main__":
    main()
