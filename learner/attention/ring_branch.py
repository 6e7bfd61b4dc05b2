"""The branch term of one TTT pass, rank-local, merged in place into the trunk's accumulators.

The query of pass d at anchor i sees its own anchor's keys/values of passes 2..d (0-based here:
``kb[j]`` is pass j + 1's key at the same row). That needs no other position, so under context
parallelism it stays on the rank that owns the anchor. Shapes are packed THD: q ``[T, Hq, D]``,
each ``kb[j]``/``vb[j]`` ``[T, Hkv, D]`` (GQA: query head h uses kv head h // (Hq // Hkv); the
heads are grouped with views, never repeated). Scores are ``[T, Hq, d - 1]``: never ``T x T``.

Every row is independent, so both directions run in chunks of :data:`CHUNK` rows: the fp32
temporaries stay ``O(CHUNK * Hq * D * (d - 1))`` whatever T is, and the branch adds nothing to
the per-token memory of a pass (docs/context_parallel.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

CHUNK = 8192  # rows per chunk

_NEG_INF = float("-inf")


def merge_into(out: Tensor, lse: Tensor, o: Tensor, lse_o: Tensor) -> None:
    """In place: ``(out, lse) <- merge((out, lse), (o, lse_o))`` by log-sum-exp.

    ``out`` ``[R, H, D]`` and token-major ``lse`` ``[R, H]`` are fp32/fp64 accumulators (views
    are fine); ``o`` may be lower precision. A side with lse -inf contributes nothing; both
    -inf leaves ``out = 0, lse = -inf``. Same arithmetic as ``block.merge_lse``, no new
    ``[R, H, D]`` buffer."""
    new = torch.logaddexp(lse, lse_o)
    safe = new.masked_fill(new == _NEG_INF, 0.0)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.addcmul_(o, torch.exp(lse_o - safe).unsqueeze(-1).to(out.dtype))
    lse.copy_(new)


def _groups(x: Tensor, hkv: int) -> Tensor:
    """[R, Hq, D] -> [R, Hkv, G, D] (a view)."""
    r, hq, d = x.shape
    return x.view(r, hkv, hq // hkv, d)


def _chunk_kv(xs: Sequence[Tensor], r0: int, r1: int, acc: torch.dtype) -> Tensor:
    return torch.stack([x[r0:r1] for x in xs]).to(acc)  # [n, R, Hkv, D]


def _scores(qg: Tensor, k: Tensor, scale: float) -> Tensor:
    return torch.einsum("rkgd,nrkd->rkgn", qg, k) * scale  # [R, Hkv, G, n]


def branch_merge_into(
    out: Tensor, lse: Tensor, q: Tensor, kb: Sequence[Tensor], vb: Sequence[Tensor], scale: float
) -> None:
    """Merge the branch's attention into the accumulators ``out`` ``[T, Hq, D]`` and ``lse``
    ``[T, Hq]`` (fp32, or fp64 for fp64 inputs), in place, chunk by chunk."""
    acc, hkv = out.dtype, kb[0].shape[1]
    for r0 in range(0, q.shape[0], CHUNK):
        r1 = min(r0 + CHUNK, q.shape[0])
        k, v = _chunk_kv(kb, r0, r1, acc), _chunk_kv(vb, r0, r1, acc)
        s = _scores(_groups(q[r0:r1].to(acc), hkv), k, scale)
        lse_b = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse_b.unsqueeze(-1))
        o = torch.einsum("rkgn,nrkd->rkgd", p, v).flatten(1, 2)
        merge_into(out[r0:r1], lse[r0:r1], o, lse_b.flatten(1, 2))


def branch_forward(
    q: Tensor, kb: Sequence[Tensor], vb: Sequence[Tensor], scale: float
) -> tuple[Tensor, Tensor]:
    """The branch alone: ``(out [T, Hq, D], lse [T, Hq])`` in fp32 (fp64 for fp64 inputs)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], _NEG_INF, dtype=acc, device=q.device)
    branch_merge_into(out, lse, q, kb, vb, scale)
    return out, lse


def branch_backward_into(
    dq: Tensor,
    dout: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """Gradients of the branch's share of a merged attention; dq is accumulated in place.

    ``out`` [T, Hq, D] and ``lse`` [T, Hq] are the JOINT output and log-sum-exp (trunk and
    branch merged): then ``P = exp(S - lse)`` is the branch's slice of the joint softmax and
    ``delta = rowsum(dout * out)`` carries the gradient through the lse. ``dq`` is an fp32/fp64
    ``[T, Hq, D]`` accumulator. Returns ``(dk list, dv list)``, each ``[T, Hkv, D]`` in the
    dtype of ``kb[0]``.
    """
    acc, hkv = dq.dtype, kb[0].shape[1]
    dks = [torch.empty_like(k) for k in kb]
    dvs = [torch.empty_like(v) for v in vb]
    for r0 in range(0, q.shape[0], CHUNK):
        r1 = min(r0 + CHUNK, q.shape[0])
        k, v = _chunk_kv(kb, r0, r1, acc), _chunk_kv(vb, r0, r1, acc)
        qg = _groups(q[r0:r1].to(acc), hkv)
        dog = _groups(dout[r0:r1].to(acc), hkv)
        og = _groups(out[r0:r1].to(acc), hkv)
        lg = lse[r0:r1].to(acc).view(r1 - r0, hkv, -1, 1)
        p = torch.exp(_scores(qg, k, scale) - lg)
        dp = torch.einsum("rkgd,nrkd->rkgn", dog, v)
        ds = p * (dp - (dog * og).sum(-1, keepdim=True)) * scale
        dq[r0:r1] += torch.einsum("rkgn,nrkd->rkgd", ds, k).flatten(1, 2)
        dk = torch.einsum("rkgn,rkgd->nrkd", ds, qg)
        dv = torch.einsum("rkgn,rkgd->nrkd", p, dog)
        for j in range(len(kb)):
            dks[j][r0:r1] = dk[j]
            dvs[j][r0:r1] = dv[j]
    return dks, dvs
