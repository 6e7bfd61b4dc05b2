"""`codraft learn`: offline from recorded tap files (--from-dir), or online from a live server
(--server, --tap). Both resume from the newest checkpoint in --out.

The learner's one command-line module: it declares the options and turns them into the config
dataclasses the library takes (`TrainConfig`, `ParallelConfig`, `PipelineTrainConfig`,
`OfflineConfig`, `OnlineConfig`); nothing below it sees argparse.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from codraft.control_token import resolve_control_token
from codraft.drafters import DRAFTERS
from codraft.learner.offline import OfflineConfig
from codraft.learner.online.buffer import BufferPolicy
from codraft.learner.parallel.launch import ParallelConfig
from codraft.learner.pipeline_trainer import PipelineTrainConfig
from codraft.learner.trainer import TrainConfig

if TYPE_CHECKING:
    from codraft.learner.online.daemon import OnlineConfig

OFFLINE_STEPS = 500  # --steps when not given, offline (online runs until stopped)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data source (one of)")
    src.add_argument("--from-dir", help="folder of recorded *.taps files (offline)")
    src.add_argument("--server", help="control API URL of a codraft server (online)")
    p.add_argument("--tap", default="tcp://127.0.0.1:5557", help="PULL endpoint to bind (online)")
    p.add_argument(
        "--tap-key",
        default=None,
        metavar="FILE_OR_DIR",
        help="online: this learner's secret tap certificate (NAME.key_secret from `codraft "
        "tap-keys`, or a folder holding one); with --tap-allowed-keys it turns CURVE on, "
        "which a --tap address off loopback requires",
    )
    p.add_argument(
        "--tap-allowed-keys",
        default=None,
        metavar="DIR",
        help="online: folder of the public certificates (NAME.key) of the servers whose taps "
        "are accepted; any other peer delivers nothing",
    )
    p.add_argument(
        "--buffer-max-bytes",
        type=int,
        default=BufferPolicy.max_bytes,
        help="online: bytes the sample buffer may hold (taps, final hidden states, ids, masks; "
        f"held-out samples included), default {BufferPolicy.max_bytes} (2 GiB)",
    )
    p.add_argument(
        "--holdout-key-file",
        default=None,
        metavar="FILE",
        help="online: the key (the file's bytes) of the held-out split's HMAC, for a split "
        "that repeats across restarts (default: a random key per learner)",
    )
    p.add_argument("--target", required=True, help="target model folder, or 'smollm2'")
    p.add_argument("--out", required=True, help="checkpoint folder (resumed when present)")
    p.add_argument(
        "--token", "--control-token", default=None, help="control token (or a file, or env)"
    )
    p.add_argument("--token-file", "--control-token-file", default=None)
    p.add_argument(
        "--server-ca",
        default=None,
        metavar="CA_FILE",
        help="online: the CA certificate (PEM file or folder) an https:// --server's certificate "
        "is checked against (default: the system's CAs)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"stop at this step (offline: {OFFLINE_STEPS})"
    )
    p.add_argument("--max-seconds", type=float, default=None, help="online: stop after this")
    p.add_argument("--k", type=int, default=TrainConfig.num_passes, help="TTT passes")
    p.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default=TrainConfig.drafter,
        help="the draft to train: EAGLE-3 (TTT passes), a DFlash block drafter, or DSpark "
        "(DFlash's backbone and a Markov head; offline only); online (--server), the kind the "
        "server serves wins",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=TrainConfig.block_size,
        help="dflash: slots a block (anchor + proposals); dspark: queries and proposals a block",
    )
    p.add_argument(
        "--dflash-layers", type=int, default=TrainConfig.dflash_layers, help="dflash: layers"
    )
    p.add_argument(
        "--mask-token",
        type=int,
        default=TrainConfig.mask_token_id,
        help="dflash: the target vocabulary id every mask slot holds",
    )
    p.add_argument(
        "--slot-decay",
        type=float,
        default=TrainConfig.slot_decay,
        help="dflash: slot s's loss weight is exp(-(s-1)/this); 0 weighs every slot alike",
    )
    p.add_argument(
        "--markov-rank",
        type=int,
        default=TrainConfig.markov_rank,
        help="dspark: the rank of the Markov head (its bias is markov_w2 @ markov_w1[token])",
    )
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--token-budget", type=int, default=TrainConfig.token_budget)
    p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab_size)
    p.add_argument(
        "--loss-chunk",
        type=int,
        default=TrainConfig.loss_chunk_tokens,
        help="anchors whose draft logits exist at once in the loss",
    )
    p.add_argument(
        "--recompute-mlp",
        action="store_true",
        help="run each pass's o_proj + MLP again in backward instead of keeping it (about half "
        "the step's memory for ~5%% of its time; 128K tokens of an 8B draft fit on one H200)",
    )
    p.add_argument(
        "--teacher-dtype",
        default=TrainConfig.teacher_dtype,
        help="the teacher head's dtype ('auto': bfloat16 under CUDA autocast, else float32)",
    )
    p.add_argument("--save-every", type=int, default=100, help="offline checkpoint interval")
    p.add_argument("--publish-every", type=int, default=20, help="online: steps per candidate")
    p.add_argument(
        "--publish-blocking",
        action="store_true",
        help="online: publish in the training loop (default: a background thread, training on)",
    )
    p.add_argument("--min-buffer-tokens", type=int, default=1024)
    p.add_argument(
        "--fresh-draft",
        action="store_true",
        help="online, no checkpoint in --out: a new draft even when the server serves a "
        "trained one (default: start from its weights)",
    )
    p.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="online: the address /health and /metrics listen on (default 127.0.0.1; a pod "
        "probed by its kubelet needs 0.0.0.0 or its own address)",
    )
    p.add_argument("--http-port", type=int, default=9100, help="online /health, /metrics (0: off)")
    p.add_argument("--recompute", action="store_true", help="run the target here for features")
    p.add_argument(
        "--tap-layers",
        default=None,
        help="a new draft's tap layers, comma-separated (default: EAGLE-3 (2, L//2, L-3), "
        "DFlash/DSpark spread over the target); recorded taps must be at these layers unless "
        "--recompute",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument(
        "--pad-multiple", type=int, default=None, help="pad documents to this (default 2 x cp)"
    )
    par = p.add_argument_group("parallelism (under torchrun)")
    par.add_argument(
        "--cp",
        type=int,
        default=ParallelConfig.cp,
        help="context-parallel ranks per batch (start under torchrun with a multiple of it)",
    )
    par.add_argument(
        "--group-timeout",
        type=float,
        default=ParallelConfig.timeout_s,
        help="seconds a rank waits in a collective before it fails (torchrun --max-restarts "
        "then restarts the group from the newest checkpoint)",
    )
    d = PipelineTrainConfig
    par.add_argument(
        "--pp", type=int, default=ParallelConfig.pp, help="pipeline stages for target recompute"
    )
    par.add_argument("--microbatches", type=int, default=d.microbatches, help="per batch (--pp)")
    par.add_argument("--tap-slots", type=int, default=d.tap_slots, help="TapChannel ring size")
    par.add_argument("--tap-timeout", type=float, default=d.tap_timeout_s, help="seconds")
    par.add_argument("--pipeline-timeout", type=float, default=d.pipeline_timeout_s, help="seconds")
    par.add_argument("--target-dtype", default=d.target_dtype, help="target compute dtype (--pp)")


# ------------------------------------------------------------------ options -> configs
def _tap_layers(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise SystemExit(
            f"codraft learn: --tap-layers wants layer numbers separated by commas, such as "
            f"2,15,27; got {text!r}"
        ) from None


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The trainer's settings; offline (a set number of steps) the schedule spans the run."""
    offline = {}
    if args.from_dir:
        offline["total_steps"] = OFFLINE_STEPS if args.steps is None else args.steps
    return TrainConfig(
        lr=args.lr,
        num_passes=args.k,
        drafter=args.drafter,
        block_size=args.block_size,
        dflash_layers=args.dflash_layers,
        mask_token_id=args.mask_token,
        slot_decay=args.slot_decay or None,
        markov_rank=args.markov_rank,
        tap_layers=_tap_layers(args.tap_layers),
        token_budget=args.token_budget,
        draft_vocab_size=args.draft_vocab,
        loss_chunk_tokens=args.loss_chunk,
        recompute_mlp=args.recompute_mlp,
        teacher_dtype=args.teacher_dtype,
        device=args.device,
        seed=args.seed,
        recompute=args.recompute,
        **offline,
    )


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(cp=args.cp, pp=args.pp, device=args.device, timeout_s=args.group_timeout)


