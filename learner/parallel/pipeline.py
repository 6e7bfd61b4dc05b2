"""The target's forward pipeline: microbatches of a packed batch through PP stages, taps to the
last stage over TapChannel, and a consumer there (the draft's forward and backward) per
microbatch.

Schedule (GPipe forward; the target has no backward, so fill-drain is also 1F1B here). Stage s
of P runs microbatch m as soon as m's activations arrived and m-1 is done:

    stage 0    F0 F1 F2 F3
    stage 1       F0 F1 F2 F3
    stage 2          F0 F1 F2 F3
    last          F0 D0 F1 D1 F2 D2 F3 D3        D = draft forward + backward (the consumer)

Per microbatch, stage s: wait for the activations (stage 0: embed the ids), run its layers
under no_grad, isend the output to stage s+1, post the receive of microbatch m+1, then put its
taps (if it makes any) on TapChannel. The receive of m+1 is posted after the send of m: on NCCL
one peer pair's operations may share one stream, and a receive posted first would hold the send
back until the previous stage has produced m+1. The last stage waits for m, posts m+1, runs its
layers and the final norm, takes the taps of m from TapChannel (they usually landed while it
computed), calls the consumer with the post-norm last hidden state and the (pre-norm) taps, and
releases the landing slots.

Every transfer goes through `codraft.learner.parallel.host_staged`: plain isend/irecv (NCCL on GPUs,
gloo on CPU), except when the ranks share a GPU (`ParallelConfig.share_gpu`, single-GPU smoke
runs): then the groups are gloo and activations are staged through host memory.

Why not torch.distributed.pipelining: it fixes every microbatch's shape from a first shape
inference (a later step with other shapes breaks the transfer: on gloo in torch 2.13 a changed
shape aborts the receiving process), it splits tensors along a dimension rather than at
document boundaries, and its value, scheduling backward passes, is moot for a forward-only
target whose only backward (the draft's) is local to the last stage. Packed batches change shape
every step; here every stage derives the same microbatch plan from the batch itself, so no
shapes travel at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel import host_staged
from codraft.learner.parallel.host_staged import Request
from codraft.learner.parallel.microbatch import split_batch
from codraft.learner.parallel.p2p_wait import PeerTimeout, check_below_watchdog, wait_work
from codraft.learner.parallel.pipeline_mesh import PipelineGroups
from codraft.learner.parallel.stage import TargetStage, split_layers, taps_by_stage
from codraft.learner.parallel.tapchannel import TapChannel
from codraft.models.config import validate_tap_layers


class PipelineTimeout(PeerTimeout):
    """A stage waited too long for activations (or for the next stage to take them)."""


@dataclass
class PipelineConfig:
    microbatches: int = 4  # per batch; fewer when the batch has fewer documents
    timeout_s: float = 300.0  # the longest one wait for activations may take

    def __post_init__(self) -> None:
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class StageOutput:
    """What the last stage hands its consumer for one microbatch."""

    index: int  # microbatch number in this batch
    count: int  # microbatches in this batch
    offset: int  # row of the batch where this microbatch starts
    batch: PackedBatch  # the microbatch (ids, positions, cu_seqlens, loss_mask, ...)
    last_hidden: torch.Tensor  # [N, H], after the final norm (the lm_head's input)
    taps: torch.Tensor | None  # [N, n_taps * H] in tap-layer order (None without taps)


@dataclass
class PipelineStats:
    microbatches: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0  # this stage's layers
    wait_s: float = 0.0  # waiting for activations from the previous stage
    consumer_s: float = 0.0  # last stage: the consumer (draft forward + backward)
    trace: list[tuple[str, int, int, tuple[int, ...]]] = field(default_factory=list)
    # the pipeline group's own operations, in order: (op, peer rank, microbatch, shape)


Consumer = Callable[[StageOutput], None]
Observer = Callable[[str, int, torch.Tensor], None]


class Pipeline:
    """One rank's part of the target pipeline. Every rank of the pipeline calls `run` with the
    same batch; the last stage's `consumer` sees every microbatch's features in order."""

    def __init__(
        self,
        stage: TargetStage,
        groups: PipelineGroups,
        tap_layers: Sequence[int] = (),
        channel: TapChannel | None = None,
        config: PipelineConfig | None = None,
        observe: Observer | None = None,
    ) -> None:
        self.stage, self.groups = stage, groups
        self.cfg = config or PipelineConfig()
        check_below_watchdog(self.cfg.timeout_s, groups.pp_group, "PipelineConfig.timeout_s")
        self.channel = channel
        self.observe = observe
        P = groups.num_stages
        if stage.index != groups.stage or stage.num_stages != P:
            raise ValueError(
                f"stage {stage.index} of {stage.num_stages} built for a rank that is stage "
                f"{groups.stage} of {P} in its pipeline"
            )
        self.ranges = split_layers(stage.config.num_layers, P)
        if stage.layer_range != self.ranges[stage.index]:
            raise ValueError(
                f"stage {stage.index} holds layers {list(stage.layer_range)}, the pipeline "
                f"expects {list(self.ranges[stage.index])} "
                "(codraft.learner.parallel.stage.split_layers)"
            )
        self.tap_layers = validate_tap_layers(tap_layers, stage.config.num_layers)
        self.per_stage = taps_by_stage(self.tap_layers, self.ranges)
        remote = [s for s, t in enumerate(self.per_stage[:-1]) if t]
        if remote and channel is None:
            raise ValueError(
                f"tap layers {list(self.tap_layers)} are made on stages {remote}, before the "
                "last stage: the pipeline needs a TapChannel (PipelineGroups.tap_channel)"
            )
        p = next(iter(stage.parameters()))
        self.device, self.dtype = p.device, p.dtype
        self.hidden = stage.config.hidden_size

    # ------------------------------------------------------------------ helpers
    def _rank(self, s: int) -> int:
        return self.groups.stage_ranks[s]

    def _name(self, s: int) -> str:
        return f"stage {s} (rank {self._rank(s)})"

    def _post_recv(self, m: int, mb: PackedBatch, stats: PipelineStats):
        s = self.stage.index
        buf = torch.empty(mb.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        work = host_staged.irecv(buf, self._rank(s - 1), self.groups.pp_group)
        stats.trace.append(("recv", self._rank(s - 1), m, tuple(buf.shape)))
        return buf, work

    def _wait(self, work: Request | None, describe: Callable[[], str]) -> None:
        try:
            wait_work(work, self.device, self.cfg.timeout_s, describe)
        except PeerTimeout as e:
            raise PipelineTimeout(str(e)) from None

    def _late(self, m: int, M: int, tokens: int) -> str:
        s = self.stage.index
        return (
            f"pipeline: {self._name(s)} waited for the activations of microbatch {m} of {M} "
            f"({tokens} tokens) from {self._name(s - 1)}"
        )

    def _unsent(self, m: int, M: int) -> str:
        s = self.stage.index
        return (
            f"pipeline: {self._name(s)} waited for {self._name(s + 1)} to take the activations "
            f"of microbatch {m} of {M}"
        )

    def _gather_taps(self, m: int, local: dict[int, torch.Tensor]) -> torch.Tensor | None:
        if not self.tap_layers:
            return None
        pieces = dict(local)
        sources = []
        for s, taps in enumerate(self.per_stage[:-1]):
            if not taps:
                continue
            got = self.channel.get(self._rank(s), m)
            sources.append(self._rank(s))
            for t, chunk in zip(taps, got.split(self.hidden, dim=-1), strict=True):
                pieces[t] = chunk
        out = torch.cat([pieces[t] for t in self.tap_layers], dim=-1)  # a copy: slots free now
        for src in sources:
            self.channel.release(src)
        return out

    def _expect_taps(self, micro: list[tuple[int, PackedBatch]]) -> None:
        for s, taps in enumerate(self.per_stage[:-1]):
            if taps:
                for m, mb in micro:
                    width = len(taps) * self.hidden
                    self.channel.expect(self._rank(s), (mb.num_tokens, width), m)

    # ------------------------------------------------------------------ the step
    def run(
        self,
        batch: PackedBatch,
        consumer: Consumer | None = None,
        share: tuple[int, int] = (0, 1),
    ) -> PipelineStats:
        """Push `batch` through the pipeline (every rank of it calls this with the same batch).
        On the last stage `consumer` is called once per microbatch, in order.

        share=(i, n): this pipeline runs only microbatches m with m % n == i (n pipelines side
        by side share one batch, e.g. one per context-parallel rank)."""
        t_step = time.perf_counter()
        stats = PipelineStats()
        parts = split_batch(batch, self.cfg.microbatches)
        M = len(parts)
        starts = [0]
        for mb in parts[:-1]:
            starts.append(starts[-1] + mb.num_tokens)
        i_share, n_share = share
        micro = [(m, mb) for m, mb in enumerate(parts) if m % n_share == i_share]
        stats.microbatches = len(micro)
        st = self.stage
        s, first, last = st.index, st.is_first, st.is_last
        own_taps = self.per_stage[s]
        if last and self.channel is not None:
            self._expect_taps(micro)
        sends: list[tuple[Request | None, torch.Tensor, int]] = []
        recv = self._post_recv(*micro[0], stats) if micro and not first else None
        for j, (m, mb) in enumerate(micro):
            nxt = micro[j + 1] if j + 1 < len(micro) else None
            if first:
                x = mb.input_ids.to(self.device)
            else:
                buf, work = recv
                t0 = time.perf_counter()
                self._wait(work, lambda m=m, n=mb.num_tokens: self._late(m, M, n))
                stats.wait_s += time.perf_counter() - t0
                x = buf
                if last and nxt is not None:
                    recv = self._post_recv(*nxt, stats)
            t0 = time.perf_counter()
            with torch.no_grad():
                h, taps = st(x, mb.positions.to(self.device), mb.cu_seqlens, self.tap_layers)
            stats.compute_s += time.perf_counter() - t0
            if self.observe is not None:
                self.observe("act", m, h)
            if not last:
                work = host_staged.isend(h, self._rank(s + 1), self.groups.pp_group)
                sends.append((work, h, m))
                stats.trace.append(("send", self._rank(s + 1), m, tuple(h.shape)))
                if not first and nxt is not None:
                    recv = self._post_recv(*nxt, stats)
                if own_taps:
                    self.channel.put(torch.cat([taps[t] for t in own_taps], dim=-1), m)
                continue
            full = self._gather_taps(m, taps)
            if self.observe is not None and full is not None:
                self.observe("taps", m, full)
            if consumer is not None:
                t0 = time.perf_counter()
                consumer(StageOutput(m, M, starts[m], mb, h, full))
                stats.consumer_s += time.perf_counter() - t0
        for work, _, m in sends:
            self._wait(work, lambda m=m: self._unsent(m, M))
        stats.step_s = time.perf_counter() - t_step
        return stats
