"""`codraft` command line: one subcommand per job; each lives in its own module."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from codraft.cli import control, generate, keys, learn, prepare, record, serve, tiny

PASSTHROUGH = {"serve"}  # subcommands that hand unknown arguments on (to vLLM)
# in the order `codraft --help` lists them; each adds its subparsers and their commands
SUBCOMMANDS = (prepare, tiny, generate, serve, record, learn, control, keys)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codraft", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}
    for module in SUBCOMMANDS:
        module.register(sub, commands)
    p.set_defaults(_commands=commands)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in PASSTHROUGH:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args._extra = extra
    raise SystemExit(args._commands[args.command](args))
