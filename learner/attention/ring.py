"""Zigzag ring attention for ONE TTT pass under context parallelism, as one autograd Function.

Each CP rank holds the zigzag shard of every document (front chunk r, back chunk 2CP-1-r; see
:mod:`codraft.learner.parallel.zigzag`). The trunk keys/values travel the ring: at step s a rank
holds the shard of rank ``src = (r - s) mod CP`` and, by the zigzag, only three cases exist:

* step 0 (``src = r``): the local shard against itself, one *causal* diagonal block;
* ``1 <= s <= r`` (``src < r``): the FRONT half of the arriving shard is before both local
  chunks and its back half after both: all local queries x arriving front half, a full block;
* ``s > r`` (``src > r``): the whole arriving shard lies after the local front chunk and before
  the local back chunk: local back-half queries x the whole arriving shard, a full block.

Every step is a :func:`~codraft.learner.attention.block.block_forward` call (any backend: cpu_flash,
cuda_flash, math) merged by log-sum-exp into fp32 (fp64 for fp64 inputs) accumulators; the
next shard's transfer (one batched isend/irecv on the CP group) overlaps the current block. The
branch term (the query's own anchor in passes 2..d) is rank-local and merged in the same
Function. Backward replays every block against the JOINT output and lse; dK/dV accumulate in
fp32 and travel with their shard (their transfer overlaps the next block's backward), and after
the last step make one final hop home. K/V are sent again in backward rather than kept: memory
stays at a few shards.

Cost per rank and pass: one causal block of ``T/cp`` tokens plus ``cp - 1`` full blocks of
``T/cp x T/(2cp)``: ``T^2 / (2 cp^2) * cp`` score entries in all, the same on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from codraft.learner.attention.block import Backend, block_backward, block_forward
from codraft.learner.attention.ring_branch import (
    branch_backward_into,
    branch_merge_into,
    merge_into,
)

if TYPE_CHECKING:
    from codraft.learner.parallel.ring_comm import Ring
    from codraft.learner.parallel.zigzag import ZigzagLayout


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _front(lay: ZigzagLayout, x: Tensor) -> Tensor:
    """The front half of an arriving shard [Tl, Hkv, D] (its chunk src of every document)."""
    return lay.take_front(x)


def _add_front(lay: ZigzagLayout, dst: Tensor, src: Tensor) -> None:
    """Add the gradient of an arriving shard's front half (``src``) into its accumulator."""
    lay.add_front(dst, src)


def trunk_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lay: ZigzagLayout,
    ring: Ring,
    scale: float,
    backend: Backend,
) -> tuple[Tensor, Tensor]:
    """Ring attention of the local queries over the whole trunk (causal within documents).

    q ``[Tl, Hq, D]``, k/v ``[Tl, Hkv, D]`` (this rank's shard). Returns ``(out [Tl, Hq, D],
    lse [Tl, Hq])`` in fp32 (fp64 for fp64 inputs), token-major lse. No autograd.
    """
    lcu, hcu = lay.local_cu, lay.half_cu
    o, l_ = block_forward(q, k, v, lcu, lcu, causal=True, scale=scale, backend=backend)
    acc = _acc(q.dtype)
    out, lse = o.to(acc), l_.t().to(acc)
    del o
    if ring.size == 1:
        return out, lse
    pending = ring.shift(k, v)
    for s in range(1, ring.size):
        kv = pending.wait()
        if s + 1 < ring.size:
            pending = ring.shift(*kv)  # the next shard travels while this one is used
        if s <= ring.rank:
            o, l_ = block_forward(
                q, _front(lay, kv[0]), _front(lay, kv[1]), lcu, hcu, causal=False,
                scale=scale, backend=backend,
            )  # fmt: skip
            merge_into(out, lse, o, l_.t())
        else:
            o, l_ = block_forward(
                lay.take_back(q), kv[0], kv[1], hcu, lcu, causal=False, scale=scale,
                backend=backend,
            )  # fmt: skip
            ob, lb = lay.take_back(out), lay.take_back(lse)  # views for one document
            merge_into(ob, lb, o, l_.t())
            if lay.num_docs > 1:
                lay.put_back(out, ob)
                lay.put_back(lse, lb)
        del o, l_, kv
    return out, lse