def pipeline_config_from_args(args: argparse.Namespace) -> PipelineTrainConfig:
    return PipelineTrainConfig(
        microbatches=args.microbatches,
        tap_slots=args.tap_slots,
        tap_timeout_s=args.tap_timeout,
        pipeline_timeout_s=args.pipeline_timeout,
        target_dtype=args.target_dtype,
    )


def offline_config_from_args(args: argparse.Namespace) -> OfflineConfig:
    return OfflineConfig(
        data_dir=args.from_dir,
        target=args.target,
        out=args.out,
        train=train_config_from_args(args),
        parallel=parallel_config_from_args(args),
        save_every=args.save_every,
        pad_multiple=args.pad_multiple,
    )


def online_config_from_args(args: argparse.Namespace) -> OnlineConfig:
    """The online learner's settings; ValueError when the control token options are unusable
    (`codraft.control_token`: --token, else --token-file, else $CODRAFT_CONTROL_TOKEN)."""
    from codraft.learner.online.daemon import OnlineConfig

    key = None
    if args.holdout_key_file:
        try:
            key = Path(args.holdout_key_file).read_bytes()
        except OSError as e:
            raise ValueError(f"--holdout-key-file {args.holdout_key_file}: {e}") from None
        if len(key) < 16:
            raise ValueError(
                f"--holdout-key-file {args.holdout_key_file} holds {len(key)} bytes: a key needs "
                "16 or more (e.g. head -c 32 /dev/urandom > FILE)"
            )
    if args.buffer_max_bytes < 1:
        raise ValueError(f"--buffer-max-bytes must be >= 1, got {args.buffer_max_bytes}")
    return OnlineConfig(
        server=args.server,
        token=resolve_control_token(args.token, args.token_file),
        server_ca=args.server_ca,
        tap=args.tap,
        tap_key=args.tap_key,
        tap_allowed_keys=args.tap_allowed_keys,
        buffer=BufferPolicy(max_bytes=args.buffer_max_bytes, holdout_key=key),
        target=args.target,
        out=args.out,
        http_host=args.http_host,
        http_port=args.http_port,
        min_buffer_tokens=args.min_buffer_tokens,
        publish_every_steps=args.publish_every,
        publish_in_background=not args.publish_blocking,
        max_steps=args.steps,
        max_seconds=args.max_seconds,
        warm_start=not args.fresh_draft,
        train=train_config_from_args(args),
        parallel=parallel_config_from_args(args),
        pipeline=pipeline_config_from_args(args),
    )


