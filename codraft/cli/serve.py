"""`codraft serve`: vLLM's (or, --engine sglang, SGLang's) OpenAI server with a draft, the
tap and the control API."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any, commands: dict[str, Any]) -> None:
    from codraft.server.serve_config import add_arguments

    sp = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="vLLM's (or SGLang's) OpenAI server with a draft, the tap and the control API",
        description="Arguments codraft serve does not know are passed to the engine's own "
        "parser (vLLM: e.g. --max-num-seqs 32; SGLang: e.g. --mem-fraction-static 0.5).",
    )
    add_arguments(sp)
    commands["serve"] = run


def run(args: argparse.Namespace) -> int:
    from codraft.server.serve_config import config_from_args

    try:
        cfg = config_from_args(args, args._extra)
    except ValueError as e:
        print(f"codraft serve: {e}", file=sys.stderr)
        return 2
    if cfg.engine == "sglang":
        from codraft.server.sglang.serve import main as sglang_main

        return sglang_main(cfg)
    from codraft.server.vllm_env import ensure_cpu_preload

    ensure_cpu_preload()  # re-executes once with Intel OpenMP preloaded (CPU machines)
    from codraft.server.serve import main

    return main(cfg)
