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

Backends (``backend=``):

* ``"cpu_flash"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), one call
  per document (the kernel takes ``[B, H, T, D]``). Supports fp64/fp32/bf16/fp16 and GQA natively.
* ``"cuda_flash"``: ``aten._flash_attention_forward`` / ``_flash_attention_backward`` in varlen
  mode (``cum_seq_q``/``cum_seq_k``), fp16/bf16 only, head dim a multiple of 8 and at most 256.
* ``"math"``: exact pure-torch attention, per document and in query chunks of ``_MATH_CHUNK``
  rows, so memory is ``O(chunk * Tk_doc * Hq)``, never ``Tq x Tk`` over the packed batch. Any
  device, any float dtype; the fallback for fp32/fp64 on CUDA.
* ``"auto"`` (default): ``cpu_flash`` on CPU, ``cuda_flash`` on CUDA for fp16/bf16, else ``math``.

Kernel traps handled here (found by probing torch 2.13 CPU and torch 2.11 CUDA):

* the CPU kernel *crashes the process* (SIGFPE) on a document with 0 queries or 0 keys, so such
  documents never reach it;
* a fully masked row comes back from the CPU kernel with ``out = 0, lse = 0`` (flash on CUDA
  returns ``lse = +inf``); rows without keys are set to ``lse = -inf`` structurally here;
* the CPU kernel's lse is logically ``[B, H, T]`` but physically ``[B, T, H]`` (strided); its
  backward honours strides, so any ``[1, H, L]`` view works; its lse dtype is fp32 for
  half/bf16/fp32 and fp64 for fp64 inputs;
* the CPU kernel's GQA backward is 4-5x slower than its MHA backward (it seems to parallelise
  over kv heads), so k/v are expanded to Hq heads per document for the backward call and dk/dv
  summed back per group;
* flash's backward expects a row without keys to carry ``lse = +inf`` (so ``P = exp(S - lse) = 0``);
  :func:`block_backward` converts ``-inf`` to ``+inf`` before calling it;
* flash's backward (torch 2.11, H200) hits an illegal memory access once tokens x heads x head
  dim of one call passes 2^31 (131072 tokens x 224 heads x 128); calls are split by heads
  (:func:`_flash_head_chunks`) to stay under ``_FLASH_MAX_ELEMENTS``.

Checked on an H200 (torch 2.11+cu130): the CUDA tests in tests/test_branch_attention.py pass,
a fully masked flash row comes back as ``out = 0, lse = +inf``, and varlen lse is ``[Hq, Tq]``.

These functions are raw: they build no autograd graph. :class:`BlockAttentionFn` /
:func:`block_attention` wrap one block as an autograd op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Backend = Literal["auto", "cpu_flash", "cuda_flash", "math"]

# Rows per query chunk in the "math" backend.
_MATH_CHUNK = 256
# Most (rows x heads x rounded head dim) elements in one CUDA flash call; see _flash_head_chunks.
_FLASH_MAX_ELEMENTS = 2**30

