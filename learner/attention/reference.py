"""Dense reference attention, for tests only.

Everything here builds explicit masks and score matrices over the whole packed batch (O(T^2)
memory) and runs plain softmax attention in the dtype it is given, with ordinary autograd. It
shares no code with :mod:`codraft.learner.attention.block` or
:mod:`codraft.learner.attention.branch` on purpose: it is the independent definition those are
checked against. Never use it in training.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _doc_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """int64 [total]: the document index of every packed token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    if ids.numel() != total:
        raise ValueError(f"cu_seqlens covers {ids.numel()} tokens, the tensor has {total}")
    return ids


def dense_masked_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax attention with an explicit boolean mask.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (GQA: query head h uses kv head h // G).
        mask: bool ``[Tq, Tk]``, True where the query may see the key.

    Returns:
        ``(out [Tq, Hq, D], lse [Hq, Tq])``; rows without a visible key give 0 and -inf.
    """
    g = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kx = k.repeat_interleave(g, dim=1)
    vx = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("ahd,bhd->hab", q, kx) * scale
    has_key = mask.any(dim=1)  # [Tq]
    # Rows without keys get an all-zero (unmasked) row so softmax/logsumexp stay finite with
    # finite gradients; their result is zeroed afterwards.
    row_mask = mask | ~has_key.unsqueeze(1)
    scores = scores.masked_fill(~row_mask, float("-inf"))
    scores = torch.where(has_key.view(1, -1, 1), scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * has_key.view(1, -1, 1)
    out = torch.einsum("hab,bhd->ahd", probs, vx)
    lse = torch.logsumexp(scores, dim=-1)
    lse = torch.where(has_key.unsqueeze(0), lse, torch.full_like(lse, float("-inf")))
    return out, lse


def dense_block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Dense version of one block: same documents only; ``causal`` means query i of a document
    sees keys 0..i of that document (positions counted from each document's start).

    Returns ``(out [Tq, Hq, D], lse [Hq, Tq])``.
    """
    dq = _doc_ids(cu_seqlens_q, q.shape[0])
    dk = _doc_ids(cu_seqlens_k, k.shape[0])
    mask = dq.unsqueeze(1) == dk.unsqueeze(0)
    if causal:
        pos_q = torch.arange(q.shape[0], device=q.device) - cu_seqlens_q.long()[dq]
        pos_k = torch.arange(k.shape[0], device=k.device) - cu_seqlens_k.long()[dk]
        mask = mask & (pos_k.unsqueeze(0) <= pos_q.unsqueeze(1))
    return dense_masked_attention(q, k, v, mask, scale)


def ttt_mask(num_passes: int, cu_seqlens: Tensor, tokens: int) -> Tensor:
    """bool [K*T, K*T], pass-major on both sides: query (p, i) sees key (e, j) iff
    e == 0 and j <= i in the same document (trunk), or 1 <= e <= p and j == i (branch)."""
    doc = _doc_ids(cu_seqlens, tokens)
    pass_idx = torch.arange(num_passes, device=doc.device).repeat_interleave(tokens)
    pos = torch.arange(tokens, device=doc.device).repeat(num_passes)
    qp, kp = pass_idx.unsqueeze(1), pass_idx.unsqueeze(0)
    qi, kj = pos.unsqueeze(1), pos.unsqueeze(0)
    trunk = (kp == 0) & (doc[kj] == doc[qi]) & (kj <= qi)
    branch = (kp >= 1) & (kp <= qp) & (kj == qi)
    return trunk | branch


def dense_ttt_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None = None
) -> Tensor:
    """Dense TTT attention over all passes' keys with the explicit [K*T, K*T] mask.

    Args:
        q: ``[K, T, Hq, D]``; k, v: ``[K, T, Hkv, D]`` (pass 0 is the trunk).
        cu_seqlens: int32 ``[B + 1]``.

    Returns:
        ``out [K, T, Hq, D]``.
    """
    n, t, hq, d = q.shape
    mask = ttt_mask(n, cu_seqlens, t)
    out, _ = dense_masked_attention(
        q.reshape(n * t, hq, d),
        k.reshape(n * t, k.shape[2], d),
        v.reshape(n * t, v.shape[2], d),
        mask,
        scale,
    )
    return out.reshape(n, t, hq, d)


def dense_block_draft_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Dense block-drafter (DFlash) attention with an explicit mask, stated by positions.

    Slot s of row i of a document is the query at position i + 1 + s of the block anchored at
    position a = i + 1. It sees the context key at position j of the same document iff j < a
    (the context is what the target has computed before the anchor), and the key of slot s' of
    a block iff that block has the same anchor (the block is bidirectional).

    Args:
        q: ``[S, T, Hq, D]``; k_blk, v_blk: ``[S, T, Hkv, D]``; k_ctx, v_ctx: ``[T, Hkv, D]``.
        cu_seqlens: int32 ``[B + 1]``.

    Returns:
        ``out [S, T, Hq, D]``.
    """
    s_, t, hq, d = q.shape
    doc = _doc_ids(cu_seqlens, t)
    pos = torch.arange(t, device=q.device) - cu_seqlens.long()[doc]  # position in the document
    anchor = (pos + 1).repeat(s_)  # of every query, slot-major
    qdoc = doc.repeat(s_)
    ctx_mask = (doc.unsqueeze(0) == qdoc.unsqueeze(1)) & (pos.unsqueeze(0) < anchor.unsqueeze(1))
    blk_mask = (qdoc.unsqueeze(1) == qdoc.unsqueeze(0)) & (
        anchor.unsqueeze(1) == anchor.unsqueeze(0)
    )
    hkv = k_ctx.shape[1]
    out, _ = dense_masked_attention(
        q.reshape(s_ * t, hq, d),
        torch.cat([k_ctx, k_blk.reshape(s_ * t, hkv, d)]),
        torch.cat([v_ctx, v_blk.reshape(s_ * t, hkv, d)]),
        torch.cat([ctx_mask, blk_mask], dim=1),
        scale,
    )
    return out.reshape(s_, t, hq, d)
