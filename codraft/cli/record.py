"""`codraft record`: a server's tap stream written to tap files."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    from codraft.server.record import add_arguments

    sp = sub.add_parser("record", help="write a server's tap stream to tap files")
    add_arguments(sp)
    commands["record"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.server.record import config_from_args, main

    return main(config_from_args(args))