# Test-only planted-bug switch (tests/test_branch_attention.py sets it to prove that the tests
# catch each bug). Never set it anywhere else. Recognised values here:
#   "causal_off_by_one"   causal blocks let query i see key i+1 too
#   "empty_row_lse_zero"  rows with no visible key carry lse = 0 instead of -inf
_MUTATION: str | None = None

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# validation and segment bookkeeping
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segments:
    """Host copy of the document boundaries of one block."""

    q: list[int]  # cu_seqlens_q as Python ints, length B + 1
    k: list[int]  # cu_seqlens_k as Python ints, length B + 1

    def docs(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_end, k_start, k_end) per document."""
        return [
            (self.q[b], self.q[b + 1], self.k[b], self.k[b + 1]) for b in range(len(self.q) - 1)
        ]

    @property
    def max_q(self) -> int:
        return max((self.q[b + 1] - self.q[b] for b in range(len(self.q) - 1)), default=0)

    @property
    def max_k(self) -> int:
        return max((self.k[b + 1] - self.k[b] for b in range(len(self.k) - 1)), default=0)


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


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _empty_row_lse() -> float:
    """The lse a row with no visible key carries into a merge: -inf."""
    return 0.0 if _MUTATION == "empty_row_lse_zero" else _NEG_INF


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
            return _cpu_forward(q, k, v, seg, causal, scale)
        if which == "cuda_flash":
            return _cuda_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seg, causal, scale)
        return _math_forward(q, k, v, seg, causal, scale)


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
            return _cpu_backward(dout, q, k, v, out, lse, seg, causal, scale)
        if which == "cuda_flash":
            return _cuda_backward(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seg, causal, scale
            )
        return _math_backward(dout, q, k, v, out, lse, seg, causal, scale)


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


# --------------------------------------------------------------------------------------------
# CPU flash kernel, one call per document
# --------------------------------------------------------------------------------------------


def _cpu_mask(n: int, dtype: torch.dtype) -> Tensor:
    """Float additive mask [n, n] for the planted off-by-one bug (tests only)."""
    allowed = torch.ones(n, n, dtype=torch.bool).tril(diagonal=1)
    return torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, _NEG_INF)


def _bhtd(x: Tensor, start: int, end: int) -> Tensor:
    """Rows start..end of a THD tensor as the [1, H, L, D] view the CPU kernel takes."""
    return x[start:end].transpose(0, 1).unsqueeze(0)


def _cpu_forward(
    q: Tensor, k: Tensor, v: Tensor, seg: _Segments, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    tq, hq, _ = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((hq, tq), _empty_row_lse(), dtype=_lse_dtype(q.dtype), device=q.device)
    off_by_one = causal and _MUTATION == "causal_off_by_one"
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:  # the kernel dies with SIGFPE on empty segments
            continue
        qd, kd, vd = _bhtd(q, qs, qe), _bhtd(k, ks, ke), _bhtd(v, ks, ke)
        if off_by_one:
            o, l_ = kernel(
                qd, kd, vd, 0.0, False, attn_mask=_cpu_mask(qe - qs, q.dtype), scale=scale
            )
        else:
            o, l_ = kernel(qd, kd, vd, 0.0, causal, scale=scale)
        out[qs:qe] = o[0].transpose(0, 1)
        lse[:, qs:qe] = l_[0]
    return out, lse


def _cpu_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    seg: _Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    lse = lse.to(_lse_dtype(q.dtype))
    dout = dout.to(q.dtype)
    out = out.to(q.dtype)
    off_by_one = causal and _MUTATION == "causal_off_by_one"
    for qs, qe, ks, ke in seg.docs():
        if qe == qs or ke == ks:
            continue
        # A row whose joint lse is -inf saw no key anywhere: +inf makes P = exp(S - lse) = 0.
        ld = lse[:, qs:qe]
        ld = ld.masked_fill(ld == _NEG_INF, float("inf")).unsqueeze(0)
        mask = _cpu_mask(qe - qs, q.dtype) if off_by_one else None
        kd, vd = _bhtd(k, ks, ke), _bhtd(v, ks, ke)
        if group > 1:  # the kernel's GQA backward is several times slower than MHA on CPU
            kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
        g = kernel(
            _bhtd(dout, qs, qe),
            _bhtd(q, qs, qe),
            kd,
            vd,
            _bhtd(out, qs, qe),
            ld,
            0.0,
            causal and not off_by_one,
            attn_mask=mask,
            scale=scale,
        )
        dq[qs:qe] = g[0][0].transpose(0, 1)
        gk, gv = g[1][0].transpose(0, 1), g[2][0].transpose(0, 1)  # [Lk, Hq or Hkv, D]
        if group > 1:
            gk = gk.unflatten(1, (hkv, group)).sum(2, dtype=lse.dtype)
            gv = gv.unflatten(1, (hkv, group)).sum(2, dtype=lse.dtype)
        dk[ks:ke] = gk
        dv[ks:ke] = gv
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# CUDA flash kernel, varlen (CI has no GPU: the CUDA tests skip there; run them on a GPU)
# --------------------------------------------------------------------------------------------


def _cuda_check(q: Tensor) -> None:
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        raise RuntimeError(
            "backend 'cuda_flash': this torch build has no aten._flash_attention_forward; "
            "use backend='math'"
        )
    d = q.shape[-1]
    if d % 8 != 0 or d > 256:
        raise ValueError(
            f"backend 'cuda_flash' needs head dim a multiple of 8 and <= 256, got {d}; "
            "use backend='math'"
        )


def _rows_with_keys(cu_q: Tensor, cu_k: Tensor, tq: int) -> Tensor:
    """bool [Tq]: the query row's document has at least one key (device-side, no sync)."""
    len_q = (cu_q[1:] - cu_q[:-1]).long()
    has = (cu_k[1:] - cu_k[:-1]) > 0
    return torch.repeat_interleave(has, len_q, output_size=tq)


