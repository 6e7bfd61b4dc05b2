"""`codraft learn`: train an EAGLE-3 draft, offline from tap files or online from a server.

The options and their translation into the learner's configs live in `codraft.learner.cli`, which
also runs alone (`python -m codraft.learner.cli`) on hosts that only have torch."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    from codraft.learner.cli import add_arguments

    sp = sub.add_parser("learn", help="train an EAGLE-3 draft (offline: --from-dir tap files)")
    add_arguments(sp)
    commands["learn"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.learner.cli import main

    return main(args)