def trunk_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    lay: ZigzagLayout,
    ring: Ring,
    scale: float,
    backend: Backend,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of the trunk's share of a merged attention, replayed with the joint ``out``
    ``[Tl, Hq, D]`` and token-major ``lse`` ``[Tl, Hq]``.

    Returns ``(dq [Tl, Hq, D], dk, dv [Tl, Hkv, D])`` in fp32 (fp64 for fp64 inputs); dk/dv
    are this rank's shard's gradients summed over every rank's queries.
    """
    lcu, hcu = lay.local_cu, lay.half_cu
    lse_h = lse.t()  # [Hq, Tl] view, the block interface's layout
    dq, dk, dv = block_backward(
        dout, q, k, v, out, lse_h, lcu, lcu, causal=True, scale=scale, backend=backend
    )
    acc = _acc(q.dtype)
    dq = dq.to(acc)
    dkv = [dk.to(acc), dv.to(acc)]  # the accumulators of the shard in hand travel with it
    del dk, dv
    if ring.size == 1:
        return dq, dkv[0], dkv[1]
    dout_b, q_b, out_b, lse_b = (lay.take_back(x) for x in (dout, q, out, lse))
    pending = ring.shift(k, v)
    for s in range(1, ring.size):
        kv = pending.wait()
        if s + 1 < ring.size:
            pending = ring.shift(*kv)
        # The accumulators of the shard used at step s - 1 move on to the next rank; those of
        # the shard now in hand arrive from the previous rank while this step's blocks run.
        moving = ring.shift(*dkv)
        if s <= ring.rank:
            dq_s, dk_s, dv_s = block_backward(
                dout, q, _front(lay, kv[0]), _front(lay, kv[1]), out, lse_h, lcu, hcu,
                causal=False, scale=scale, backend=backend,
            )  # fmt: skip
            dq += dq_s
            add = partial(_add_front, lay)
        else:
            dq_s, dk_s, dv_s = block_backward(
                dout_b, q_b, kv[0], kv[1], out_b, lse_b.t(), hcu, lcu, causal=False,
                scale=scale, backend=backend,
            )  # fmt: skip
            lay.add_back(dq, dq_s)
            add = _add_all
        del dq_s, kv
        dkv = moving.wait()
        add(dkv[0], dk_s)
        add(dkv[1], dv_s)
        del dk_s, dv_s
    dkv = ring.shift(*dkv).wait()  # the final hop: every accumulator back to its owner
    return dq, dkv[0], dkv[1]


def _add_all(dst: Tensor, src: Tensor) -> None:
    dst.add_(src)


class RingPassAttentionFn(torch.autograd.Function):
    """Trunk (ring) + branch (rank-local) attention of one TTT pass; see the module docstring."""

    @staticmethod
    def forward(ctx, q, lay, ring, scale, backend, *kvs):  # type: ignore[override]
        n = len(kvs) // 2
        ks, vs = kvs[:n], kvs[n:]
        with torch.autocast(q.device.type, enabled=False):  # the merge math stays in fp32
            out, lse = ring_pass_forward(q, ks, vs, lay, ring, scale, backend)
        ctx.save_for_backward(q, out, lse, *ks, *vs)
        ctx.opts = (n, lay, ring, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q = ctx.saved_tensors[0]
        with torch.autocast(q.device.type, enabled=False):
            return RingPassAttentionFn._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, out, lse, *kvs = ctx.saved_tensors
        n, lay, ring, scale, backend = ctx.opts
        ks, vs = kvs[:n], kvs[n:]
        dout = dout.to(q.dtype).contiguous()
        dq, dk0, dv0 = trunk_backward(dout, q, ks[0], vs[0], out, lse, lay, ring, scale, backend)
        dks, dvs = [dk0.to(ks[0].dtype)], [dv0.to(vs[0].dtype)]
        if n > 1:
            dk_b, dv_b = branch_backward_into(dq, dout, q, ks[1:], vs[1:], out, lse, scale)
            dks += dk_b
            dvs += dv_b
        return (dq.to(q.dtype), None, None, None, None, *dks, *dvs)


def ring_pass_forward(
    q: Tensor,
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    lay: ZigzagLayout,
    ring: Ring,
    scale: float,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """The forward alone (no autograd): ``(out [Tl, Hq, D] in q.dtype, lse [Tl, Hq])``, the lse
    in fp32 (fp64 for fp64 inputs) over trunk and branch together."""
    out, lse = trunk_forward(q, ks[0], vs[0], lay, ring, scale, backend)
    if len(ks) > 1:
        branch_merge_into(out, lse, q, ks[1:], vs[1:], scale)
    return out.to(q.dtype), lse


def ring_pass_attention(
    q: Tensor,
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    lay: ZigzagLayout,
    ring: Ring,
    scale: float | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Pass d's attention under context parallelism: this rank's queries q ``[Tl, Hq, D]`` over
    the trunk ``ks[0]``/``vs[0]`` of every rank (causal within documents, in global order) and
    their own anchor's branch keys ``ks[1:]``/``vs[1:]`` (each ``[Tl, Hkv, D]``, this rank's
    zigzag shard). Collective over ``ring``'s group: every CP rank calls it in step.
    -> ``[Tl, Hq, D]``, differentiable in q and every key/value."""
    if len(ks) != len(vs) or not ks:
        raise ValueError(f"expected equal, non-empty key and value lists, got {len(ks)}/{len(vs)}")
    if q.shape[1] % ks[0].shape[1]:
        raise ValueError(
            f"query heads {q.shape[1]} must be a multiple of kv heads {ks[0].shape[1]}"
        )
    if q.shape[0] != lay.num_local:
        raise ValueError(
            f"expected {lay.num_local} local rows (this rank's zigzag shard), got q with "
            f"{q.shape[0]}; shard the batch with codraft.learner.parallel.zigzag.shard_batch"
        )
    if ring.size != lay.cp_size or ring.rank != lay.cp_rank:
        raise ValueError(
            f"the ring (rank {ring.rank} of {ring.size}) and the layout (rank {lay.cp_rank} of "
            f"{lay.cp_size}) disagree; build both from the same CP group"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingPassAttentionFn.apply(q, lay, ring, scale, backend, *ks, *vs)