def _flash_head_chunks(rows: int, hq: int, hkv: int, d: int) -> list[tuple[int, int, int, int]]:
    """Split the heads of one flash call: [(q_head0, q_head1, kv_head0, kv_head1), ...].

    Flash's backward overflows 32-bit offsets (illegal memory access, seen on H200 with torch
    2.11: T = 131072 tokens x 224 heads x D = 128 crashed, 96 heads ran) when
    tokens x heads x head dim passes 2^31, so each call keeps ``rows * heads * D_rounded`` under
    ``_FLASH_MAX_ELEMENTS``. Chunks follow GQA groups: whole groups (several kv heads) if one
    fits, else query heads of a single group in equal parts.
    """
    g = hq // hkv
    d_rounded = -(-d // 32) * 32
    fit = max(1, _FLASH_MAX_ELEMENTS // max(1, rows * d_rounded))  # query heads per call
    if fit >= hq:
        return [(0, hq, 0, hkv)]
    if fit >= g:
        m = fit // g
        return [(j * g, min(j + m, hkv) * g, j, min(j + m, hkv)) for j in range(0, hkv, m)]
    c = max(x for x in range(1, g + 1) if g % x == 0 and x <= fit)
    return [(h, h + c, h // g, h // g + 1) for h in range(0, hq, c)]


def _cuda_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    seg: _Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    _cuda_check(q)
    if _MUTATION == "causal_off_by_one" and causal:
        raise NotImplementedError("the planted off-by-one bug exists for cpu_flash/math only")
    tq, hq, d = q.shape
    rows = max(tq, k.shape[0]) + 128 * (len(seg.q) - 1)
    chunks = _flash_head_chunks(rows, hq, k.shape[1], d)
    outs, lses = [], []
    for h0, h1, j0, j1 in chunks:
        o, l_ = torch.ops.aten._flash_attention_forward(
            q[:, h0:h1].contiguous(),
            k[:, j0:j1].contiguous(),
            v[:, j0:j1].contiguous(),
            cu_q,
            cu_k,
            max(seg.max_q, 1),
            max(seg.max_k, 1),
            0.0,
            causal,
            False,
            scale=scale,
        )[:2]
        if l_.shape != (h1 - h0, tq):
            raise RuntimeError(
                f"aten._flash_attention_forward (varlen) returned lse {list(l_.shape)}, expected "
                f"[heads, Tq] = {[h1 - h0, tq]}; this torch build uses another layout"
            )
        outs.append(o)
        lses.append(l_.float())
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=0)
    if not causal:  # a causal diagonal row always sees its own key
        has = _rows_with_keys(cu_q, cu_k, tq)
        lse = torch.where(has.unsqueeze(0), lse, torch.full_like(lse, _empty_row_lse()))
        out = torch.where(has[:, None, None], out, torch.zeros_like(out))
    return out, lse


def _cuda_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    seg: _Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _cuda_check(q)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    lse = lse.float()
    lse = lse.masked_fill(lse == _NEG_INF, float("inf"))  # flash: a row without keys has +inf
    dout, out = dout.to(q.dtype), out.to(q.dtype)
    # dropout_p = 0: the philox seed/offset are never read, but the op wants tensors.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    rows = max(tq, k.shape[0]) + 128 * (len(seg.q) - 1)
    chunks = _flash_head_chunks(rows, hq, hkv, d)
    grads = []
    for h0, h1, j0, j1 in chunks:
        g = torch.ops.aten._flash_attention_backward(
            dout[:, h0:h1].contiguous(),
            q[:, h0:h1].contiguous(),
            k[:, j0:j1].contiguous(),
            v[:, j0:j1].contiguous(),
            out[:, h0:h1].contiguous(),
            lse[h0:h1].contiguous(),
            cu_q,
            cu_k,
            max(seg.max_q, 1),
            max(seg.max_k, 1),
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
        if len(chunks) == 1:
            return g[0], g[1], g[2]
        grads.append(g)
    dq = torch.cat([g[0] for g in grads], dim=1)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for (_, _, j0, j1), (_, gk, gv) in zip(chunks, grads, strict=True):
        dk[:, j0:j1] += gk  # a GQA group split over calls adds up here, in fp32
        dv[:, j0:j1] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------
# exact pure-torch fallback, per document and query chunk
# --------------------------------------------------------------------------------------------


def _math_scores(
    qc: Tensor, kd: Tensor, row0: int, causal: bool, scale: float, acc: torch.dtype
) -> Tensor:
    """Masked scores [Hkv, G, C, Lk] of query chunk qc [C, Hq, D] (rows row0..) over kd."""
    c, hq, d = qc.shape
    lk, hkv, _ = kd.shape
    qg = qc.to(acc).reshape(c, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, C, D]
    kt = kd.to(acc).permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, Lk]
    s = torch.matmul(qg, kt) * scale
    if causal:
        shift = 1 if _MUTATION == "causal_off_by_one" else 0
        rows = torch.arange(row0, row0 + c, device=qc.device).unsqueeze(1)
        cols = torch.arange(lk, device=qc.device).unsqueeze(0)
        s = s.masked_fill(cols > rows + shift, _NEG_INF)
    return s


def _math_forward(
    q: Tensor, k: Tensor, v: Tensor, seg: _Segments, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    acc = _lse_dtype(q.dtype)
    tq, hq, d = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((hq, tq), _empty_row_lse(), dtype=acc, device=q.device)
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


def _math_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    seg: _Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    acc = _lse_dtype(q.dtype)
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
            ld = ld.masked_fill(ld == _NEG_INF, float("inf"))
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
