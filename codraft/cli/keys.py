"""`codraft tap-keys DIR`: a CURVE key pair for the tap (codraft.tap.auth)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    sp = sub.add_parser(
        "tap-keys",
        help="write a CURVE key pair for the tap: DIR/NAME.key (public, give it to the peer) "
        "and DIR/NAME.key_secret (secret, owner-only)",
    )
    sp.add_argument("dir", help="folder to write the two certificate files into")
    sp.add_argument("--name", default="tap", help="file name stem (default: tap)")
    commands["tap-keys"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.tap.auth import create_keys

    try:
        public, secret = create_keys(args.dir, args.name)
    except FileExistsError as e:
        raise SystemExit(f"codraft tap-keys: {e}") from None
    print(f"public: {public}\nsecret: {secret}")
    return 0
