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
    fresh = not (out / "latest").exists()
    counts = token_counts(data, tcfg.vocab_size, expect) if fresh else None
    trainer = Trainer(target, out, cfg, token_counts=counts)
    position = trainer.resume()
    ds = TapDataset(data, expect=expect, loop=True, position=position)
    start = trainer.step_count
    bar = tqdm(total=args.steps, initial=start, desc="train draft", unit="step")
    history: list[dict] = []
    metrics_file = out / "metrics.jsonl"
    last: StepMetrics | None = None
    cursor = position
    t0 = time.perf_counter()
    for batch in pack_stream(samples(ds), token_budget=cfg.token_budget):
        if trainer.step_count >= args.steps:
            break
        last = trainer.step(batch)
        cursor = batch.cursor
        row = {"step": last.step, "loss": last.loss, "lr": last.lr, "acc": last.pass_acc}
        history.append(row)
        with open(metrics_file, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{last.loss:.3f}", acc1=f"{last.pass_acc[0]:.2f}")
        if trainer.step_count % args.save_every == 0 or trainer.step_count >= args.steps:
            trainer.save(cursor)
    bar.close()
    if last is not None and trainer.step_count % args.save_every:
        trainer.save(cursor)
    latest = trainer.ckpt.latest()
    return {
        "steps": trainer.step_count,
        "seconds": time.perf_counter() - t0,
        "draft": str(latest / "draft") if latest else None,
        "final": history[-1] if history else None,
    }
