"""Attention of a block drafter (DFlash) in training, as one autograd Function.

A block drafter proposes S - 1 tokens in one non-causal forward over a block of S slots:
``[anchor token, mask, ..., mask]``. In training every packed row is an anchor. Row ``i`` of a
document stands for the block that follows position ``i``: slot ``s`` of that block sits at
position ``i + 1 + s`` (slot 0 holds the token at ``i + 1``, the anchor), its context is the
target's features at positions ``0..i``, and vLLM serves it the same way (context K/V from the
target's hidden states up to the last verified token, then ``1 + K`` queries). The query of slot
``s`` at row ``i`` sees

* (a) the trunk: the context keys/values at positions ``0..i`` of its own document (causal),
* (b) the branch: the keys/values of every slot ``0..S-1`` of its own row (bidirectional).

Nothing else. As in :mod:`codraft.learner.attention.branch` no ``T x T`` mask or score matrix is
built: (a) is ONE causal :func:`~codraft.learner.attention.block.block_forward` call with the S
slots folded into the query heads (ordered ``[Hkv, S, G]``, every slot of a group sharing the
context's key/value head), so causality is per row and the kernel stays on its diagonal block;
(b) is a ``[S, T, Hq, S]`` score tensor; the two merge by log-sum-exp and backward replays both
with the joint output and lse. Under context parallelism (a) is what rides the ring and (b)
stays on the rank that holds the row.

Memory: ``O(S * T * Hq * (D + S))`` plus the trunk kernel's; never ``T x T``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from codraft.learner.attention.block import Backend, block_backward, block_forward, merge_lse
from codraft.learner.attention.branch import (
    _heads_to_passes,
    _lse_heads_to_passes,
    _lse_passes_to_heads,
    _passes_to_heads,
)

__all__ = ["BlockDraftAttentionFn", "block_draft_attention"]

_NEG_INF = float("-inf")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _block_scores(q: Tensor, kb: Tensor, scale: float) -> Tensor:
    """Scores of every slot's query over every slot's key of the same row:
    q [S, T, Hq, D], kb [S, T, Hkv, D] -> [S, T, Hkv, G, S] in the accumulation dtype."""
    s_, t, hq, d = q.shape
    hkv = kb.shape[2]
    acc = _acc(q.dtype)
    q5 = q.to(acc).reshape(s_, t, hkv, hq // hkv, d)
    return torch.einsum("stngc,etnc->stnge", q5, kb.to(acc)) * scale


def _block_forward(q: Tensor, kb: Tensor, vb: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The branch: (out [S, T, Hq, D], lse [S, T, Hq]) in fp32 (fp64 for fp64)."""
    s_, t, hq, d = q.shape
    scores = _block_scores(q, kb, scale)
    lse = torch.logsumexp(scores, dim=-1)
    prob = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("stnge,etnc->stngc", prob, vb.to(scores.dtype))
    return out.reshape(s_, t, hq, d), lse.reshape(s_, t, hq)


