"""Block attention: one (query block, key/value block) pair of packed THD tensors.

This is the interface everything above it is built on: TTT branch attention calls it once for the
trunk, context-parallel ring attention calls it once per (local queries, arriving K/V shard) pair.
A block is a flash-style attention that returns the log-sum-exp next to the output, so that blocks
can be merged exactly (:func:`merge_lse`) and replayed in backward with the *joint* output and
log-sum-exp (the ring-attention trick: ``dS = P * (dP - rowsum(dout * out_joint))`` with
``P = exp(S - lse_joint)``).

Layouts (shared by every function here):

* ``q``: ``[Tq, Hq, D]``, ``k``/``v``: ``[Tk, Hkv, D]``, packed THD: documents are concatenated
  along the token dimension. ``Hq`` must be a multiple of ``Hkv`` (GQA: query head ``h`` uses
  key/value head ``h // (Hq // Hkv)``).
* ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``[B + 1]``, cumulative document boundaries starting
  at 0 and ending at ``Tq`` / ``Tk``; document ``b`` of the queries only sees document ``b`` of the
  keys. Documents may have any length, including 1, and (``causal=False`` only) 0 on either side.
* ``out``: ``[Tq, Hq, D]`` in the dtype of ``q``.
* ``lse``: ``[Hq, Tq]`` (head-major, like flash-attn varlen), dtype float32 for fp16/bf16/fp32
  inputs and float64 for fp64 inputs. A row that sees no key has ``out = 0`` and ``lse = -inf``
  (never 0, never +inf, never nan), whatever the kernel underneath returned.

Masks: ``causal=False`` is a full block (every query of document b sees every key of document b).
``causal=True`` is only defined for the *diagonal* block: every document must have the same
length on both sides (``cu_seqlens_q == cu_seqlens_k``), and query ``i`` sees keys ``0..i``. The
kernels disagree about causal alignment when ``Tq != Tk`` (the CPU kernel aligns top-left,
flash-attn >= 2.1 aligns bottom-right), so that case is refused rather than silently picked.

Backends (``backend=``), one module each (their kernel traps are documented there):

* ``"cpu_flash"`` (:mod:`codraft.learner.attention.block_cpu`):
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), one call per document.
  Supports fp64/fp32/bf16/fp16 and GQA natively.
* ``"cuda_flash"`` (:mod:`codraft.learner.attention.block_cuda`): ``aten._flash_attention_forward``
  / ``_flash_attention_backward`` in varlen mode, fp16/bf16 only, head dim a multiple of 8 and at
  most 256.
* ``"math"`` (:mod:`codraft.learner.attention.block_math`): exact pure-torch attention, per document
  and in query chunks, so memory is never ``Tq x Tk`` over the packed batch. Any device, any float
  dtype; the fallback for fp32/fp64 on CUDA.
* ``"auto"`` (default): ``cpu_flash`` on CPU, ``cuda_flash`` on CUDA for fp16/bf16, else ``math``.

These functions are raw: they build no autograd graph. :class:`BlockAttentionFn` /
:func:`block_attention` wrap one block as an autograd op.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from codraft.learner.attention import block_cpu, block_cuda, block_math
from codraft.learner.attention.block_common import NEG_INF as _NEG_INF
from codraft.learner.attention.block_common import Segments as _Segments

Backend = Literal["auto", "cpu_flash", "cuda_flash", "math"]


# --------------------------------------------------------------------------------------------
# validation and segment bookkeeping
# --------------------------------------------------------------------------------------------


def _check_cu(cu: Tensor, total: int, name: str, device: torch.device) -> list[int]:
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
        got = tuple(cu.shape) if isinstance(cu, Tensor) else type(cu).__name__
        raise ValueError(f"{name}: expected a 1-D int32 tensor [B + 1] (B >= 1), got {got}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype int32, got {cu.dtype}; use .to(torch.int32)")
    if cu.device.type != device.type:
        raise ValueError(f"{name}: expected to live on {device.type} like q, got {cu.device}")
    vals = [int(x) for x in cu.tolist()]
    if vals[0] != 0 or vals[-1] != total:
        raise ValueError(
            f"{name}: expected to start at 0 and end at the token count {total}, "
            f"got {vals[0]}..{vals[-1]}"
        )
    if any(b < a for a, b in zip(vals[:-1], vals[1:], strict=True)):
        raise ValueError(f"{name}: expected non-decreasing boundaries, got {vals}")
    return vals


def _check_block(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, causal: bool
) -> _Segments:
    """Validate one block's inputs; return its document boundaries on the host."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "expected packed THD tensors q [Tq, Hq, D], k/v [Tk, Hkv, D], got shapes "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"expected k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"expected one head dim for q and k, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"expected Hq to be a multiple of Hkv (GQA), got Hq={q.shape[1]}, Hkv={k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(
            f"expected q, k, v of one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"expected q, k, v on one device, got {q.device}, {k.device}, {v.device}")
    seg = _Segments(
        _check_cu(cu_q, q.shape[0], "cu_seqlens_q", q.device),
        _check_cu(cu_k, k.shape[0], "cu_seqlens_k", q.device),
    )
    if len(seg.q) != len(seg.k):
        raise ValueError(
            f"expected the same number of documents on both sides, got {len(seg.q) - 1} query "
            f"documents and {len(seg.k) - 1} key documents"
        )
    if causal and seg.q != seg.k:
        raise ValueError(
            "causal=True is only defined for the diagonal block (every document the same length "
            "on both sides, cu_seqlens_q == cu_seqlens_k); got cu_seqlens_q "
            f"{seg.q} and cu_seqlens_k {seg.k}. Split the block into a full part and a diagonal "
            "part instead"
        )
    return seg


