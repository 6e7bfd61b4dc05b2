"""The pipeline trainer: the draft trained on ids-only data, with the target's features
recomputed across `pp` pipeline stages (`codraft learn --pp N [--cp M]`; docs/pipeline.md).
Start under torchrun:

    torchrun --nproc-per-node 4 -m codraft.learner.cli --from-dir taps/ --target smollm2 \
        --out ck/ --pp 4 --microbatches 8

Every rank loads only its stage of the target (`load_stage`). Per pipeline, the last stage owns
the `Trainer` (draft, optimizer, checkpoints, data position): it reads and packs the data and
broadcasts each ids-only batch to its stages; the pipeline runs the target over the batch's
microbatches, TapChannel brings the taps to the last stage, and there the draft trains:

* cp = 1: per microbatch, as it arrives (`DraftStage`), gradients accumulated;
* cp > 1: `cp` pipelines per replica share the batch's microbatches; the last stage's CP ranks
  gather the whole batch's features and run the context-parallel TTT step (`pp_cp`).

Gradients and loss denominators are summed over the last stage's dp x cp ranks, so every step
is the single-device step on all of that step's data. World size = pp x dp x cp (dp inferred).
The pp and cp degrees come from the run's `ParallelConfig` (`OfflineConfig.parallel`); the
pipeline's own knobs from `PipelineTrainConfig`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from codraft.draft.model import Eagle3Draft
from codraft.learner.checkpoints import newest_good
from codraft.learner.data.packing import PackedBatch, pack_stream
from codraft.learner.offline import OfflineConfig, samples, tap_expectation, token_counts
from codraft.learner.parallel.batch_broadcast import broadcast_batch
from codraft.learner.parallel.draft_stage import DraftStage
from codraft.learner.parallel.launch import init_distributed, shutdown
from codraft.learner.parallel.mesh import ParallelMesh
from codraft.learner.parallel.pipeline import Pipeline, PipelineConfig
from codraft.learner.parallel.pipeline_mesh import PipelineGroups
from codraft.learner.parallel.pp_cp import FeatureCollector, cp_draft_step
from codraft.learner.parallel.stage import load_stage, split_layers
from codraft.learner.parallel.tapchannel import TapChannelConfig
from codraft.learner.teacher import Teacher
from codraft.learner.trainer import StepMetrics, TrainConfig, Trainer
from codraft.models.config import TargetConfig
from codraft.prepare import resolve_model
from codraft.tap import TapDataset

log = logging.getLogger("codraft.learn.pp")


@dataclass
class PipelineTrainConfig:
    """The pipeline's own settings (the pp and cp degrees are the run's `ParallelConfig`)."""

    microbatches: int = 4  # per batch and pipeline group (fewer for batches of fewer documents)
    tap_slots: int = 2  # TapChannel landing slots per source
    tap_timeout_s: float = 60.0  # longest TapChannel wait
    pipeline_timeout_s: float = 300.0  # longest wait for activations
    target_dtype: str = "float32"  # the target's compute dtype (float32, bfloat16, float16)

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if not isinstance(getattr(torch, self.target_dtype, None), torch.dtype):
            raise ValueError(f"unknown target dtype {self.target_dtype!r}; use float32/bfloat16")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.target_dtype)


class PipelineLearner:
    """One rank of a recompute-mode learner: its pipeline (its target stage, its TapChannel)
    and, on the last stage, the trainer. Every rank calls `step` in lockstep; see the module
    docstring. `load` builds one from a target folder; the constructor takes the parts."""

    def __init__(
        self,
        pipeline: Pipeline,
        trainer: Trainer | None,
        mesh: ParallelMesh,
        device: torch.device,
    ) -> None:
        """`pipeline`: this rank's (`Pipeline`, built with the draft's tap layers); `trainer`:
        the draft's, on the last stage only (None elsewhere)."""
        self.pipeline, self.trainer, self.mesh, self.device = pipeline, trainer, mesh, device
        self.groups = pipeline.groups
        if self.groups.is_last != (trainer is not None):
            raise ValueError("the last stage of a pipeline needs the trainer, other stages none")
        self.stage = pipeline.stage
        self.tap_layers = pipeline.tap_layers
        self.channel = pipeline.channel
        self._cp = None
        if self.groups.is_last and mesh.dims.cp > 1:
            from codraft.learner.parallel.context import ContextParallel

            self._cp = ContextParallel(mesh)

    @classmethod
    def load(
        cls,
        target_dir: str | Path,
        out_dir: str | Path,
        train: TrainConfig,
        cfg: PipelineTrainConfig,
        mesh: ParallelMesh,
        device: torch.device,
        token_counts: torch.Tensor | None = None,
        *,
        target_config: TargetConfig | None = None,
        draft: Eagle3Draft | None = None,
    ) -> PipelineLearner:
        """This rank's stage of the target in `target_dir`, its pipeline and (last stage) the
        trainer checkpointing into `out_dir`, training `draft` when given (last stage; else a
        new one, its vocabulary from `token_counts`). Collective over the mesh (groups, the
        tap layers' broadcast). `target_config`: the folder's config.json, when already read."""
        tcfg = target_config
        if tcfg is None:
            tcfg = TargetConfig.from_pretrained(target_dir)
        g = PipelineGroups.build(mesh)
        stage = load_stage(target_dir, g.stage, g.num_stages, cfg.torch_dtype, device, config=tcfg)
        trainer: Trainer | None = None
        tap_layers: list[Any] = [None]
        if g.is_last:
            train = replace(train, recompute=False, device=str(device))
            trainer = Trainer(
                target_dir, out_dir, train, token_counts=token_counts, target_config=tcfg,
                teacher=Teacher(stage.lm_head), draft=draft,  # the stage's own lm_head
            )  # fmt: skip
            tap_layers = [list(trainer.tap_layers)]
        if g.pp_group is not None:
            dist.broadcast_object_list(
                tap_layers, src=g.stage_ranks[-1], group=g.pp_group, device=device
            )
        taps = tuple(tap_layers[0])
        channel = g.tap_channel(
            taps,
            split_layers(stage.config.num_layers, g.num_stages),
            dtype=cfg.torch_dtype,
            device=device,
            config=TapChannelConfig(cfg.tap_slots, cfg.tap_timeout_s),
        )
        pipeline = Pipeline(
            stage, g, taps, channel, PipelineConfig(cfg.microbatches, cfg.pipeline_timeout_s)
        )
        return cls(pipeline, trainer, mesh, device)

    @property
    def is_data_rank(self) -> bool:
        """Reads the data for its pipeline (the last stage, which owns the data position)."""
        return self.groups.is_last

    @property
    def is_main(self) -> bool:
        """The one rank that logs and checkpoints: the last stage of replica 0, CP rank 0."""
        return self.groups.is_last and self.mesh.dp_rank == 0 and self.mesh.cp_rank == 0

    def _autocast(self) -> torch.dtype | None:
        tr = self.trainer
        use = tr.cfg.autocast_bf16 and self.device.type == "cuda"
        return torch.bfloat16 if use else None

    def _reduce(self, t: torch.Tensor) -> torch.Tensor:
        group = self.mesh.dp_cp_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    def step(self, batch: PackedBatch | None) -> StepMetrics | bool | None:
        """One training step on every rank of the pipeline. The data rank passes the batch
        (None: stop); the others pass None. Returns None when stopped, the step's metrics on
        the last stage, True elsewhere."""
        g = self.groups
        src = g.stage_ranks[-1]
        batch = broadcast_batch(batch, src, g.pp_group, self.device) if g.pp_group else batch
        if batch is None:
            return None
        share = (self.mesh.cp_rank, self.mesh.dims.cp)
        if not g.is_last:
            self.pipeline.run(batch, None, share)
            return True
        return self._train_step(batch, share)

    @torch.no_grad()
    def features(self, batch: PackedBatch | None) -> PackedBatch | None:
        """The target over `batch` on every rank of the pipeline, nothing trained: the last
        stages get the batch with the whole batch's taps and last hidden states (gathered over
        their CP group), the stages before None. The data rank passes the batch, the others
        None. Collective over the pipeline (and the last stage's CP group)."""
        g = self.groups
        src = g.stage_ranks[-1]
        batch = broadcast_batch(batch, src, g.pp_group, self.device) if g.pp_group else batch
        if batch is None:
            raise ValueError("features needs the data rank's batch")
        share = (self.mesh.cp_rank, self.mesh.dims.cp)
        if not g.is_last:
            self.pipeline.run(batch, None, share)
            return None
        return self._collect(batch, share)

    def _collect(self, batch: PackedBatch, share: tuple[int, int]) -> PackedBatch:
        """The last stage: run the pipeline over `batch` and gather its features."""
        collector = FeatureCollector()
        width = len(self.tap_layers) * self.stage.config.hidden_size
        collector.begin(
            batch, width, self.stage.config.hidden_size, self.pipeline.dtype, self.device
        )
        self.pipeline.run(batch, collector, share)
        return collector.gather(self.mesh.cp_group)

    def draft_stage(self) -> DraftStage:
        """The last stage's consumer for one step with cp = 1: the draft's TTT per microbatch."""
        tr = self.trainer
        return DraftStage(
            tr.draft, tr.teacher, tr.cfg.ttt(), reduce_counts=self._reduce,
            autocast_dtype=self._autocast(),
        )  # fmt: skip

    def _train_step(self, batch: PackedBatch, share: tuple[int, int]) -> StepMetrics:
        tr = self.trainer
        t0 = time.perf_counter()
        lr = tr.begin_step()
        params = list(tr.draft.parameters())
        if self._cp is None:
            consumer = self.draft_stage()
            consumer.begin(batch)
            self.pipeline.run(batch, consumer, share)
            res = consumer.finish()
            sums = torch.tensor([res.loss, *res.pass_correct, *res.pass_valid], dtype=torch.float64)
            self._reduce_grads(params)
        else:
            full = self._collect(batch, share)
            out = cp_draft_step(
                self._cp, tr.draft, tr.teacher, full, tr.cfg.ttt(), self._autocast()
            )
            self._cp.reduce_gradients(params)
            sums = torch.tensor(
                [float(out.loss.detach()), *[float(c) for c in out.pass_correct],
                 *[float(v) for v in out.pass_valid]], dtype=torch.float64,
            )  # fmt: skip
        sums = self._reduce(sums.to(self.device)).cpu()
        grad_norm = tr.end_step(int(batch.valid.sum()))
        K = tr.cfg.num_passes
        correct, valid = sums[1 : 1 + K].tolist(), sums[1 + K :].tolist()
        return StepMetrics(
            step=tr.step_count,
            loss=float(sums[0]),
            lr=lr,
            grad_norm=float(grad_norm),
            tokens=batch.num_tokens,
            pass_acc=[c / max(1.0, v) for c, v in zip(correct, valid, strict=True)],
            seconds=time.perf_counter() - t0,
        )

    def _reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        group = self.mesh.dp_cp_group
        if group is None or dist.get_world_size(group) == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def _batches(learner: PipelineLearner, ds: TapDataset, budget: int) -> Iterator[PackedBatch]:
    """This replica's batches of the common stream (batch i goes to replica i % dp)."""
    cp = learner.mesh.dims.cp
    pad = 2 * cp if cp > 1 else 1
    for i, batch in enumerate(pack_stream(samples(ds), token_budget=budget, pad_multiple=pad)):
        if i % learner.mesh.dp_size == learner.mesh.dp_rank:
            yield batch


