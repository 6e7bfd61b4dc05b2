"""Context parallelism for one training step, applied from outside the TTT code.

:class:`ContextParallel` binds a :class:`~codraft.learner.parallel.mesh.ParallelMesh` to the pieces
of one CP step: shard a packed batch (zigzag), run the TTT loss on the shard with ring attention
and boundary rolls, reduce the loss denominators and the gradients over dp x cp. A trainer step
becomes::

    cp = ContextParallel(mesh)
    shard = cp.shard(batch)                               # after features are on the batch
    teacher = teacher_head.draft_logits(shard.batch.last_hidden, draft.t2d)    # local rows
    out = cp.ttt_forward(draft, shard, teacher, ttt_config)
    out.loss.backward()
    cp.reduce_gradients(draft.parameters())               # sum over dp x cp, then clip/step

At ``cp = 1`` and world size 1 it runs the same code with no communication.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from codraft.draft.model import Eagle3Draft
from codraft.learner.attention.block import Backend
from codraft.learner.attention.ring import ring_pass_attention
from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel.mesh import ParallelMesh
from codraft.learner.parallel.ring_comm import Ring
from codraft.learner.parallel.roll import BoundaryRoll
from codraft.learner.parallel.zigzag import ZigzagLayout, shard_batch, unshard
from codraft.learner.ttt import PassAttention, TTTConfig, TTTOutput, ttt_forward


@dataclass
class Shard:
    """This CP rank's part of a packed batch."""

    batch: PackedBatch  # local rows; cu_seqlens local; positions global
    layout: ZigzagLayout
    global_cu: Tensor  # the whole batch's cu_seqlens


class ContextParallel:
    def __init__(self, mesh: ParallelMesh, backend: Backend = "auto") -> None:
        self.mesh = mesh
        self.backend = backend
        self.ring = Ring.of(mesh.cp_group)
        if self.ring.size != mesh.cp_size or self.ring.rank != mesh.cp_rank:
            raise ValueError(
                f"the CP group has {self.ring.size} ranks (this one {self.ring.rank}) but the "
                f"mesh says cp = {mesh.cp_size} (this rank {mesh.cp_rank})"
            )

    @property
    def pad_multiple(self) -> int:
        """What the packer must pad every document to: 2 x cp."""
        return 2 * self.mesh.cp_size

    def shard(self, batch: PackedBatch) -> Shard:
        layout_batch, layout = shard_batch(batch, self.mesh.cp_size, self.mesh.cp_rank)
        return Shard(layout_batch, layout, batch.cu_seqlens)

    def attention(self, layout: ZigzagLayout) -> PassAttention:
        """A ``codraft.learner.ttt`` attention callable over this rank's shard (ring + branch)."""

        def attn(q: Tensor, ks, vs, cu_seqlens: Tensor) -> Tensor:
            return ring_pass_attention(q, ks, vs, layout, self.ring, backend=self.backend)

        return attn

    def roll(self, layout: ZigzagLayout) -> BoundaryRoll:
        return BoundaryRoll(layout, self.ring)

    def reduce_counts(self, counts: Tensor) -> Tensor:
        """Sum per-pass valid counts over dp x cp: the global loss denominators."""
        if self.mesh.dp_cp_group is not None:
            dist.all_reduce(counts, group=self.mesh.dp_cp_group)
        return counts

    def ttt_forward(
        self,
        draft: Eagle3Draft,
        shard: Shard,
        teacher_logits: Tensor | None,
        config: TTTConfig | None = None,
        taps: Tensor | None = None,
    ) -> TTTOutput:
        """The TTT loss of this rank's shard (collective over the CP group, and over dp x cp
        for the counts). ``teacher_logits`` are this rank's rows ([N / cp, draft vocab]) or None
        for hard labels; ``taps`` default to the shard's own, cast to the draft's dtype."""
        b = shard.batch
        if taps is None:
            if b.taps is None:
                raise ValueError("the shard has no taps: fill the batch's features before sharding")
            taps = b.taps
        return ttt_forward(
            draft,
            b.input_ids,
            b.positions,
            b.cu_seqlens,
            taps,
            b.loss_mask,
            self.attention(shard.layout),
            config,
            teacher_logits,
            self.reduce_counts,
            roll=self.roll(shard.layout),
        )

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum ``.grad`` over dp x cp (one flat all-reduce per dtype). The loss is already
        normalised by global counts, so the sum is the gradient of the whole step."""
        group = self.mesh.dp_cp_group
        if group is None:
            return
        grads = [p.grad for p in params if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            dist.all_reduce(flat, group=group)
            for g, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                g.copy_(part.view_as(g))

    def reduce_metrics(self, out: TTTOutput) -> dict[str, list[float] | float]:
        """Loss and per-pass accuracy of the whole step (all-reduced; for logging)."""
        vals = torch.stack(
            [out.loss.detach().double(), *[c.double() for c in out.pass_correct],
             *[v.double() for v in out.pass_valid]]
        )  # fmt: skip
        if self.mesh.dp_cp_group is not None:
            dist.all_reduce(vals, group=self.mesh.dp_cp_group)
        k = len(out.pass_correct)
        correct, valid = vals[1 : 1 + k], vals[1 + k :]
        acc = [float(c) / max(1.0, float(v)) for c, v in zip(correct, valid, strict=True)]
        return {"loss": float(vals[0]), "pass_acc": acc}

    def gather(self, x: Tensor, shard: Shard) -> Tensor:
        """Every CP rank's rows of a per-token tensor, back in global order (collective)."""
        return unshard(x, shard.layout, shard.global_cu, self.mesh.cp_group)
