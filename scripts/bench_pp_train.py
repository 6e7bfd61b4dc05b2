"""Benchmark recompute-mode draft training under pipeline parallelism: TapChannel against no tap
traffic and against host staging (issue 10).

A step is `PipelineLearner.step` of codraft.learner.pipeline_trainer, what `codraft learn --pp N`
runs per batch (cp 1, dp 1): the last stage broadcasts the batch to the stages, the target runs
forward (no grad) over M microbatches across the N stages (`Pipeline`), the last stage trains
the EAGLE-3 draft on every microbatch as it arrives (`DraftStage`: teacher targets from the
stage's own head, TTT forward + backward), then clips the gradients and steps AdamW (the
`Trainer`, with `TrainConfig`'s defaults). Three modes run that step on the same batch, each
through a `PipelineLearner` of its own pipeline, all sharing one trainer:

* off: no tap traffic. The pipeline runs without tap layers and the draft is fed taps that are
  already on the last stage (captured from a TapChannel step of the same batch and microbatch
  count): the same draft work on the same inputs. This is the pipeline's own cost.
* tapchannel: the taps made before the last stage arrive over TapChannel (the real path).
* host: the baseline. Every tap-making stage copies its taps to host memory (`.cpu()`, which
  waits for that stage's stream) and sends them over a gloo group; the last stage receives them
  into host buffers posted when the step starts (one per microbatch, so no source is ever held
  back) and copies them to its device when the draft needs them. Same `Pipeline` code, with
  this transport in TapChannel's place.

The target is random and Llama-shaped, built stage by stage on the device (default 8B-class:
32 layers, H 4096, bf16). Modes alternate step by step in rotating order, so drift hits all
three alike; a step's time is the slowest rank's, from a barrier to its end (CUDA synchronized).
Per microbatch count the script also checks non-interference bitwise (every stage's
activations, the last stage's hidden states, teacher logits and distributions, the taps the
draft saw and the draft's loss are identical in the three modes, from the same draft state: those
steps, and the one that captures the off mode's taps, leave the draft and its optimizer as they
were) and times the tap transfer alone (one step's taps moved with nothing else running).

    torchrun --nproc-per-node 2 scripts/bench_pp_train.py --out runs/pp_train_pp2.json
    torchrun --nproc-per-node 2 scripts/bench_pp_train.py --smoke   # CPU, gloo, tiny

On a host with fewer GPUs than ranks (or with --share-gpu) the ranks share the GPU(s): every
process group is gloo and every transfer of a CUDA tensor (activations, taps, credits, the
script's all-reduces) is staged through host memory (`codraft.learner.parallel.host_staged`). That
runs the PP pipeline and all its checks on one GPU, but its times are not NCCL figures: the JSON's
"transport" says which transport ran, and the output says so too.

    torchrun --standalone --nproc-per-node 2 scripts/bench_pp_train.py --smoke \
        --device cuda   # one GPU, shared by both stages

Needs torch only (matplotlib for the PNG, when installed). Writes the JSON after every
microbatch count; exits 1 when a non-interference check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tapchannel import (  # noqa: E402
    add_target_arguments,
    connect_p2p,
    make_batch,
    random_stage,
)

from codraft.learner.parallel import host_staged  # noqa: E402
from codraft.learner.parallel.draft_stage import DraftStage  # noqa: E402
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, shutdown  # noqa: E402
from codraft.learner.parallel.microbatch import split_batch  # noqa: E402
from codraft.learner.parallel.p2p_wait import wait_work  # noqa: E402
from codraft.learner.parallel.pipeline import Pipeline, PipelineConfig, StageOutput  # noqa: E402
from codraft.learner.parallel.pipeline_mesh import PipelineGroups  # noqa: E402
from codraft.learner.parallel.stage import split_layers, taps_by_stage  # noqa: E402
from codraft.learner.parallel.tapchannel import TapChannelConfig  # noqa: E402
from codraft.learner.pipeline_trainer import PipelineLearner  # noqa: E402
from codraft.learner.teacher import Teacher  # noqa: E402
from codraft.learner.trainer import TrainConfig, Trainer  # noqa: E402
from codraft.models.config import TargetConfig, default_tap_layers  # noqa: E402

MODES = ("off", "tapchannel", "host")
GOAL_OVERHEAD = 0.02  # (tapchannel - off) / off of the median step
GOAL_SPEEDUP = 4.0  # host staging / TapChannel, time to move one step's taps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(p)
    p.add_argument("--docs", type=int, default=32, help="documents per batch")
    p.add_argument("--microbatches", default="4,8,16", help="microbatch counts, comma-separated")
    p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab_size)
    p.add_argument("--slots", type=int, default=2, help="TapChannel landing slots per source")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and count")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode and count")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype")
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="auto: cuda:LOCAL_RANK when CUDA is there (cpu with --smoke), else cpu",
    )  # fmt: skip
    p.add_argument(
        "--share-gpu", action="store_true",
        help="ranks share the GPU(s): gloo, transfers staged through host memory (automatic with "
        "more ranks than GPUs); with --device cpu, CPU tensors are staged too (tests that path). "
        "Times are then not NCCL figures",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps (CPU by default)")
    p.add_argument("--out", default=None, help="JSON file (a PNG is written next to it)")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab = 4, 64, 128, 2, 1, 512
        a.tokens, a.docs, a.microbatches, a.draft_vocab = 256, 8, "2,4", 64
        a.steps, a.warmup = 2, 1
        if a.device == "auto":
            a.device = "cpu"
    if a.device == "cpu":
        a.dtype = "float32"  # CPU kernels: what the gloo tests run
    a.counts = [int(x) for x in a.microbatches.split(",")]
    return a


# ---------------------------------------------------------------------- transports
class HostStaging:
    """The baseline transport, with TapChannel's calls so the same `Pipeline` drives it.

    Source: `put` copies the taps to host memory (`.cpu()`: waits for the stage's stream) and
    sends them over a gloo group. Receiver: `expect` posts a gloo receive into a fresh host
    buffer per put (the pipeline announces every microbatch when the step starts), `get` waits
    for it and copies it to the device, `release` drops it. Puts of one source arrive in order."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        sources: Sequence[int],
        receiver: int,
        dtype: torch.dtype,
        device: torch.device,
        keep_sends: int = 32,
        timeout_s: float = 60.0,
    ) -> None:
        self.group, self.receiver, self.keep_sends = group, receiver, keep_sends
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self._landing: dict[int, deque[tuple[torch.Tensor, dist.Work, int]]] = {
            s: deque() for s in sources
        }
        self._sends: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def put(self, tensor: torch.Tensor, microbatch: int) -> None:
        host = tensor.cpu()
        self._sends.append((dist.isend(host, dst=self.receiver, group=self.group), host))
        while len(self._sends) > self.keep_sends:  # sends of earlier steps: long received
            self._finish_send()

    def expect(self, src: int, shape: Sequence[int], microbatch: int) -> None:
        buf = torch.empty(tuple(shape), dtype=self.dtype)
        self._landing[src].append((buf, dist.irecv(buf, src=src, group=self.group), microbatch))

    def get(self, src: int, microbatch: int) -> torch.Tensor:
        buf, work, announced = self._landing[src][0]
        if announced != microbatch:
            raise RuntimeError(f"host staging: get of microbatch {microbatch}, next is {announced}")
        wait_work(work, buf.device, self.timeout_s, lambda: f"host staging: taps from rank {src}")
        return buf.to(self.device)

    def release(self, src: int) -> None:
        self._landing[src].popleft()

    def _finish_send(self) -> None:
        work, host = self._sends.popleft()
        wait_work(work, host.device, self.timeout_s, lambda: "host staging: a send to the receiver")

    def close(self) -> None:
        while self._sends:
            self._finish_send()
        left = {s: len(q) for s, q in self._landing.items() if q}
        if left:
            raise RuntimeError(f"host staging closed with puts not taken: {left}")


