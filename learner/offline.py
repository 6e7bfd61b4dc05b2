"""`codraft learn --from-dir DIR`: train a draft offline from recorded tap files.

The files are the ones `codraft record` writes from a live server (or any TapWriter output):
full-mode messages carry the target's taps and last hidden state; ids-only messages make the
trainer recompute them with the target (`--recompute`, or automatically). Training resumes from
the newest checkpoint in --out, data position included, so a killed run continues where it
stopped. Each checkpoint's `draft/` folder is an EAGLE-3 checkpoint stock vLLM loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from codraft.prepare import resolve_model
from codraft.tap import TapDataset, TapExpectation, model_fingerprint, read_taps
from learner.data.packing import Sample, pack_stream
from learner.parallel.context import ContextParallel
from learner.parallel.launch import config_from_args, init_distributed, my_batches, shutdown
from learner.trainer import StepMetrics, TrainConfig, Trainer

log = logging.getLogger("codraft.learn")


def token_counts(path: Path, vocab_size: int, expect: TapExpectation) -> torch.Tensor:
    """Token frequencies of the recorded completions (the draft vocab's source)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for msg in read_taps(path, expect=expect):
        ids = msg.token_ids.to(torch.int64)[msg.loss_mask.bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def samples(ds: TapDataset) -> Iterator[Sample]:
    for msg in ds:
        yield Sample.from_tap(msg, cursor=ds.state_dict())


def _parallel(args: argparse.Namespace):
    """The mesh under torchrun (`--cp N`), or a single process; ContextParallel only when the
    job has more than one rank."""
    mesh, device = init_distributed(config_from_args(args))
    parallel = ContextParallel(mesh) if mesh.dims.world_size > 1 else None
    return mesh, device, parallel


def train_from_dir(args: argparse.Namespace) -> dict:
    target = resolve_model(args.target)
    cfg = TrainConfig(
        lr=args.lr,
        num_passes=args.k,
        token_budget=args.token_budget,
        draft_vocab_size=args.draft_vocab,
        total_steps=args.steps,
        device=args.device,
        seed=args.seed,
        recompute=args.recompute,
    )
    data = Path(args.from_dir)
    out = Path(args.out)
    from codraft.models.config import TargetConfig

    tcfg = TargetConfig.from_pretrained(target)
    expect = TapExpectation(fingerprint=model_fingerprint(tcfg), vocab_size=tcfg.vocab_size)
    mesh, device, parallel = _parallel(args)
    cfg.device = str(device)
    main = mesh.is_main
    fresh = not (out / "latest").exists()
    counts = token_counts(data, tcfg.vocab_size, expect) if fresh else None
    trainer = Trainer(target, out, cfg, token_counts=counts, parallel=parallel)
    position = trainer.resume()
    ds = TapDataset(data, expect=expect, loop=True, position=position)
    start = trainer.step_count
    bar = tqdm(total=args.steps, initial=start, desc="train draft", unit="step", disable=not main)
    history: list[dict] = []
    metrics_file = out / "metrics.jsonl"
    last: StepMetrics | None = None
    cursor = position
    t0 = time.perf_counter()
    pad = parallel.pad_multiple if parallel is not None else 1
    pad = max(pad, getattr(args, "pad_multiple", None) or 1)
    if pad % (parallel.pad_multiple if parallel is not None else 1):
        raise SystemExit(f"--pad-multiple {pad} must be a multiple of 2 x cp")
    stream = pack_stream(samples(ds), token_budget=cfg.token_budget, pad_multiple=pad)
    for batch, batch_cursor in my_batches(stream, mesh):
        if trainer.step_count >= args.steps:
            break
        last = trainer.step(batch)
        cursor = batch_cursor
        row = {"step": last.step, "loss": last.loss, "lr": last.lr, "acc": last.pass_acc}
        history.append(row)
        if main:
            with open(metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{last.loss:.3f}", acc1=f"{last.pass_acc[0]:.2f}")
        if main and (trainer.step_count % args.save_every == 0 or trainer.step_count >= args.steps):
            trainer.save(cursor)
    bar.close()
    if main and last is not None and trainer.step_count % args.save_every:
        trainer.save(cursor)
    shutdown()
    latest = trainer.ckpt.latest()
    return {
        "steps": trainer.step_count,
        "seconds": time.perf_counter() - t0,
        "draft": str(latest / "draft") if latest else None,
        "final": history[-1] if history else None,
    }
