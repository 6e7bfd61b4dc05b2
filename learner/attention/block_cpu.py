"""The ``"cpu_flash"`` backend of :mod:`codraft.learner.attention.block`: the CPU flash kernel.

``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), one call per document (the
kernel takes ``[B, H, T, D]``). Supports fp64/fp32/bf16/fp16 and GQA natively. Inputs are
validated by :mod:`codraft.learner.attention.block`; layouts are the ones documented there.

Kernel traps handled here (found by probing torch 2.13 CPU):

* the CPU kernel *crashes the process* (SIGFPE) on a document with 0 queries or 0 keys, so such
  documents never reach it;
* a fully masked row comes back from the CPU kernel with ``out = 0, lse = 0``; rows without keys
  are set to ``lse = -inf`` structurally here (the lse starts filled with the empty-row value and
  only documents with keys are written);
* the CPU kernel's lse is logically ``[B, H, T]`` but physically ``[B, T, H]`` (strided); its
  backward honours strides, so any ``[1, H, L]`` view works; its lse dtype is fp32 for
  half/bf16/fp32 and fp64 for fp64 inputs;
* the CPU kernel's GQA backward is 4-5x slower than its MHA backward (it seems to parallelise
  over kv heads), so k/v are expanded to Hq heads per document for the backward call and dk/dv
  summed back per group.

The two kernel calls are :func:`kernel_forward` and :func:`kernel_backward` (one document each),
so that the per-document bookkeeping around them stays in one place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from codraft.learner.attention.block_common import NEG_INF, Segments, lse_dtype


def _bhtd(x: Tensor, start: int, end: int) -> Tensor:
    """Rows start..end of a THD tensor as the [1, H, L, D] view the CPU kernel takes."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """The CPU flash kernel on one document: q ``[1, Hq, Lq, D]``, k/v ``[1, Hkv, Lk, D]``
    (neither length 0) -> ``(out [1, Hq, Lq, D], lse [1, Hq, Lq])``."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = kernel(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def kernel_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU flash kernel's backward on one document, shapes as :func:`kernel_forward`
    (``lse`` ``[1, Hq, Lq]``, any strides) -> ``(dq, dk, dv)`` shaped like q, k, v."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dq, dk, dv = kernel(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    return dq, dk, dv


def forward(
    q: Tensor, k: Tensor, v: Tensor, seg: Segments, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block; rows that see no key keep ``out = 0, lse = -inf``."""
    tq, hq, _ = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((hq, tq), NEG_INF, dtype=lse_dtype(q.dtype), device=q.device)
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:  # the kernel dies with SIGFPE on empty segments
            continue
        qd, kd, vd = _bhtd(q, qs, qe), _bhtd(k, ks, ke), _bhtd(v, ks, ke)
        o, l_ = kernel_forward(qd, kd, vd, causal, scale)
        out[qs:qe] = o[0].transpose(0, 1)
        lse[:, qs:qe] = l_[0]
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
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    lse = lse.to(lse_dtype(q.dtype))
    dout = dout.to(q.dtype)
    out = out.to(q.dtype)
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:
            continue
        # A row whose joint lse is -inf saw no key anywhere: +inf makes P = exp(S - lse) = 0.
        ld = lse[:, qs:qe]
        ld = ld.masked_fill(ld == NEG_INF, float("inf")).unsqueeze(0)
        kd, vd = _bhtd(k, ks, ke), _bhtd(v, ks, ke)
        if group > 1:  # the kernel's GQA backward is several times slower than MHA on CPU
            kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
        g = kernel_backward(
            _bhtd(dout, qs, qe), _bhtd(q, qs, qe), kd, vd, _bhtd(out, qs, qe), ld, causal, scale
        )
        dq[qs:qe] = g[0][0].transpose(0, 1)
        gk, gv = g[1][0].transpose(0, 1), g[2][0].transpose(0, 1)  # [Lk, Hq or Hkv, D]
        if group > 1:
            gk = gk.unflatten(1, (hkv, group)).sum(2, dtype=lse.dtype)
            gv = gv.unflatten(1, (hkv, group)).sum(2, dtype=lse.dtype)
        dk[ks:ke] = gk
        dv[ks:ke] = gv
    return dq, dk, dv