def _block_backward(
    dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor, out: Tensor, lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Branch gradients replayed with the joint out [S, T, Hq, D] and lse [S, T, Hq]:
    (dq [S, T, Hq, D], dk, dv [S, T, Hkv, D]), all in the accumulation dtype."""
    s_, t, hq, d = q.shape
    hkv = kb.shape[2]
    g = hq // hkv
    scores = _block_scores(q, kb, scale)
    acc = scores.dtype
    prob = torch.exp(scores - lse.to(acc).reshape(s_, t, hkv, g, 1))
    do5 = dout.to(acc).reshape(s_, t, hkv, g, d)
    dp = torch.einsum("stngc,etnc->stnge", do5, vb.to(acc))
    rowdot = (do5 * out.to(acc).reshape(s_, t, hkv, g, d)).sum(-1, keepdim=True)
    ds = prob * (dp - rowdot)
    q5 = q.to(acc).reshape(s_, t, hkv, g, d)
    dk = torch.einsum("stnge,stngc->etnc", ds, q5) * scale
    dv = torch.einsum("stnge,stngc->etnc", prob, do5)
    dq = torch.einsum("stnge,etnc->stngc", ds, kb.to(acc)).reshape(s_, t, hq, d) * scale
    return dq, dk, dv


class BlockDraftAttentionFn(torch.autograd.Function):
    """Trunk (context, causal per row) + branch (the row's own S slots) attention.

    forward(q [S, T, Hq, D], k_ctx/v_ctx [T, Hkv, D], k_blk/v_blk [S, T, Hkv, D],
    cu_seqlens int32 [B + 1], scale, backend) -> out [S, T, Hq, D] (dtype of q).
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, scale, backend):  # type: ignore[override]
        s_, hkv = q.shape[0], k_ctx.shape[1]
        out_a, lse_a = block_forward(
            _passes_to_heads(q, hkv), k_ctx, v_ctx, cu_seqlens, cu_seqlens,
            causal=True, scale=scale, backend=backend,
        )  # fmt: skip
        out_a, lse_a = _heads_to_passes(out_a, s_, hkv), _lse_heads_to_passes(lse_a, s_, hkv)
        out_b, lse_b = _block_forward(q, k_blk, v_blk, scale)
        out, lse = merge_lse(out_a, lse_a.to(lse_b.dtype), out_b, lse_b)
        out = out.to(q.dtype)
        ctx.opts = (scale, backend)
        ctx.save_for_backward(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        scale, backend = ctx.opts
        q, k_ctx, v_ctx, k_blk, v_blk, cu, out, lse = ctx.saved_tensors
        s_, hkv = q.shape[0], k_ctx.shape[1]
        dq_a, dk_ctx, dv_ctx = block_backward(
            _passes_to_heads(dout, hkv), _passes_to_heads(q, hkv), k_ctx, v_ctx,
            _passes_to_heads(out, hkv), _lse_passes_to_heads(lse, hkv), cu, cu,
            causal=True, scale=scale, backend=backend,
        )  # fmt: skip
        dq_b, dk_blk, dv_blk = _block_backward(dout, q, k_blk, v_blk, out, lse, scale)
        dq = _heads_to_passes(dq_a, s_, hkv).to(dq_b.dtype) + dq_b
        return (
            dq.to(q.dtype), dk_ctx.to(k_ctx.dtype), dv_ctx.to(v_ctx.dtype),
            dk_blk.to(k_blk.dtype), dv_blk.to(v_blk.dtype), None, None, None,
        )  # fmt: skip


def block_draft_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """Block-drafter attention of every slot of every row at once (see the module doc).

    Args:
        q: ``[S, T, Hq, D]``, slot first.
        k_ctx, v_ctx: ``[T, Hkv, D]``, the context (the target's features, projected).
        k_blk, v_blk: ``[S, T, Hkv, D]``, the slots' own keys/values.
        cu_seqlens: int32 ``[B + 1]`` document boundaries of the packed T rows.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: trunk kernel, see :mod:`codraft.learner.attention.block`.

    Returns:
        ``out [S, T, Hq, D]`` (dtype of q).
    """
    if q.dim() != 4 or k_blk.dim() != 4 or k_ctx.dim() != 3:
        raise ValueError(
            "expected q [S, T, Hq, D], k_ctx/v_ctx [T, Hkv, D] and k_blk/v_blk [S, T, Hkv, D], "
            f"got q {tuple(q.shape)}, k_ctx {tuple(k_ctx.shape)}, k_blk {tuple(k_blk.shape)}"
        )
    s_, t, hq, d = q.shape
    hkv = k_ctx.shape[1]
    if (
        k_ctx.shape != v_ctx.shape
        or tuple(k_ctx.shape) != (t, hkv, d)
        or k_blk.shape != v_blk.shape
        or tuple(k_blk.shape) != (s_, t, hkv, d)
    ):
        raise ValueError(
            f"expected k_ctx/v_ctx [{t}, Hkv, {d}] and k_blk/v_blk [{s_}, {t}, Hkv, {d}] with one "
            f"Hkv, got k_ctx {tuple(k_ctx.shape)}, v_ctx {tuple(v_ctx.shape)}, "
            f"k_blk {tuple(k_blk.shape)}, v_blk {tuple(v_blk.shape)}"
        )
    if hq % hkv:
        raise ValueError(f"expected Hq to be a multiple of Hkv (GQA), got Hq={hq}, Hkv={hkv}")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    return BlockDraftAttentionFn.apply(q, k_ctx, v_ctx, k_blk, v_blk, cu_seqlens, scale, backend)
