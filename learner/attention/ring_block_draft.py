"""Block-drafter (DFlash) attention under context parallelism, as one autograd Function.

The rows (blocks) are zigzag-sharded like any packed batch
(:mod:`codraft.learner.parallel.zigzag`). The context keys/values ride the ring exactly as a
TTT trunk does (:func:`codraft.learner.attention.ring.trunk_forward`: one causal diagonal
block, then full blocks against the front or back half of each arriving shard), with the S
slots folded into the query heads as in :mod:`codraft.learner.attention.block_draft`. The block
term needs only the row's own slots, so it stays on the rank that holds the row
(:mod:`codraft.learner.attention.ring_branch`: every slot's query over all S slot keys), merged
by log-sum-exp into the same accumulators. Backward replays the trunk with the joint output and
lse (the context's dK/dV travel home with their shard) and the block rank-locally. With a ring
of one rank it is the single-device computation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from codraft.learner.attention.block import Backend
from codraft.learner.attention.branch import (
    _heads_to_passes,
    _lse_heads_to_passes,
    _lse_passes_to_heads,
    _passes_to_heads,
)
from codraft.learner.attention.ring import trunk_backward, trunk_forward
from codraft.learner.attention.ring_branch import branch_backward_into, branch_merge_into

if TYPE_CHECKING:
    from codraft.learner.parallel.ring_comm import Ring
    from codraft.learner.parallel.zigzag import ZigzagLayout

__all__ = ["ring_block_draft_attention", "ring_block_draft_forward"]


def _lse_fold(lse: Tensor, hkv: int) -> Tensor:
    """Token-major [S, T, Hq] -> token-major trunk lse [T, Hkv * S * G]."""
    return _lse_passes_to_heads(lse, hkv).t()


def _lse_unfold(lse: Tensor, s_: int, hkv: int) -> Tensor:
    """Token-major trunk lse [T, Hkv * S * G] -> [S, T, Hq]."""
    return _lse_heads_to_passes(lse.t(), s_, hkv)


def ring_block_draft_forward(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    lay: ZigzagLayout,
    ring: Ring,
    scale: float,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """No autograd: (out [S, Tl, Hq, D] in q's dtype, lse [S, Tl, Hq] in fp32/fp64)."""
    s_, hkv = q.shape[0], k_ctx.shape[1]
    out, lse = trunk_forward(_passes_to_heads(q, hkv), k_ctx, v_ctx, lay, ring, scale, backend)
    out, lse = _heads_to_passes(out, s_, hkv).contiguous(), _lse_unfold(lse, s_, hkv).contiguous()
    kb, vb = list(k_blk.unbind(0)), list(v_blk.unbind(0))
    for s in range(s_):
        branch_merge_into(out[s], lse[s], q[s], kb, vb, scale)
    return out.to(q.dtype), lse


class RingBlockDraftAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, lay, ring, scale, backend):  # type: ignore[override]
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_block_draft_forward(
                q, k_ctx, v_ctx, k_blk, v_blk, lay, ring, scale, backend
            )
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, out, lse)
        ctx.opts = (lay, ring, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k_ctx, v_ctx, k_blk, v_blk, out, lse = ctx.saved_tensors
        lay, ring, scale, backend = ctx.opts
        s_, hkv = q.shape[0], k_ctx.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype).contiguous()
            dq, dk_ctx, dv_ctx = trunk_backward(
                _passes_to_heads(dout, hkv), _passes_to_heads(q, hkv), k_ctx, v_ctx,
                _passes_to_heads(out, hkv), _lse_fold(lse, hkv), lay, ring, scale, backend,
            )  # fmt: skip
            dq = _heads_to_passes(dq, s_, hkv).contiguous()
            kb, vb = list(k_blk.unbind(0)), list(v_blk.unbind(0))
            dk_blk = torch.zeros(k_blk.shape, dtype=dq.dtype, device=q.device)
            dv_blk = torch.zeros_like(dk_blk)
            for s in range(s_):
                dks, dvs = branch_backward_into(dq[s], dout[s], q[s], kb, vb, out[s], lse[s], scale)
                for j in range(s_):
                    dk_blk[j] += dks[j]
                    dv_blk[j] += dvs[j]
        return (
            dq.to(q.dtype), dk_ctx.to(k_ctx.dtype), dv_ctx.to(v_ctx.dtype),
            dk_blk.to(k_blk.dtype), dv_blk.to(v_blk.dtype), None, None, None, None,
        )  # fmt: skip


def ring_block_draft_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    lay: ZigzagLayout,
    ring: Ring,
    scale: float | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """This rank's rows: q [S, Tl, Hq, D], k_ctx/v_ctx [Tl, Hkv, D] (its shard of the context),
    k_blk/v_blk [S, Tl, Hkv, D]. Collective over `ring`'s group. -> [S, Tl, Hq, D]."""
    if q.dim() != 4 or k_blk.shape != v_blk.shape or k_blk.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"expected q [S, Tl, Hq, D] and k_blk/v_blk [S, Tl, Hkv, D], got q {tuple(q.shape)}, "
            f"k_blk {tuple(k_blk.shape)}, v_blk {tuple(v_blk.shape)}"
        )
    if q.shape[1] != lay.num_local:
        raise ValueError(
            f"expected {lay.num_local} local rows (this rank's zigzag shard), got {q.shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return RingBlockDraftAttentionFn.apply(q, k_ctx, v_ctx, k_blk, v_blk, lay, ring, scale, backend)
