"""Branch attention for EAGLE-3 training-time test (TTT), as one autograd Function.

TTT runs K passes of a one-layer draft. Pass index p is 0-based here (pass p is
docs/architecture.md's pass p + 1; p = 0 is the trunk). The query of pass p at anchor position i
sees

* (a) the trunk: pass 0's keys/values at positions 0..i of its own document (causal), and
* (b) the branch: its own anchor's keys/values from passes 1..p (a diagonal, same position i).

Nothing else. Pass 0 sees only (a). No T x T mask or score matrix is ever built:

* (a) is ONE causal :func:`~codraft.learner.attention.block.block_forward` call for all K query
  passes at once: the K passes are folded into the head dimension as extra GQA query heads (query
  heads are ordered ``[Hkv, K, G]``, so every pass of a group shares pass 0's key/value head).
  Causality is then per anchor position, exactly as required, and the kernel stays on its diagonal
  block.
* (b) is, pass by pass, a ``[T, Hq, p]`` score tensor (einsum over keys 1..p of the same
  position; pass 0 has none and carries ``lse = -inf`` into the merge).
* The two merge exactly by log-sum-exp (:func:`merge_lse`); backward replays both with the joint
  output and lse (:func:`~codraft.learner.attention.block.block_backward` for the trunk, an analytic
  backward for the branch), so the gradient through the lse is kept.

All K passes' q/k/v must exist before the call. In the TTT forward pass d's input depends on
pass d-1's attention output, so a sequential forward needs a per-pass op instead; this one fits
where every pass is at hand (recomputation, checks, benchmarks) and is the K-at-once reference
for such ops.

Memory: ``O(K * T * Hq * D)`` (a few copies of q in its dtype, one pass of fp32 temporaries)
plus whatever the trunk kernel needs; never ``T x T``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from codraft.learner.attention.block import Backend, block_backward, block_forward, merge_lse

__all__ = ["BranchAttentionFn", "branch_attention", "merge_lse"]

_NEG_INF = float("-inf")


def _passes_to_heads(x: Tensor, hkv: int) -> Tensor:
    """[K, T, Hq, D] -> [T, Hkv * K * G, D] (query heads ordered [Hkv, K, G])."""
    k_, t, hq, d = x.shape
    return x.reshape(k_, t, hkv, hq // hkv, d).permute(1, 2, 0, 3, 4).reshape(t, k_ * hq, d)


def _heads_to_passes(y: Tensor, k_: int, hkv: int) -> Tensor:
    """[T, Hkv * K * G, D] -> [K, T, Hq, D]; inverse of :func:`_passes_to_heads`."""
    t, h, d = y.shape
    g = h // (hkv * k_)
    return y.reshape(t, hkv, k_, g, d).permute(2, 0, 1, 3, 4).reshape(k_, t, hkv * g, d)


def _lse_heads_to_passes(lse: Tensor, k_: int, hkv: int) -> Tensor:
    """Trunk lse [Hkv * K * G, T] -> token-major [K, T, Hq]."""
    h, t = lse.shape
    g = h // (hkv * k_)
    return lse.reshape(hkv, k_, g, t).permute(1, 3, 0, 2).reshape(k_, t, hkv * g)


def _lse_passes_to_heads(lse: Tensor, hkv: int) -> Tensor:
    """Token-major [K, T, Hq] -> trunk lse [Hkv * K * G, T]."""
    k_, t, hq = lse.shape
    return lse.reshape(k_, t, hkv, hq // hkv).permute(2, 0, 3, 1).reshape(k_ * hq, t)


def _branch_keys(p: int) -> range:
    """Passes whose keys at the same position the query of pass p sees in the branch: 1..p."""
    return range(1, p + 1)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _branch_pass_forward(
    qp: Tensor, k: Tensor, v: Tensor, p: int, scale: float
) -> tuple[Tensor, Tensor]:
    """Branch block of one pass: queries qp [T, Hq, D] of pass p over k/v[1..p] at the same
    position. Returns (out [T, Hq, D], lse [T, Hq]) in fp32 (fp64 for fp64); a pass without
    branch keys (pass 0) gives out = 0 and lse = -inf (zero-stride views, no memory)."""
    t, hq, d = qp.shape
    hkv = k.shape[2]
    acc = _acc(qp.dtype)
    keys = _branch_keys(p)
    if len(keys) == 0:
        out = torch.zeros((), dtype=acc, device=qp.device).expand(t, hq, d)
        return out, torch.full((), _NEG_INF, dtype=acc, device=qp.device).expand(t, hq)
    sl = slice(keys.start, keys.stop)
    q4 = qp.to(acc).reshape(t, hkv, hq // hkv, d)
    s = torch.einsum("tngc,etnc->tnge", q4, k[sl].to(acc)) * scale  # [T, Hkv, G, |keys|]
    lse = torch.logsumexp(s, dim=-1)
    prob = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("tnge,etnc->tngc", prob, v[sl].to(acc))
    return out.reshape(t, hq, d), lse.reshape(t, hq)


def _branch_pass_backward(
    dout_p: Tensor,
    qp: Tensor,
    k: Tensor,
    v: Tensor,
    out_p: Tensor,
    lse_p: Tensor,
    p: int,
    scale: float,
    dk: Tensor,
    dv: Tensor,
) -> Tensor | None:
    """Branch gradients of pass p, replayed with the (joint) out_p [T, Hq, D], lse_p [T, Hq].

    Adds dk/dv of passes 1..p into the fp32 (fp64) buffers dk/dv [K, T, Hkv, D]; returns dq of
    pass p [T, Hq, D] in fp32 (fp64), or None when the pass has no branch keys.
    """
    keys = _branch_keys(p)
    if len(keys) == 0:
        return None
    t, hq, d = qp.shape
    hkv = k.shape[2]
    g = hq // hkv
    acc = _acc(qp.dtype)
    sl = slice(keys.start, keys.stop)
    kb, vb = k[sl].to(acc), v[sl].to(acc)
    q4 = qp.to(acc).reshape(t, hkv, g, d)
    do4 = dout_p.to(acc).reshape(t, hkv, g, d)
    lse4 = lse_p.to(acc).reshape(t, hkv, g, 1)
    s = torch.einsum("tngc,etnc->tnge", q4, kb) * scale
    prob = torch.exp(s - lse4.masked_fill(lse4 == _NEG_INF, float("inf")))
    dp = torch.einsum("tngc,etnc->tnge", do4, vb)
    rowdot = (do4 * out_p.to(acc).reshape(t, hkv, g, d)).sum(-1, keepdim=True)
    ds = prob * (dp - rowdot)
    dk[sl] += torch.einsum("tnge,tngc->etnc", ds, q4) * scale
    dv[sl] += torch.einsum("tnge,tngc->etnc", prob, do4)
    return torch.einsum("tnge,etnc->tngc", ds, kb).reshape(t, hq, d) * scale


def _trunk_forward(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float, backend: Backend
) -> tuple[Tensor, Tensor]:
    """All K query passes over pass 0's keys, causal: (out [K, T, Hq, D], lse [K, T, Hq])."""
    k_, hkv = q.shape[0], k.shape[2]
    out, lse = block_forward(
        _passes_to_heads(q, hkv), k[0], v[0], cu, cu, causal=True, scale=scale, backend=backend
    )
    return _heads_to_passes(out, k_, hkv), _lse_heads_to_passes(lse, k_, hkv)


