"""The ``"math"`` backend of :mod:`codraft.learner.attention.block`: exact pure-torch attention.

Per document and in query chunks of ``_MATH_CHUNK`` rows, so memory is
``O(chunk * Tk_doc * Hq)``, never ``Tq x Tk`` over the packed batch. Any device, any float dtype;
the fallback for fp32/fp64 on CUDA. Accumulates in the lse dtype (fp32, or fp64 for fp64
inputs). Inputs are validated by :mod:`codraft.learner.attention.block`; layouts are the ones
documented there. Documents with 0 queries or 0 keys are skipped, so their rows keep ``out = 0`` and
the lse of ``-inf``. The masked scores of a query chunk come from one function,
:func:`_math_scores`, which forward and backward share.
"""

from __future__ import annotations

import torch
from torch import Tensor

from codraft.learner.attention.block_common import NEG_INF, Segments, lse_dtype

# Rows per query chunk in the "math" backend.
_MATH_CHUNK = 256


def _math_scores(
    qc: Tensor,
    kd: Tensor,
    row0: int,
    causal: bool,
    scale: float,
    acc: torch.dtype,
) -> Tensor:
    """Masked scores [Hkv, G, C, Lk] of query chunk qc [C, Hq, D] (rows row0..) over kd."""
    c, hq, d = qc.shape
    lk, hkv, _ = kd.shape
    qg = qc.to(acc).reshape(c, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, C, D]
    kt = kd.to(acc).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Lk]
    s = torch.matmul(qg, kt) * scale
    if causal:
        rows = torch.arange(row0, row0 + c, device=qc.device).unsqueeze(1)
        cols = torch.arange(lk, device=qc.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, NEG_INF)
    return s


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seg: Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block; rows that see no key keep ``out = 0, lse = -inf``."""
    acc = lse_dtype(q.dtype)
    tq, hq, d = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((hq, tq), NEG_INF, dtype=acc, device=q.device)
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:
            continue
        for r0 in range(0, qe - qs, _MATH_CHUNK):
            r1 = min(r0 + _MATH_CHUNK, qe - qs)
            kend = min(r1 + 1, ke - ks) if causal else ke - ks  # causal rows < r1 see keys < r1+1
            kd, vd = k[ks : ks + kend], v[ks : ks + kend]
            s = _math_scores(q[qs + r0 : qs + r1], kd, r0, causal, scale, acc)
            m = torch.logsumexp(s, dim=-1)  # [Hkv, G, C]; every row has >= 1 key here
            p = torch.exp(s - m.unsqueeze(-1))
            o = torch.matmul(p, vd.to(acc).permute(1, 0, 2).unsqueeze(1))  # [Hkv, G, C, D]
            out[qs + r0 : qs + r1] = o.permute(2, 0, 1, 3).reshape(r1 - r0, hq, d).to(q.dtype)
            lse[:, qs + r0 : qs + r1] = m.reshape(hq, r1 - r0)
    return out, lse


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    seg: Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block, replayed against the (joint) ``out`` and ``lse``."""
    acc = lse_dtype(q.dtype)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:
            continue
        for r0 in range(0, qe - qs, _MATH_CHUNK):
            r1 = min(r0 + _MATH_CHUNK, qe - qs)
            c = r1 - r0
            kend = min(r1 + 1, ke - ks) if causal else ke - ks
            kd, vd = k[ks : ks + kend], v[ks : ks + kend]
            s = _math_scores(q[qs + r0 : qs + r1], kd, r0, causal, scale, acc)
            ld = lse[:, qs + r0 : qs + r1].to(acc).reshape(hkv, g, c, 1)
            ld = ld.masked_fill(ld == NEG_INF, float("inf"))
            p = torch.exp(s - ld)  # [Hkv, G, C, Lk]
            do = dout[qs + r0 : qs + r1].to(acc).reshape(c, hkv, g, d).permute(1, 2, 0, 3)
            o = out[qs + r0 : qs + r1].to(acc).reshape(c, hkv, g, d).permute(1, 2, 0, 3)
            vt = vd.to(acc).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Lk]
            dp = torch.matmul(do, vt)
            ds = p * (dp - (do * o).sum(-1, keepdim=True))
            kk = kd.to(acc).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, Lk, D]
            qg = q[qs + r0 : qs + r1].to(acc).reshape(c, hkv, g, d).permute(1, 2, 0, 3)
            dq[qs + r0 : qs + r1] = (
                (torch.matmul(ds, kk) * scale).permute(2, 0, 1, 3).reshape(c, hq, d)
            )
            dk_c = torch.matmul(ds.transpose(-1, -2), qg).sum(1) * scale  # [Hkv, Lk, D]
            dv_c = torch.matmul(p.transpose(-1, -2), do).sum(1)
            dk[ks : ks + kend] += dk_c.transpose(0, 1)
            dv[ks : ks + kend] += dv_c.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