class TimedGets:
    """A transport (TapChannel or HostStaging) whose `get`s are timed: host wall clock, and on
    CUDA the compute stream's stall (events recorded just before and just after the get: the
    stream waits there for the taps to land, and for host staging also for the copy in)."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner, self.cuda = inner, device.type == "cuda"
        self.host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __getattr__(self, name: str) -> Any:  # expect, put, release, close
        return getattr(self.inner, name)

    def get(self, src: int, microbatch: int) -> torch.Tensor:
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        out = self.inner.get(src, microbatch)
        self.host_s += time.perf_counter() - t0
        if self.cuda:
            e1.record()
            self._events.append((e0, e1))
        return out

    def take(self) -> dict[str, float]:
        """Totals since the last take."""
        got = {"host_clock_s": self.host_s}
        if self.cuda:
            torch.cuda.synchronize()  # every event recorded has happened
            got["gpu_stream_s"] = sum(a.elapsed_time(b) for a, b in self._events) / 1e3
        self.host_s, self._events = 0.0, []
        return got


class Recorder:
    """`Pipeline` observer: keeps this stage's activations while `on` (for the check)."""

    def __init__(self) -> None:
        self.on = False
        self.acts: list[torch.Tensor] = []

    def __call__(self, kind: str, microbatch: int, t: torch.Tensor) -> None:
        if self.on and kind == "act":
            self.acts.append(t.clone())


