"""PP x CP: target features from CP pipelines side by side, then the draft step with context
parallelism on the last stage.

With a mesh of pp x cp (x dp) there are `cp` pipelines per data replica, one per CP index, all
given the same batch. The target's own attention is not context-parallel, so the pipelines share
the batch by microbatches instead (pipeline c runs microbatches m with m % cp == c: whole
documents, each computed exactly as on one device). On the last stage every CP rank then holds
the features of its microbatches; one all-reduce over the CP group (each row is non-zero on
exactly one rank, so the sum is exact) gives every CP rank the whole batch's taps and last
hidden states, which `ContextParallel` zigzag-shards for the ring-attention TTT step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from codraft.draft.model import Eagle3Draft
from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel.context import ContextParallel
from codraft.learner.parallel.pipeline import StageOutput
from codraft.learner.teacher import Teacher
from codraft.learner.ttt import TTTConfig, TTTOutput


class FeatureCollector:
    """Last-stage consumer that writes each microbatch's taps and last hidden states into
    whole-batch buffers (zero where another pipeline's microbatches go)."""

    def __init__(self) -> None:
        self.taps: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None
        self._batch: PackedBatch | None = None

    def begin(self, batch: PackedBatch, tap_width: int, hidden: int, dtype, device) -> None:
        n = batch.num_tokens
        self._batch = batch
        self.taps = torch.zeros(n, tap_width, dtype=dtype, device=device)
        self.last_hidden = torch.zeros(n, hidden, dtype=dtype, device=device)

    def __call__(self, out: StageOutput) -> None:
        if out.taps is None:
            raise ValueError("the draft needs taps: build the pipeline with the draft's tap layers")
        a, b = out.offset, out.offset + out.batch.num_tokens
        self.taps[a:b] = out.taps
        self.last_hidden[a:b] = out.last_hidden

    def gather(self, group: dist.ProcessGroup | None) -> PackedBatch:
        """The batch with the whole batch's features (collective over the CP group); zero on
        padding, as `pack` makes them."""
        if group is not None:
            dist.all_reduce(self.taps, group=group)
            dist.all_reduce(self.last_hidden, group=group)
        batch = self._batch
        pad = ~batch.valid.to(self.taps.device)[:, None]
        return replace(
            batch,
            taps=self.taps.masked_fill(pad, 0),
            last_hidden=self.last_hidden.masked_fill(pad, 0),
        )


def cp_draft_step(
    cp: ContextParallel,
    draft: Eagle3Draft,
    teacher: Teacher,
    batch: PackedBatch,
    ttt: TTTConfig,
    autocast_dtype: torch.dtype | None = None,
) -> TTTOutput:
    """This CP rank's share of the TTT loss of a batch with features, and its backward
    (gradients are this rank's part: `cp.reduce_gradients` sums them)."""
    shard = cp.shard(batch)
    teacher_logits = teacher.draft_logits(shard.batch.last_hidden, draft.t2d)
    device = draft.fc.weight.device
    enabled = autocast_dtype is not None
    with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=enabled):
        out = cp.ttt_forward(draft, shard, teacher_logits, ttt)
    out.loss.backward()
    return out