def _trunk_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu: Tensor,
    scale: float,
    backend: Backend,
) -> tuple[Tensor, Tensor, Tensor]:
    """Trunk gradients replayed with (joint) out/lse: (dq [K, T, Hq, D], dk0, dv0 [T, Hkv, D])."""
    k_, hkv = q.shape[0], k.shape[2]
    dq, dk0, dv0 = block_backward(
        _passes_to_heads(dout, hkv),
        _passes_to_heads(q, hkv),
        k[0],
        v[0],
        _passes_to_heads(out, hkv),
        _lse_passes_to_heads(lse, hkv),
        cu,
        cu,
        causal=True,
        scale=scale,
        backend=backend,
    )
    return _heads_to_passes(dq, k_, hkv), dk0, dv0


class BranchAttentionFn(torch.autograd.Function):
    """Trunk (causal, pass 0's keys) + branch (own anchor, passes 1..p) attention; see module doc.

    forward(q [K, T, Hq, D], k/v [K, T, Hkv, D], cu_seqlens int32 [B + 1], scale, backend)
    -> out [K, T, Hq, D] (dtype of q). The branch is computed pass by pass, so its fp32
    temporaries are one pass in size.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, backend):  # type: ignore[override]
        out_a, lse_a = _trunk_forward(q, k, v, cu_seqlens, scale, backend)
        acc = _acc(q.dtype)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        for p in range(q.shape[0]):
            out_b, lse_b = _branch_pass_forward(q[p], k, v, p, scale)
            out[p], lse[p] = merge_lse(out_a[p], lse_a[p].to(acc), out_b, lse_b)
        ctx.opts = (scale, backend)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        scale, backend = ctx.opts
        q, k, v, cu, out, lse = ctx.saved_tensors
        dq_a, dk0, dv0 = _trunk_backward(dout, q, k, v, out, lse, cu, scale, backend)
        acc = _acc(q.dtype)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dk[0], dv[0] = dk0, dv0
        for p in range(q.shape[0]):
            dq_b = _branch_pass_backward(dout[p], q[p], k, v, out[p], lse[p], p, scale, dk, dv)
            dq[p] = dq_a[p] if dq_b is None else dq_a[p].to(acc) + dq_b
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def branch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    scale: float | None = None,
    *,
    backend: Backend = "auto",
) -> Tensor:
    """TTT attention of all K passes at once.

    Args:
        q: ``[K, T, Hq, D]``, pass index first (pass 0 is the trunk).
        k, v: ``[K, T, Hkv, D]``; ``Hq % Hkv == 0``.
        cu_seqlens: int32 ``[B + 1]`` document boundaries of the packed T tokens (the same for
            every pass: pass p at anchor i is a prediction made *at* anchor i).
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: trunk kernel, see :mod:`codraft.learner.attention.block`.

    Returns:
        ``out [K, T, Hq, D]`` (dtype of q): ``out[p]`` is attention of ``q[p]`` over ``k[0]/v[0]``
        causal within documents, merged with ``k[1..p]/v[1..p]`` at the same position.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "expected q [K, T, Hq, D] and k/v [K, T, Hkv, D], got shapes "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            "expected q [K, T, Hq, D] and k/v [K, T, Hkv, D] with one K, T and D, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] < 1:
        raise ValueError(f"expected at least one pass (K >= 1), got K = {q.shape[0]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"expected Hq to be a multiple of Hkv (GQA), got Hq={q.shape[2]}, Hkv={k.shape[2]}"
        )
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return BranchAttentionFn.apply(q, k, v, cu_seqlens, scale, backend)
