"""Branch attention for ONE TTT pass, as one autograd Function.

TTT passes are sequential (pass d reads pass d-1's output), so the trainer calls this once per
pass with the query of pass d and the keys/values of passes 1..d (0-based here: ``ks[0]`` is the
trunk, ``ks[1:]`` the branch). The query at anchor i sees ``ks[0]`` at positions 0..i of its
document (one causal :func:`~codraft.learner.attention.block.block_forward` call) and ``ks[1:]`` at
position i only (``d-1`` scores per query head). Both merge exactly by log-sum-exp and the
backward replays both with the joint output and lse, so the gradient through the lse survives.
The K passes together cost K trunk calls: the floor, since every pass attends to the whole trunk.

The branch's arithmetic is :mod:`codraft.learner.attention.ring_branch` (the same rows the
context-parallel ring merges rank-locally): fused compiled kernels on CUDA, chunked eager ops
elsewhere. It saves nothing beyond the joint out and lse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from codraft.learner.attention.block import Backend, block_backward, block_forward
from codraft.learner.attention.ring_branch import branch_backward_into, branch_merge


def _branch_keys(ks: Sequence[Tensor], vs: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The branch keys/values: passes 1..d-1 (0-based), each [T, Hkv, D]."""
    return list(ks[1:]), list(vs[1:])


class PassAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, backend, *kvs):  # type: ignore[override]
        n = len(kvs) // 2
        ks, vs = kvs[:n], kvs[n:]
        out_a, lse_a = block_forward(
            q, ks[0], vs[0], cu_seqlens, cu_seqlens, causal=True, scale=scale, backend=backend
        )
        kb, vb = _branch_keys(ks, vs)
        if not kb:
            out, lse = out_a, lse_a.transpose(0, 1)
        else:
            out, lse = branch_merge(out_a, lse_a.transpose(0, 1), q, kb, vb, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, *ks, *vs)
        ctx.n, ctx.scale, ctx.backend = n, scale, backend
        ctx.cu_seqlens = cu_seqlens
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, out, lse, *kvs = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs = kvs[:n], kvs[n:]
        dout = dout.contiguous()
        cu = ctx.cu_seqlens
        dq, dk0, dv0 = block_backward(
            dout, q, ks[0], vs[0], out, lse.transpose(0, 1), cu, cu,
            causal=True, scale=scale, backend=ctx.backend,
        )  # fmt: skip
        kb, vb = _branch_keys(ks, vs)
        if not kb:
            return (dq, None, None, None, dk0, dv0)
        dks, dvs = branch_backward_into(dq, dout, q, kb, vb, out, lse, scale)
        return (dq, None, None, None, dk0, *dks, dv0, *dvs)


def pass_attention(
    q: Tensor,
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    cu_seqlens: Tensor,
    scale: float | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Attention of pass d's queries q [T, Hq, D] over the trunk ks[0]/vs[0] (causal within the
    documents of cu_seqlens) and the branch ks[1:]/vs[1:] (own anchor only); -> [T, Hq, D]."""
    if len(ks) != len(vs) or not ks:
        raise ValueError(f"expected equal, non-empty key and value lists, got {len(ks)}/{len(vs)}")
    if q.shape[1] % ks[0].shape[1]:
        raise ValueError(
            f"query heads {q.shape[1]} must be a multiple of kv heads {ks[0].shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return PassAttentionFn.apply(q, cu_seqlens, scale, backend, *ks, *vs)