# ------------------------------------------------------------------ the command
def main(args: argparse.Namespace) -> int:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    if bool(args.from_dir) == bool(args.server):
        raise SystemExit("codraft learn: give exactly one of --from-dir DIR or --server URL")
    if args.drafter in ("dflash", "dspark") and args.pp > 1:
        raise SystemExit(
            f"codraft learn: --drafter {args.drafter} trains in one pipeline stage: drop --pp "
            "(online, the learner trains the kind of draft the server serves)"
        )
    if args.drafter == "dspark" and args.server:
        raise SystemExit(
            "codraft learn: --drafter dspark trains offline only (--from-dir): codraft serve "
            "does not serve DSpark drafts, so no server streams taps for one"
        )
    if args.pp > 1 and args.from_dir:
        from codraft.learner.pipeline_trainer import train_pipeline

        result = train_pipeline(offline_config_from_args(args), pipeline_config_from_args(args))
        if "steps" in result:  # the rank that logs and checkpoints
            print(json.dumps(result, indent=2))
        return 0
    if args.from_dir:
        from codraft.learner.offline import train_from_dir

        print(json.dumps(train_from_dir(offline_config_from_args(args)), indent=2))
        return 0
    from codraft.learner.online.daemon import OnlineLearner

    try:
        cfg = online_config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"codraft learn: {e}") from None
    learner = OnlineLearner(cfg)  # under torchrun: every rank, dp x cp from the world size
    learner.install_signal_handlers()
    health = learner.run()
    if learner.main:
        print(json.dumps(health, indent=2))
    return 0


# `python -m codraft.learner.cli ...`: the learner alone (torch-only hosts)
if __name__ == "__main__":
    import sys

    _parser = argparse.ArgumentParser(prog="codraft learn")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
