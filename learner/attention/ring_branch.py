"""The branch term of one TTT pass, rank-local, merged exactly with the trunk by log-sum-exp.

The query of pass d at anchor i sees its own anchor's keys/values of passes 2..d (0-based here:
``kb[j]`` is pass j + 1's key at the same row). That needs no other position, so under context
parallelism it stays on the rank that owns the anchor, and on one device it is the same code.
Shapes are packed THD: q ``[T, Hq, D]``, each ``kb[j]``/``vb[j]`` ``[T, Hkv, D]`` (GQA: query
head h uses kv head h // (Hq // Hkv); the heads are grouped with views, never repeated). Scores
are ``[T, Hq]`` per branch key: never ``T x T``.

Every row is independent. The arithmetic lives in two row functions, :func:`merge_rows`
(forward: branch scores, softmax and the merge with the trunk's ``(out, lse)`` in one pass) and
:func:`grad_rows` (backward against the JOINT out/lse). On CUDA they run compiled
(``torch.compile``: each becomes a few fused kernels that read q, dout and the branch keys once
per row, with no fp32 ``[T, Hq, D]`` temporaries per key); elsewhere, or with
``CODRAFT_COMPILE_BRANCH=0``, they run eagerly. Where they apply (CUDA, fp16/bf16/fp32, up to 7
branch keys) the hand-written Triton kernels of :mod:`codraft.learner.attention.branch_triton` take
their place: one read of every tensor, the GQA group in one tile (``CODRAFT_BRANCH_KERNEL``
picks explicitly). Both directions go in chunks of :data:`CHUNK`
rows, so temporaries stay ``O(CHUNK * Hq * D)`` whatever T is (docs/context_parallel.md).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from codraft.learner.attention import branch_triton

CHUNK = 8192  # rows per chunk (eager); compiled kernels take GPU_CHUNK rows
GPU_CHUNK = 65536

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


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def merge_rows(
    out_a: Tensor,
    lse_a: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Rows of ``merge((out_a, lse_a), branch(q, kb, vb))``: out ``[R, Hq, D]`` and lse
    ``[R, Hq]`` in the accumulation dtype (fp32, fp64 for fp64 inputs).

    ``lse_a`` may be -inf (an empty trunk); the branch has at least one finite score per row,
    so the normaliser is positive and nothing is nan."""
    acc = _acc(q.dtype)
    r, hq, d = q.shape
    hkv = kb[0].shape[1]
    g = hq // hkv
    qg = q.to(acc).view(r, hkv, g, d)
    la = lse_a.to(acc).reshape(r, hkv, g)
    s = [(qg * k.to(acc).unsqueeze(2)).sum(-1) * scale for k in kb]  # each [R, Hkv, G]
    m = la
    for sj in s:
        m = torch.maximum(m, sj)
    ea = torch.exp(la - m)
    e = [torch.exp(sj - m) for sj in s]
    z = ea
    o = ea.unsqueeze(-1) * out_a.to(acc).reshape(r, hkv, g, d)
    for ej, v in zip(e, vb, strict=True):
        z = z + ej
        o = o + ej.unsqueeze(-1) * v.to(acc).unsqueeze(2)
    o = o / z.unsqueeze(-1)
    return o.view(r, hq, d), (m + torch.log(z)).view(r, hq)


def grad_rows(
    dq: Tensor,
    dout: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Rows of the branch's gradients given the JOINT ``out``/``lse``: ``P = exp(S - lse)`` is
    the branch's slice of the joint softmax and ``delta = rowsum(dout * out)`` carries the
    gradient through the lse. Returns ``(dq + dq_branch`` summed in the accumulation dtype and
    cast back to dq's, ``dk list, dv list)``, dk/dv ``[R, Hkv, D]`` in the accumulation dtype."""
    acc = _acc(q.dtype)
    r, hq, d = q.shape
    hkv = kb[0].shape[1]
    g = hq // hkv
    qg = q.to(acc).view(r, hkv, g, d)
    dog = dout.to(acc).view(r, hkv, g, d)
    delta = (dog * out.to(acc).view(r, hkv, g, d)).sum(-1)  # [R, Hkv, G]
    lg = lse.to(acc).reshape(r, hkv, g)
    dqg = dq.to(acc).view(r, hkv, g, d)
    dks, dvs = [], []
    for k, v in zip(kb, vb, strict=True):
        kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
        p = torch.exp((qg * kf).sum(-1) * scale - lg)
        ds = p * ((dog * vf).sum(-1) - delta) * scale
        dqg = dqg + ds.unsqueeze(-1) * kf
        dks.append((ds.unsqueeze(-1) * qg).sum(2))
        dvs.append((p.unsqueeze(-1) * dog).sum(2))
    return dqg.view(r, hq, d).to(dq.dtype), dks, dvs


def _mode(x: Tensor, n_branch: int) -> str:
    """Which row kernels run: ``CODRAFT_BRANCH_KERNEL`` = triton | compile | eager | auto
    (default; ``CODRAFT_COMPILE_BRANCH=0`` still means eager). auto: the Triton kernels of
    :mod:`codraft.learner.attention.branch_triton` where they apply, compiled rows on other CUDA
    calls (fp64, more than 7 branch keys), eager rows on CPU."""
    if os.environ.get("CODRAFT_COMPILE_BRANCH", "1") == "0":
        return "eager"
    want = os.environ.get("CODRAFT_BRANCH_KERNEL", "auto")
    if want not in ("auto", "triton", "compile", "eager"):
        raise ValueError(f"CODRAFT_BRANCH_KERNEL must be auto/triton/compile/eager, got {want!r}")
    if want == "eager" or (want == "compile" and not x.is_cuda):
        return "eager"
    if want in ("auto", "triton") and branch_triton.usable(x, n_branch):
        return "triton"
    if want == "triton":
        raise ValueError(
            "CODRAFT_BRANCH_KERNEL=triton, but the Triton branch kernels cannot take this call "
            f"(device {x.device}, dtype {x.dtype}, {n_branch} branch keys; they need triton, a "
            f"CUDA tensor, fp16/bf16/fp32 and 1..{branch_triton.MAX_BRANCH} keys)"
        )
    return "compile" if x.is_cuda else "eager"


# One compiled graph per number of branch keys (1..7) and input layout, for each function.
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable) -> Callable:
    import torch._dynamo

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), RECOMPILE_LIMIT))
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _kernels(mode: str) -> tuple[Callable, Callable, int]:
    if mode == "compile":
        return _compiled(merge_rows), _compiled(grad_rows), GPU_CHUNK
    return merge_rows, grad_rows, CHUNK