def _default_scale(scale: float | None, head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def _resolve_backend(backend: Backend, q: Tensor) -> str:
    if backend == "auto":
        if q.device.type == "cpu":
            return "cpu_flash"
        if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
            return "cuda_flash"
        return "math"
    if backend == "cpu_flash" and q.device.type != "cpu":
        raise ValueError(f"backend 'cpu_flash' needs CPU tensors, got {q.device}")
    if backend == "cuda_flash":
        if q.device.type != "cuda":
            raise ValueError(f"backend 'cuda_flash' needs CUDA tensors, got {q.device}")
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"backend 'cuda_flash' needs fp16/bf16, got {q.dtype}; use backend='math' "
                "(or 'auto') for fp32/fp64"
            )
    if backend not in ("cpu_flash", "cuda_flash", "math"):
        raise ValueError(f"expected backend in auto/cpu_flash/cuda_flash/math, got {backend!r}")
    return backend


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """Attention of one query block over one key/value block.

    Args:
        q: ``[Tq, Hq, D]``.
        k, v: ``[Tk, Hkv, D]``, ``Hq % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` document boundaries.
        causal: diagonal block with query i seeing keys 0..i of its document (needs
            ``cu_seqlens_q == cu_seqlens_k``); else a full block.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: see the module docstring.

    Returns:
        ``(out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] fp32, or fp64 for fp64 inputs)``; rows with
        no visible key have ``out = 0`` and ``lse = -inf``.
    """
    seg = _check_block(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    scale = _default_scale(scale, q.shape[-1])
    which = _resolve_backend(backend, q)
    with torch.no_grad():
        if which == "cpu_flash":
            return block_cpu.forward(q, k, v, seg, causal, scale)
        if which == "cuda_flash":
            return block_cuda.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seg, causal, scale)
        return block_math.forward(q, k, v, seg, causal, scale)


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block, replayed against a (possibly joint) output and log-sum-exp.

    Pass the *joint* ``out``/``lse`` of everything this block was merged with (trunk + branch,
    or all ring steps); then the returned gradients are this block's share of the gradient of the
    merged attention, and summing them over blocks gives the exact total.

    Args:
        dout: ``[Tq, Hq, D]`` upstream gradient of the (joint) output.
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, backend: as in :func:`block_forward`.
        out: ``[Tq, Hq, D]`` joint output (dtype of q).
        lse: ``[Hq, Tq]`` joint log-sum-exp (any float dtype; -inf for rows without keys).

    Returns:
        ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])`` in the dtype of q.
    """
    seg = _check_block(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"expected dout and out shaped like q {tuple(q.shape)}, got dout {tuple(dout.shape)} "
            f"and out {tuple(out.shape)}"
        )
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(
            f"expected lse [Hq, Tq] = {[q.shape[1], q.shape[0]]}, got {list(lse.shape)} "
            "(a [Tq, Hq] lse needs .transpose(0, 1))"
        )
    scale = _default_scale(scale, q.shape[-1])
    which = _resolve_backend(backend, q)
    with torch.no_grad():
        if which == "cpu_flash":
            return block_cpu.backward(dout, q, k, v, out, lse, seg, causal, scale)
        if which == "cuda_flash":
            return block_cuda.backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seg, causal, scale
            )
        return block_math.backward(dout, q, k, v, out, lse, seg, causal, scale)


def merge_lse(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Exactly merge two attention results over disjoint key sets.

    ``lse = logaddexp(lse_a, lse_b)``,
    ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
    Layout-agnostic: ``lse_*`` must have shape ``out_*.shape[:-1]`` (token-major, e.g. out
    ``[T, H, D]`` with lse ``[T, H]``; a block's ``[H, T]`` lse is passed as ``lse.transpose(0,
    1)``, a view). A side with ``lse = -inf`` contributes nothing; if both are ``-inf`` the result
    is ``out = 0, lse = -inf`` (no nan). The result's dtype is the promotion of all four inputs,
    so merging bf16 outputs with fp32 lse accumulates in fp32; cast at the end.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"expected matching shapes, got out {tuple(out_a.shape)} vs {tuple(out_b.shape)}, "
            f"lse {tuple(lse_a.shape)} vs {tuple(lse_b.shape)}"
        )
    if lse_a.shape != out_a.shape[:-1]:
        raise ValueError(
            f"expected lse shaped out.shape[:-1] = {tuple(out_a.shape[:-1])}, got "
            f"{tuple(lse_a.shape)}"
        )
    lse = torch.logaddexp(lse_a, lse_b)
    safe = lse.masked_fill(lse == _NEG_INF, 0.0)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * w_a + out_b * w_b, lse


class BlockAttentionFn(torch.autograd.Function):
    """One block as an autograd op (uses its own out/lse in backward). Shapes as block_forward."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, backend):  # type: ignore[override]
        out, lse = block_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, backend=backend
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.opts = (causal, scale, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        causal, scale, backend = ctx.opts
        dq, dk, dv = block_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=scale, backend=backend
        )
        return dq, dk, dv, None, None, None, None, None


def block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    backend: Backend = "auto",
) -> tuple[Tensor, Tensor]:
    """Differentiable :func:`block_forward` (gradient flows through ``out`` only; lse is
    non-differentiable, so do not merge two of these: use a Function that replays jointly)."""
    return BlockAttentionFn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, backend)
