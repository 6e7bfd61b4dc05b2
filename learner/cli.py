"""`codraft learn`: offline from recorded tap files (--from-dir), or online from a live server
(--server, --tap). Both resume from the newest checkpoint in --out."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from learner.parallel.launch import add_parallel_arguments
from learner.recompute import add_pp_arguments
from learner.trainer import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data source (one of)")
    src.add_argument("--from-dir", help="folder of recorded *.taps files (offline)")
    src.add_argument("--server", help="control API URL of a codraft server (online)")
    p.add_argument("--tap", default="tcp://127.0.0.1:5557", help="PULL endpoint to bind (online)")
    p.add_argument("--target", required=True, help="target model folder, or 'smollm2'")
    p.add_argument("--out", required=True, help="checkpoint folder (resumed when present)")
    p.add_argument(
        "--token", "--control-token", default=None, help="control token (or a file, or env)"
    )
    p.add_argument("--token-file", "--control-token-file", default=None)
    p.add_argument("--steps", type=int, default=None, help="stop at this step (offline: 500)")
    p.add_argument("--max-seconds", type=float, default=None, help="online: stop after this")
    p.add_argument("--k", type=int, default=3, help="TTT passes")
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--token-budget", type=int, default=TrainConfig.token_budget)
    p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab_size)
    p.add_argument("--save-every", type=int, default=100, help="offline checkpoint interval")
    p.add_argument("--publish-every", type=int, default=20, help="online: steps per candidate")
    p.add_argument(
        "--publish-blocking",
        action="store_true",
        help="online: publish in the training loop (default: a background thread, training on)",
    )
    p.add_argument("--min-buffer-tokens", type=int, default=1024)
    p.add_argument("--http-port", type=int, default=9100, help="online /health, /metrics (0: off)")
    p.add_argument("--recompute", action="store_true", help="run the target here for features")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pad-multiple", type=int, default=None, help="pad documents to this (default 2 x cp)"
    )
    add_parallel_arguments(p)
    add_pp_arguments(p)


def _token(args: argparse.Namespace) -> str | None:
    if args.token:
        return args.token
    if args.token_file:
        return Path(args.token_file).read_text().strip()
    return os.environ.get("CODRAFT_CONTROL_TOKEN") or None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if bool(args.from_dir) == bool(args.server):
        raise SystemExit("codraft learn: give exactly one of --from-dir DIR or --server URL")
    if getattr(args, "pp", 1) > 1:
        if not args.from_dir:
            raise SystemExit("codraft learn --pp needs --from-dir (ids-only or full tap files)")
        from learner.recompute import main as pp_main

        return pp_main(args)
    if args.from_dir:
        from learner.offline import train_from_dir

        if args.steps is None:
            args.steps = 500
        print(json.dumps(train_from_dir(args), indent=2))
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit(
            "codraft learn --server runs as one process for now (one GPU or CPU); context and "
            "pipeline parallelism work offline: torchrun ... codraft learn --from-dir DIR --cp N"
        )
    from learner.online.daemon import OnlineConfig, OnlineLearner

    cfg = OnlineConfig(
        server=args.server,
        token=_token(args),
        tap=args.tap,
        target=args.target,
        out=args.out,
        http_port=args.http_port,
        min_buffer_tokens=args.min_buffer_tokens,
        publish_every_steps=args.publish_every,
        publish_in_background=not args.publish_blocking,
        max_steps=args.steps,
        max_seconds=args.max_seconds,
        train=TrainConfig(
            lr=args.lr,
            num_passes=args.k,
            token_budget=args.token_budget,
            draft_vocab_size=args.draft_vocab,
            device=args.device,
            seed=args.seed,
            recompute=args.recompute,
        ),
    )
    learner = OnlineLearner(cfg)
    learner.install_signal_handlers()
    print(json.dumps(learner.run(), indent=2))
    return 0


if __name__ == "__main__":  # `python -m learner.cli ...`: the learner alone (torch-only hosts)
    import sys

    _parser = argparse.ArgumentParser(prog="codraft learn")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