def _one_layout(kb: Sequence[Tensor], vb: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The branch keys/values in one shared layout (what the Triton kernels index with)."""
    ref = kb[0].stride()
    if all(x.stride() == ref for x in (*kb, *vb)) and ref[-1] == 1:
        return list(kb), list(vb)
    return [k.contiguous() for k in kb], [v.contiguous() for v in vb]


def _merge(
    out_a: Tensor,
    lse_a: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    scale: float,
    out: Tensor,
    lse: Tensor,
) -> None:
    """``(out, lse) <- merge((out_a, lse_a), branch)``, chunk by chunk; ``out``/``lse`` may be
    ``out_a``/``lse_a`` themselves (each chunk is read before it is written)."""
    mode = _mode(q, len(kb))
    if mode == "triton":
        branch_triton.merge(out_a, lse_a, q, *_one_layout(kb, vb), scale, out=out, lse=lse)
        return
    merge, _, chunk = _kernels(mode)
    for r0 in range(0, q.shape[0], chunk):
        r1 = min(r0 + chunk, q.shape[0])
        o, lo = merge(
            out_a[r0:r1], lse_a[r0:r1], q[r0:r1], _rows(kb, r0, r1), _rows(vb, r0, r1), scale
        )
        out[r0:r1].copy_(o)
        lse[r0:r1].copy_(lo)


def branch_merge_into(
    out: Tensor, lse: Tensor, q: Tensor, kb: Sequence[Tensor], vb: Sequence[Tensor], scale: float
) -> None:
    """Merge the branch's attention into the accumulators ``out`` ``[T, Hq, D]`` and ``lse``
    ``[T, Hq]`` (fp32, or fp64 for fp64 inputs), in place, chunk by chunk."""
    _merge(out, lse, q, kb, vb, scale, out, lse)


def branch_merge(
    out_a: Tensor,
    lse_a: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """The trunk's ``(out_a [T, Hq, D], lse_a [T, Hq])`` merged with the branch: out in q's
    dtype, lse in the accumulation dtype."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=_acc(q.dtype), device=q.device)
    _merge(out_a, lse_a, q, kb, vb, scale, out, lse)
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
    branch merged), see :func:`grad_rows`. ``dq`` is a ``[T, Hq, D]`` accumulator (any float
    dtype; the sum is taken in fp32/fp64 and rounded once). Returns ``(dk list, dv list)``,
    each ``[T, Hkv, D]`` in the dtype of ``kb[0]``.
    """
    mode = _mode(q, len(kb))
    if mode == "triton":
        return branch_triton.grad(dq, dout, q, *_one_layout(kb, vb), out, lse, scale)
    _, grad, chunk = _kernels(mode)
    dks = [torch.empty_like(k) for k in kb]
    dvs = [torch.empty_like(v) for v in vb]
    for r0 in range(0, q.shape[0], chunk):
        r1 = min(r0 + chunk, q.shape[0])
        dqn, dk, dv = grad(
            dq[r0:r1], dout[r0:r1], q[r0:r1], _rows(kb, r0, r1), _rows(vb, r0, r1),
            out[r0:r1], lse[r0:r1], scale,
        )  # fmt: skip
        dq[r0:r1].copy_(dqn)
        for j in range(len(kb)):
            dks[j][r0:r1] = dk[j]
            dvs[j][r0:r1] = dv[j]
    return dks, dvs


def _rows(xs: Sequence[Tensor], r0: int, r1: int) -> list[Tensor]:
    return [x[r0:r1] for x in xs]
