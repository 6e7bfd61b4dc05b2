"""`codraft learn --from-dir DIR`: train a draft offline from recorded tap files.

The files are the ones `codraft record` writes from a live server (or any TapWriter output):
full-mode messages carry the target's taps and last hidden state; ids-only messages make the
trainer recompute them with the target (`TrainConfig.recompute`, or automatically). Training
resumes from the newest checkpoint in the output folder, data position included, so a killed run
continues where it stopped. Each checkpoint's `draft/` folder is an EAGLE-3 checkpoint stock vLLM
loads. `OfflineConfig` says what to run; `train_from_dir` runs it (codraft.learner.cli builds the
config from the command line).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from codraft.learner.checkpoints import newest_good
from codraft.learner.data.packing import Sample, pack_stream
from codraft.learner.dflash_trainer import make_trainer
from codraft.learner.parallel.context import ContextParallel
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, my_batches, shutdown
from codraft.learner.trainer import StepMetrics, TrainConfig
from codraft.models.config import TargetConfig
from codraft.prepare import resolve_model
from codraft.tap import TapDataset, TapExpectation, model_fingerprint, read_taps

log = logging.getLogger("codraft.learn")


@dataclass
class OfflineConfig:
    """One training run over recorded tap files (offline, or with the pipeline trainer).

    Training stops at ``train.total_steps`` (also the length of the learning-rate schedule).
    Each rank trains on the device ``init_distributed`` picks from ``parallel.device``.
    """

    data_dir: str | Path  # folder of recorded *.taps files
    target: str | Path = "smollm2"  # target model folder, or a name codraft.prepare resolves
    out: str | Path = "runs/offline"  # checkpoint folder (resumed when present)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    save_every: int = 100  # steps between checkpoints (and one at the end)
    pad_multiple: int | None = None  # pad documents to this (default and minimum: 2 x cp)


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


def tap_expectation(target_config: TargetConfig) -> TapExpectation:
    """What every recorded message of this target must match (fingerprint, vocabulary)."""
    return TapExpectation(
        fingerprint=model_fingerprint(target_config), vocab_size=target_config.vocab_size
    )


def train_from_dir(cfg: OfflineConfig, *, target_config: TargetConfig | None = None) -> dict:
    """Train (or resume) to ``cfg.train.total_steps`` under torchrun with ``cfg.parallel.cp``
    context-parallel ranks per batch, or in one process. `target_config`: the target's parsed
    config.json, when the caller has read it already. Returns the run's summary."""
    target = resolve_model(cfg.target)
    tcfg = target_config if target_config is not None else TargetConfig.from_pretrained(target)
    expect = tap_expectation(tcfg)
    data, out = Path(cfg.data_dir), Path(cfg.out)
    steps = cfg.train.total_steps
    mesh, device = init_distributed(cfg.parallel)
    parallel = ContextParallel(mesh) if mesh.dims.world_size > 1 else None
    train = replace(cfg.train, device=str(device))
    main = mesh.is_main
    fresh = newest_good(out) is None
    counts = token_counts(data, tcfg.vocab_size, expect) if fresh else None
    trainer = make_trainer(
        target, out, train, token_counts=counts, parallel=parallel, target_config=tcfg
    )
    position = trainer.resume()
    ds = TapDataset(data, expect=expect, loop=True, position=position)
    start = trainer.step_count
    bar = tqdm(total=steps, initial=start, desc="train draft", unit="step", disable=not main)
    history: list[dict] = []
    metrics_file = out / "metrics.jsonl"
    last: StepMetrics | None = None
    cursor = position
    t0 = time.perf_counter()
    least = parallel.pad_multiple if parallel is not None else 1
    pad = max(least, cfg.pad_multiple or 1)
    if pad % least:
        raise SystemExit(f"--pad-multiple {pad} must be a multiple of 2 x cp")
    stream = pack_stream(samples(ds), token_budget=train.token_budget, pad_multiple=pad)
    for batch, batch_cursor in my_batches(stream, mesh):
        if trainer.step_count >= steps:
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
        if main and (trainer.step_count % cfg.save_every == 0 or trainer.step_count >= steps):
            trainer.save(cursor)
    bar.close()
    if main and last is not None and trainer.step_count % cfg.save_every:
        trainer.save(cursor)
    shutdown()
    latest = trainer.ckpt.latest()
    return {
        "steps": trainer.step_count,
        "seconds": time.perf_counter() - t0,
        "draft": str(latest / "draft") if latest else None,
        "final": history[-1] if history else None,
    }