# ---------------------------------------------------------------------- the draft
class HeldTrainer(Trainer):
    """The product's `Trainer`; while `hold` is set a step computes its gradients but leaves the
    draft, the optimizer and the step count as they were (the capture and check steps)."""

    hold = False

    def end_step(self, tokens: int) -> float:
        return 0.0 if self.hold else super().end_step(tokens)


class BenchLearner(PipelineLearner):
    """The product's `PipelineLearner`, remembering its last step's `DraftStage` (`consumer`),
    which keeps what it gave the draft while `keep` is set."""

    keep = False
    consumer: DraftStage | None = None

    def draft_stage(self) -> DraftStage:
        self.consumer = super().draft_stage()
        self.consumer.keep = self.keep
        return self.consumer


class Tapped:
    """A `Pipeline` whose last stage gives the draft the taps of `feed` (per microbatch: the off
    mode's, already on the last stage) or copies the taps it brought into `capture`."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.feed: list[torch.Tensor] | None = None
        self.capture: list[torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:  # stage, groups, tap_layers, channel, dtype
        return getattr(self.pipe, name)

    def run(self, batch: Any, consumer: Any = None, share: tuple[int, int] = (0, 1)) -> Any:
        if consumer is None:
            return self.pipe.run(batch, None, share)

        def consume(out: StageOutput) -> None:
            if self.feed is not None:
                out = replace(out, taps=self.feed[out.index])
            elif self.capture is not None:
                self.capture.append(out.taps.clone())
            consumer(out)

        return self.pipe.run(batch, consume, share)


# ---------------------------------------------------------------------- helpers
def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds from a barrier to the slowest rank's end of `fn` (device synchronized)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    host_staged.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)

    def at(q: float) -> float:  # nearest rank
        return s[round(q * (len(s) - 1))]

    return {"median": statistics.median(s), "p10": at(0.1), "p90": at(0.9), "n": len(s)}


def equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    """Bitwise equal lists of tensors (and not empty: an empty check proves nothing)."""
    return len(xs) == len(ys) > 0 and all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


def all_ranks(ok: bool, device: torch.device) -> bool:
    t = torch.tensor([int(ok)], device=device)
    host_staged.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


# ---------------------------------------------------------------------- the benchmark
class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        world = int(os.environ.get("WORLD_SIZE", "1"))  # every rank a stage of one pipeline
        device = "cpu" if a.device == "cpu" else "auto"  # auto: cuda:LOCAL_RANK
        share = True if a.share_gpu else None  # None: share when ranks outnumber the GPUs
        self.mesh, self.device = init_distributed(
            ParallelConfig(pp=world, device=device, share_gpu=share)
        )
        if a.device == "cuda" and self.device.type != "cuda":
            raise SystemExit("--device cuda, but CUDA is not available")
        self.dtype = getattr(torch, a.dtype)
        self.tcfg = TargetConfig(
            vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
            num_hidden_layers=a.layers, num_attention_heads=a.heads,
            num_key_value_heads=a.kv_heads,
        )  # fmt: skip
        g = self.groups = PipelineGroups.build(self.mesh)
        self.stage = random_stage(self.tcfg, g.stage, g.num_stages, self.dtype, self.device)
        self.taps = default_tap_layers(a.layers)
        self.ranges = split_layers(a.layers, g.num_stages)
        self.per_stage = taps_by_stage(self.taps, self.ranges)
        self.sources = g.tap_sources(self.taps, self.ranges)
        channel = g.tap_channel(
            self.taps, self.ranges, dtype=self.dtype, device=self.device,
            config=TapChannelConfig(slots=a.slots),
        )  # fmt: skip
        if channel is None:
            raise SystemExit(f"taps {self.taps} are all made on the last stage: nothing to move")
        host_group = dist.new_group(g.stage_ranks, backend="gloo")  # collective, every rank
        host = HostStaging(
            host_group, self.sources, g.stage_ranks[-1], self.dtype, self.device,
            keep_sends=2 * max(a.counts),
        )  # fmt: skip
        self.transports = {
            "tapchannel": TimedGets(channel, self.device),
            "host": TimedGets(host, self.device),
        }
        connect_p2p(g, self.sources, self.device)
        self.recorder = Recorder()
        self.scratch: Path | None = None  # the trainer's checkpoint folder (never written)
        self.trainer = self.make_trainer() if g.is_last else None
        self.batch = make_batch(a)
        self.feed: list[torch.Tensor] = []  # the off mode's taps, for the current count

    def make_trainer(self) -> HeldTrainer:
        """The last stage's trainer (`TrainConfig` defaults but the draft vocab) for the random
        target held in memory: the stage's own head as the teacher, a random frozen embedding."""
        tcfg, dev = self.tcfg, self.device
        self.scratch = Path(tempfile.mkdtemp(prefix="bench_pp_train-"))
        g = torch.Generator(device=dev).manual_seed(7)
        embed = torch.empty(tcfg.vocab_size, tcfg.hidden_size, device=dev)
        train = TrainConfig(
            draft_vocab_size=self.a.draft_vocab, tap_layers=tuple(self.taps), device=str(dev)
        )
        return HeldTrainer(
            None, self.scratch, train, target_config=tcfg,
            teacher=Teacher(self.stage.lm_head),
            embedding=embed.normal_(0.0, 0.02, generator=g),
        )  # fmt: skip

    # -------------------------------------------------------------- one step
    def learners(self, count: int) -> dict[str, BenchLearner]:
        """Per mode, the product's learner over that mode's pipeline (one trainer for all)."""
        cfg = PipelineConfig(count)
        st, g, obs = self.stage, self.groups, self.recorder
        pipes = {
            "off": Pipeline(st, g, (), None, cfg, observe=obs),
            "tapchannel": Pipeline(st, g, self.taps, self.transports["tapchannel"], cfg, obs),
            "host": Pipeline(st, g, self.taps, self.transports["host"], cfg, observe=obs),
        }
        return {
            mode: BenchLearner(Tapped(pipe), self.trainer, self.mesh, self.device)
            for mode, pipe in pipes.items()
        }

    def step(
        self,
        learners: dict[str, BenchLearner],
        mode: str,
        *,
        capture: list[torch.Tensor] | None = None,
        hold: bool = False,
        keep: bool = False,
    ) -> BenchLearner | None:
        """One `PipelineLearner.step` of `mode` on this rank (the batch comes from the last
        stage). `capture`: receives the taps the pipeline brought; `hold`: no optimizer step;
        `keep`: the draft's inputs kept. Returns the learner on the last stage."""
        learner = learners[mode]
        tapped = learner.pipeline
        tapped.feed = self.feed if mode == "off" else None
        tapped.capture, learner.keep = capture, keep
        if self.trainer is not None:
            self.trainer.hold = hold
        try:
            learner.step(self.batch if self.groups.is_last else None)
        finally:
            tapped.feed = tapped.capture = None
            learner.keep = False
            if self.trainer is not None:
                self.trainer.hold = False
        return learner if self.trainer is not None else None

    # -------------------------------------------------------------- non-interference
    def check(self, learners: dict[str, BenchLearner]) -> dict[str, dict[str, bool]]:
        """The off and host steps against the TapChannel step, bitwise, all from the same draft
        state. stage_activations: on every stage; the rest: the last stage's."""
        ref = self.observe(learners, "tapchannel")
        out = {}
        for mode in ("off", "host"):
            got = self.observe(learners, mode)
            flags = {"stage_activations": all_ranks(equal(got["acts"], ref["acts"]), self.device)}
            flags.update({k: equal(v, ref[k]) for k, v in got.items() if k != "acts"})
            out[mode] = flags
        return out

    def observe(
        self, learners: dict[str, BenchLearner], mode: str
    ) -> dict[str, list[torch.Tensor]]:
        """One step of `mode` without the optimizer step, and what it produced on this rank."""
        self.recorder.on, self.recorder.acts = True, []
        learner = self.step(learners, mode, hold=True, keep=True)
        got = {"acts": self.recorder.acts}
        self.recorder.on, self.recorder.acts = False, []
        if learner is not None:
            kept, res = learner.consumer.kept, learner.consumer.result
            grads = [p.grad.clone() for p in self.trainer.draft.parameters() if p.grad is not None]
            got.update(
                last_hidden=kept.last_hidden, logits=kept.logits,
                teacher_logits=kept.teacher_logits, taps=kept.taps, grads=grads,
                draft_loss=[torch.tensor([res.loss, *res.pass_loss], dtype=torch.float64)],
            )  # fmt: skip
        return got

    # -------------------------------------------------------------- taps alone
    def move_taps(self, mode: str, parts: list[Any], payload: list[torch.Tensor]) -> None:
        """One step's taps from every source to the last stage, nothing else running: what the
        pipeline does with them (expect all, then per microbatch get every source, concatenate,
        release)."""
        ch, g = self.transports[mode], self.groups
        me = g.stage_ranks[g.stage]
        if me in self.sources:
            for m, t in enumerate(payload):
                ch.put(t, m)
        if not g.is_last:
            return
        widths = {g.stage_ranks[s]: len(t) * self.a.hidden for s, t in enumerate(self.per_stage)}
        for src in self.sources:
            for m, mb in enumerate(parts):
                ch.expect(src, (mb.num_tokens, widths[src]), m)
        for m in range(len(parts)):
            torch.cat([ch.get(src, m) for src in self.sources], dim=-1)
            for src in self.sources:
                ch.release(src)

    # -------------------------------------------------------------- one count
    def run_count(self, count: int) -> dict[str, Any]:
        a, dev = self.a, self.device
        learners = self.learners(count)
        parts = split_batch(self.batch, count)
        self.feed = []  # the off mode's taps: what TapChannel brings for this count
        self.step(learners, "tapchannel", capture=self.feed, hold=True)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        waits: dict[str, list[dict[str, float]]] = {"tapchannel": [], "host": []}
        check: dict[str, Any] = {}
        for i in range(a.warmup + a.steps):
            if i == a.warmup:  # warm: compiled kernels and allocator settled
                check = self.check(learners)
                for t in self.transports.values():
                    t.take()
            k = i % len(MODES)
            for mode in MODES[k:] + MODES[:k]:
                dt = timed(lambda mode=mode: self.step(learners, mode), dev)
                if i >= a.warmup:
                    times[mode].append(dt)
                    if mode in waits:
                        waits[mode].append(self.transports[mode].take())
                elif mode in waits:
                    self.transports[mode].take()
        me = self.groups.stage_ranks[self.groups.stage]
        width = len(self.per_stage[self.groups.stage]) * a.hidden
        payload = []
        if me in self.sources:
            payload = [torch.randn(mb.num_tokens, width, device=dev).to(self.dtype) for mb in parts]
        moved: dict[str, list[float]] = {"tapchannel": [], "host": []}
        for i in range(1 + a.steps):
            for mode in ("tapchannel", "host") if i % 2 else ("host", "tapchannel"):
                dt = timed(lambda mode=mode: self.move_taps(mode, parts, payload), dev)
                if i:
                    moved[mode].append(dt)
        for t in self.transports.values():
            t.take()
        return self.record(count, len(parts), times, waits, moved, check)

    def record(
        self,
        count: int,
        effective: int,
        times: dict[str, list[float]],
        waits: dict[str, list[dict[str, float]]],
        moved: dict[str, list[float]],
        check: dict[str, Any],
    ) -> dict[str, Any]:
        step = {m: stats(ts) for m, ts in times.items()}
        off, tc, host = (step[m]["median"] for m in MODES)
        move = {m: stats(ts) for m, ts in moved.items()}
        wait = {
            mode: {key: stats([w[key] for w in ws]) for key in ws[0]} if ws else {}
            for mode, ws in waits.items()
        }
        return {
            "microbatches": count,
            "microbatches_run": effective,
            "step_s": step,
            "tapchannel_overhead": tc / off - 1,
            "host_overhead": host / off - 1,
            "tap_cost_s": {"tapchannel": tc - off, "host": host - off},
            "speedup_step": host / tc,
            "speedup_tap_cost": ratio(host - off, tc - off),
            "transfer_s": move,
            "speedup_transfer": move["host"]["median"] / move["tapchannel"]["median"],
            "get_wait_s_per_step": wait,
            "identical": check,
        }

    # -------------------------------------------------------------- how ranks talk
    def transport(self) -> dict[str, Any]:
        """Which transport ran: times count as NCCL figures only when `mode` is "nccl"."""
        backend, world = dist.get_backend(), dist.get_world_size()
        gpus = torch.cuda.device_count() if self.device.type == "cuda" else 0
        staged = host_staged.enabled()
        if staged and self.device.type == "cuda":
            mode = "shared_gpu_host_staged_gloo"
            note = (
                f"{world} ranks share {min(gpus, world)} GPU(s) (time-sliced); gloo process "
                "groups; every transfer of a CUDA tensor (activations, taps, credits) staged "
                "through host memory: these times are NOT NCCL figures, only the checks count"
            )
        elif staged:
            mode = "cpu_host_staged_gloo"
            note = "CPU, gloo, every transfer staged through a host copy (the shared-GPU path)"
        elif backend == "nccl":
            mode, note = "nccl", f"{world} ranks, one GPU each, NCCL point-to-point"
        else:
            mode, note = backend, f"{world} ranks on {self.device.type}, {backend}"
        return {
            "mode": mode, "backend": backend, "host_staged": staged, "ranks": world,
            "gpus": gpus, "nccl_figures": mode == "nccl", "note": note,
            "staged_on_this_rank": host_staged.counts() if staged else None,
        }  # fmt: skip

    # -------------------------------------------------------------- all counts
    def summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        a, g = self.a, self.groups
        bits = torch.finfo(self.dtype).bits
        remote = sum(len(t) for t in self.per_stage[:-1])
        return {
            "bench": "bench_pp_train",
            "pp": g.num_stages,
            "device": str(self.device),
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "transport": self.transport(),
            "target": {
                "layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate,
                "heads": a.heads, "kv_heads": a.kv_heads, "vocab": a.vocab, "dtype": a.dtype,
            },
            "tokens": a.tokens, "docs": a.docs, "draft_vocab": a.draft_vocab,
            "ttt_passes": TrainConfig.num_passes, "slots": a.slots,
            "steps": a.steps, "warmup": a.warmup,
            "tap_layers": list(self.taps), "tap_sources": self.sources,
            "stage_layers": [[r.start, r.stop] for r in self.ranges],
            "tap_bytes_per_step": a.tokens * remote * a.hidden * bits // 8,
            "goals": {
                "tapchannel_overhead_max": GOAL_OVERHEAD,
                "speedup_transfer_min": GOAL_SPEEDUP,
            },
            "definitions": {
                "step_s": "per mode: one PipelineLearner.step (the batch broadcast to the "
                "stages, target forward over the pipeline, draft TTT forward+backward per "
                "microbatch, clip, AdamW), slowest rank",
                "tapchannel_overhead": "(tapchannel - off) / off, median steps",
                "tap_cost_s": "median step minus the off mode's: what moving the taps adds",
                "speedup_step": "host / tapchannel, median whole step",
                "speedup_tap_cost": "host tap_cost_s / tapchannel tap_cost_s (None if <= 0)",
                "speedup_transfer": "host / tapchannel, median time to move one step's taps "
                "with nothing else running",
                "get_wait_s_per_step": "last stage, per step: time in the transport's get; "
                "gpu_stream_s: the compute stream stalled there (CUDA events around each get)",
                "identical": "bitwise equal to the tapchannel step, from the same draft state "
                "(grads: informational, flash backward may use atomics)",
            },
            "records": records,
        }  # fmt: skip

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def passed(records: list[dict[str, Any]]) -> bool:
    return all(
        ok
        for r in records
        for flags in r["identical"].values()
        for key, ok in flags.items()
        if key != "grads"
    )


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = summary["records"]
    xs = range(len(recs))
    labels = [str(r["microbatches"]) for r in recs]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for j, mode in enumerate(MODES):
        ys = [r["step_s"][mode]["median"] * 1e3 for r in recs]
        ax[0].bar([x + (j - 1) * 0.27 for x in xs], ys, 0.27, label=mode)
    ax[0].set(title="median step", ylabel="ms", xlabel="microbatches")
    for mode in ("tapchannel", "host"):
        ys = [r[f"{mode}_overhead"] * 100 for r in recs]
        ax[1].plot(list(xs), ys, "o-", label=mode)
    ax[1].axhline(GOAL_OVERHEAD * 100, ls="--", c="gray", label="goal")
    ax[1].set(title="step overhead vs off", ylabel="%", xlabel="microbatches")
    for j, mode in enumerate(("tapchannel", "host")):
        ys = [r["transfer_s"][mode]["median"] * 1e3 for r in recs]
        ax[2].bar([x + (j - 0.5) * 0.4 for x in xs], ys, 0.4, label=mode)
    ax[2].set(title="one step's taps moved alone", ylabel="ms", xlabel="microbatches", yscale="log")
    for a in ax:
        a.set_xticks(list(xs), labels)
        a.legend()
    t = summary["target"]
    how = summary["transport"]
    fig.suptitle(
        f"PP {summary['pp']}, {t['layers']} layers, H {t['hidden']}, {summary['tokens']} tokens, "
        f"{summary['device']}" + ("" if how["nccl_figures"] else f" [{how['mode']}: not NCCL]")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    a = parse_args()
    bench = Bench(a)
    writer = dist.get_rank() == bench.groups.stage_ranks[-1]
    how = bench.transport()
    if writer:
        print(f"transport: {how['mode']}: {how['note']}", flush=True)
    records: list[dict[str, Any]] = []
    for count in a.counts:
        records.append(bench.run_count(count))
        summary = bench.summary(records)
        summary["passed"] = passed(records)
        if writer:
            print(json.dumps(records[-1], indent=2), flush=True)
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    bench.close()
    ok = all_ranks(passed(records), bench.device)
    if writer and a.out:
        png = Path(a.out).with_suffix(".png")
        print(f"wrote {a.out}" + (f" and {png}" if plot(summary, png) else " (no matplotlib)"))
    if writer:
        print(f"transport: {how['mode']}: {how['note']}")
        print("non-interference: " + ("identical in all modes" if ok else "FAILED"), flush=True)
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