def train_pipeline(
    run: OfflineConfig,
    pipeline: PipelineTrainConfig | None = None,
    *,
    target_config: TargetConfig | None = None,
) -> dict[str, Any]:
    """The recompute-mode training loop (every rank runs it; see the module docstring): `run`
    says what to train on and for how long (`run.parallel`: pp and cp), `pipeline` how the
    pipeline runs. `target_config`: the target's parsed config.json, when already read."""
    pipeline = pipeline or PipelineTrainConfig()
    steps = run.train.total_steps
    mesh, device = init_distributed(run.parallel)
    target = resolve_model(run.target)
    tcfg = target_config if target_config is not None else TargetConfig.from_pretrained(target)
    expect = tap_expectation(tcfg)
    out, data = Path(run.out), Path(run.data_dir)
    counts = None
    if mesh.pp_rank == mesh.dims.pp - 1 and newest_good(out) is None:
        counts = token_counts(data, tcfg.vocab_size, expect)
    learner = PipelineLearner.load(
        target, out, run.train, pipeline, mesh, device, counts, target_config=tcfg
    )
    tr = learner.trainer
    batches: Iterator[PackedBatch] | None = None
    if learner.is_data_rank:
        position = tr.resume()
        ds = TapDataset(data, expect=expect, loop=True, position=position)
        batches = _batches(learner, ds, run.train.token_budget)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    bar = None
    if learner.is_main:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=tr.step_count, desc="train draft (pp)", unit="step")
    cursor = None
    while True:
        batch = None
        if learner.is_data_rank and tr.step_count < steps:
            batch = next(batches, None)
        got = learner.step(batch)
        if got is None:
            break
        if not isinstance(got, StepMetrics):
            continue
        cursor = batch.cursor
        row = {"step": got.step, "loss": got.loss, "lr": got.lr, "acc": got.pass_acc}
        if learner.is_main:
            history.append(row)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{got.loss:.3f}", acc1=f"{got.pass_acc[0]:.2f}")
            if tr.step_count % run.save_every == 0 or tr.step_count >= steps:
                tr.save(cursor)
    if bar is not None:
        bar.close()
    learner.close()
    result: dict[str, Any] = {"rank": mesh.rank, "stage": learner.groups.stage}
    if learner.is_main:
        if tr.step_count % run.save_every and history:
            tr.save(cursor)
        latest = tr.ckpt.latest()
        result.update(
            steps=tr.step_count,
            seconds=time.perf_counter() - t0,
            draft=str(latest / "draft") if latest else None,
            final=history[-1] if history else None,
        )
    shutdown()
    return result
