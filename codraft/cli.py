"""`codraft` command line: one subcommand per job; each lives in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

PASSTHROUGH = {"serve"}  # subcommands that hand unknown arguments on (to vLLM)


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


def _learn(args: argparse.Namespace) -> int:
    from codraft.learner.cli import main as learn_main

    return learn_main(args)


def _generate(args: argparse.Namespace) -> int:
    from codraft.server.generate import main as generate_main

    return generate_main(args)


def _serve(args: argparse.Namespace) -> int:
    from codraft.server.vllm_env import ensure_cpu_preload

    ensure_cpu_preload()  # re-executes once with Intel OpenMP preloaded (CPU machines)
    from codraft.server.serve import main as serve_main
    from codraft.server.serve_config import config_from_args

    try:
        cfg = config_from_args(args, args._extra)
    except ValueError as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 2
    return serve_main(cfg)


def _record(args: argparse.Namespace) -> int:
    from codraft.server.record import config_from_args
    from codraft.server.record import main as record_main

    return record_main(config_from_args(args))


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

    from codraft.server.generate import add_arguments as add_generate_arguments

    sp = sub.add_parser(
        "generate",
        help="speculative generation with vLLM: a target, an EAGLE-3 draft, real prompts",
    )
    add_generate_arguments(sp)
    commands["generate"] = _generate

    from codraft.server.serve_config import add_arguments as add_serve_arguments

    sp = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="vLLM's OpenAI server with an EAGLE-3 draft, the tap and the codraft control API",
        description="Arguments codraft serve does not know are passed to vLLM "
        "(e.g. --max-num-seqs 32).",
    )
    add_serve_arguments(sp)
    commands["serve"] = _serve

    from codraft.server.record import add_arguments as add_record_arguments

    sp = sub.add_parser("record", help="write a server's tap stream to tap files")
    add_record_arguments(sp)
    commands["record"] = _record

    from codraft.learner.cli import add_arguments as add_learn_arguments

    sp = sub.add_parser("learn", help="train an EAGLE-3 draft (offline: --from-dir tap files)")
    add_learn_arguments(sp)
    commands["learn"] = _learn

    from codraft.client.commands import add_client_commands

    add_client_commands(sub, commands)

    p.set_defaults(_commands=commands)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._extra = extra
    raise SystemExit(args._commands[args.command](args))


if __name__ == "__main__":
    main()
