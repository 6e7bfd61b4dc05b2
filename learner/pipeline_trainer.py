"""`codraft learn --pp N [--cp M]`: train the draft on ids-only data, with the target's features
recomputed across N pipeline stages (DESIGN.md section 6). Start under torchrun:

    torchrun --nproc-per-node 4 -m learner.recompute --from-dir taps/ --target smollm2 \
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
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from codraft.models.config import TargetConfig
from codraft.prepare import resolve_model
from codraft.tap import TapDataset, TapExpectation, model_fingerprint
from learner.data.packing import PackedBatch, pack_stream
from learner.offline import samples, token_counts
from learner.parallel.batch_broadcast import broadcast_batch
from learner.parallel.draft_stage import DraftStage
from learner.parallel.launch import ParallelConfig, init_distributed, shutdown
from learner.parallel.mesh import ParallelMesh
from learner.parallel.pipeline import Pipeline, PipelineConfig
from learner.parallel.pipeline_mesh import PipelineGroups
from learner.parallel.pp_cp import FeatureCollector, cp_draft_step
from learner.parallel.stage import load_stage, split_layers
from learner.parallel.tapchannel import TapChannelConfig
from learner.teacher import Teacher
from learner.trainer import StepMetrics, TrainConfig, Trainer

log = logging.getLogger("codraft.learn.pp")


@dataclass
class PipelineTrainConfig:
    pp: int = 2  # pipeline stages
    cp: int = 1  # context-parallel ranks per batch (the draft step)
    microbatches: int = 4  # per batch and pipeline group (fewer for batches of fewer documents)
    tap_slots: int = 2  # TapChannel landing slots per source
    tap_timeout_s: float = 60.0  # longest TapChannel wait
    pipeline_timeout_s: float = 300.0  # longest wait for activations
    target_dtype: str = "float32"  # the target's compute dtype (float32, bfloat16, float16)

    def __post_init__(self) -> None:
        if self.pp < 1 or self.cp < 1 or self.microbatches < 1:
            raise ValueError(
                f"pp, cp and microbatches must be >= 1, got {self.pp}, {self.cp}, "
                f"{self.microbatches}"
            )
        if not isinstance(getattr(torch, self.target_dtype, None), torch.dtype):
            raise ValueError(f"unknown target dtype {self.target_dtype!r}; use float32/bfloat16")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.target_dtype)


def add_pp_arguments(p: argparse.ArgumentParser) -> None:
    """The pipeline options of `codraft learn` (`--cp` comes from learner.parallel.launch)."""
    d = PipelineTrainConfig
    p.add_argument("--pp", type=int, default=1, help="pipeline stages for target recompute")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="per batch (--pp)")
    p.add_argument("--tap-slots", type=int, default=d.tap_slots, help="TapChannel ring size")
    p.add_argument("--tap-timeout", type=float, default=d.tap_timeout_s, help="seconds")
    p.add_argument("--pipeline-timeout", type=float, default=d.pipeline_timeout_s, help="seconds")
    p.add_argument("--target-dtype", default=d.target_dtype, help="target compute dtype (--pp)")


def pp_config_from_args(args: argparse.Namespace) -> PipelineTrainConfig:
    return PipelineTrainConfig(
        pp=args.pp,
        cp=getattr(args, "cp", 1),
        microbatches=args.microbatches,
        tap_slots=args.tap_slots,
        tap_timeout_s=args.tap_timeout,
        pipeline_timeout_s=args.pipeline_timeout,
        target_dtype=args.target_dtype,
    )


class PipelineLearner:
    """One rank of a recompute-mode learner: its target stage, its pipeline, and (last stage)
    the trainer. Every rank calls `step` in lockstep; see the module docstring."""

    def __init__(
        self,
        target_dir: str | Path,
        out_dir: str | Path,
        train: TrainConfig,
        cfg: PipelineTrainConfig,
        mesh: ParallelMesh,
        device: torch.device,
        token_counts: torch.Tensor | None = None,
    ) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        if mesh.dims.pp != cfg.pp or mesh.dims.cp != cfg.cp:
            raise ValueError(
                f"the mesh is pp {mesh.dims.pp} x cp {mesh.dims.cp}, the config asks for "
                f"pp {cfg.pp} x cp {cfg.cp}"
            )
        self.groups = PipelineGroups.build(mesh)
        g = self.groups
        self.stage = load_stage(target_dir, g.stage, g.num_stages, cfg.torch_dtype, device)
        self.trainer: Trainer | None = None
        tap_layers: list[Any] = [None]
        if g.is_last:
            train = TrainConfig(**{**vars(train), "recompute": False, "device": str(device)})
            self.trainer = Trainer(target_dir, out_dir, train, token_counts=token_counts)
            # the stage's own head is the teacher (drop the trainer's copy of it)
            self.trainer.teacher = Teacher(self.stage.norm, self.stage.lm_head)
            tap_layers = [list(self.trainer.tap_layers)]
        if g.pp_group is not None:
            dist.broadcast_object_list(
                tap_layers, src=g.stage_ranks[-1], group=g.pp_group, device=device
            )
        self.tap_layers = tuple(tap_layers[0])
        ranges = split_layers(self.stage.config.num_layers, g.num_stages)
        self.channel = g.tap_channel(
            self.tap_layers,
            ranges,
            dtype=cfg.torch_dtype,
            device=device,
            config=TapChannelConfig(cfg.tap_slots, cfg.tap_timeout_s),
        )
        self.pipeline = Pipeline(
            self.stage,
            g,
            self.tap_layers,
            self.channel,
            PipelineConfig(cfg.microbatches, cfg.pipeline_timeout_s),
        )
        self._cp = None
        if g.is_last and cfg.cp > 1:
            from learner.parallel.context import ContextParallel

            self._cp = ContextParallel(mesh)

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
        share = (self.mesh.cp_rank, self.cfg.cp)
        if not g.is_last:
            self.pipeline.run(batch, None, share)
            return True
        return self._train_step(batch, share)

    def _train_step(self, batch: PackedBatch, share: tuple[int, int]) -> StepMetrics:
        tr = self.trainer
        t0 = time.perf_counter()
        lr = tr.begin_step()
        params = list(tr.draft.parameters())
        if self._cp is None:
            consumer = DraftStage(
                tr.draft, tr.teacher, tr.cfg.ttt(), reduce_counts=self._reduce,
                autocast_dtype=self._autocast(),
            )  # fmt: skip
            consumer.begin(batch)
            self.pipeline.run(batch, consumer, share)
            res = consumer.finish()
            sums = torch.tensor([res.loss, *res.pass_correct, *res.pass_valid], dtype=torch.float64)
            self._reduce_grads(params)
        else:
            collector = FeatureCollector()
            width = len(self.tap_layers) * self.stage.config.hidden_size
            collector.begin(
                batch, width, self.stage.config.hidden_size, self.pipeline.dtype, self.device
            )
            self.pipeline.run(batch, collector, share)
            full = collector.gather(self.mesh.cp_group)
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
    pad = 2 * learner.cfg.cp if learner.cfg.cp > 1 else 1
    for i, batch in enumerate(pack_stream(samples(ds), token_budget=budget, pad_multiple=pad)):
        if i % learner.mesh.dp_size == learner.mesh.dp_rank:
            yield batch


def train_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """The recompute-mode training loop (every rank runs it; see the module docstring)."""
    if not args.from_dir:
        raise SystemExit("recompute mode with --pp reads recorded tap files: give --from-dir DIR")
    if args.steps is None:
        args.steps = 500
    cfg = pp_config_from_args(args)
    par = ParallelConfig(cp=cfg.cp, pp=cfg.pp, device=args.device)
    mesh, device = init_distributed(par)
    target = resolve_model(args.target)
    train = TrainConfig(
        lr=args.lr,
        num_passes=args.k,
        token_budget=args.token_budget,
        draft_vocab_size=args.draft_vocab,
        total_steps=args.steps,
        seed=args.seed,
    )
    tcfg = TargetConfig.from_pretrained(target)
    expect = TapExpectation(fingerprint=model_fingerprint(tcfg), vocab_size=tcfg.vocab_size)
    out, data = Path(args.out), Path(args.from_dir)
    stage = mesh.pp_rank
    counts = None
    if stage == cfg.pp - 1 and not (out / "latest").exists():
        counts = token_counts(data, tcfg.vocab_size, expect)
    learner = PipelineLearner(target, out, train, cfg, mesh, device, counts)
    tr = learner.trainer
    batches: Iterator[PackedBatch] | None = None
    if learner.is_data_rank:
        position = tr.resume()
        ds = TapDataset(data, expect=expect, loop=True, position=position)
        batches = _batches(learner, ds, train.token_budget)
    history: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    bar = None
    if learner.is_main:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=tr.step_count, desc="train draft (pp)", unit="step")
    cursor = None
    while True:
        batch = None
        if learner.is_data_rank and tr.step_count < args.steps:
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
            if tr.step_count % args.save_every == 0 or tr.step_count >= args.steps:
                tr.save(cursor)
    if bar is not None:
        bar.close()
    learner.close()
    result: dict[str, Any] = {"rank": mesh.rank, "stage": learner.groups.stage}
    if learner.is_main:
        if tr.step_count % args.save_every and history:
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


def build_parser() -> argparse.ArgumentParser:
    """`codraft learn`'s arguments plus the pipeline's (for `python -m learner.recompute`)."""
    from learner.cli import add_arguments
    from learner.parallel.launch import add_parallel_arguments

    p = argparse.ArgumentParser(
        prog="python -m learner.recompute",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)  # includes --pp/--cp (learner.cli adds the pipeline's and CP's options)
    if not any("--pp" in a.option_strings for a in p._actions):
        add_pp_arguments(p)
    if not any("--cp" in a.option_strings for a in p._actions):
        add_parallel_arguments(p)
    return p


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = train_pipeline(args)
    if "steps" in result:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(build_parser().parse_args()))
