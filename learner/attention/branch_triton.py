"""The branch rows of one TTT pass as two Triton kernels: forward merge and backward.

Same arithmetic as :func:`codraft.learner.attention.ring_branch.merge_rows` / ``grad_rows`` (which
stay the reference and the CPU path), written so that every tensor is read once and nothing of
size ``[T, Hq, D]`` is materialised besides the outputs:

* one program per (block of ``BT`` tokens, kv head) holds the whole GQA group of query heads as
  a ``[BT, G, D]`` tile, so each branch key/value row is read once for its ``G`` query heads and
  ``dk``/``dv`` are summed over the group in registers (no atomics);
* forward: online softmax over the trunk's ``(out, lse)`` and the ``NB`` branch keys, written
  back as the joint ``(out, lse)`` (in place when the caller passes the same tensors);
* backward against the JOINT ``(out, lse)``: ``delta = rowsum(dout * out)``, then per branch key
  ``p = exp(s - lse)``, ``ds = p * (dout . v - delta) * scale``; ``dq`` (the trunk's, from the
  flash backward) is read, the branch's share added in fp32 and rounded once.

Up to :data:`MAX_BRANCH` branch keys (K <= 8 passes). Branch keys/values come as separate
tensors of one shape and layout; they are passed as separate pointers and picked at compile
time (the kernels live in :mod:`codraft.learner.attention.branch_triton_kernels`).
``TRITON_INTERPRET=1`` runs the kernels on CPU tensors (what the tests do).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Sequence

import torch
from torch import Tensor

MAX_BRANCH = 7


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(q: Tensor, n_branch: int) -> bool:
    """Whether these kernels can take this call: triton importable, a CUDA tensor (or CPU under
    ``TRITON_INTERPRET=1``), fp16/bf16/fp32 with a unit head-dim stride, and at most
    :data:`MAX_BRANCH` branch keys."""
    if not 1 <= n_branch <= MAX_BRANCH or not _have_triton():
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.stride(-1) != 1:
        return False
    return q.is_cuda or (interpreted() and q.device.type == "cpu")


def _tile(g: int, d: int) -> tuple[int, int, int, int]:
    """(BT, BG, BD, num_warps): a [BT, BG, BD] fp32 tile of about 4K elements per tensor."""
    bg = 1 << (g - 1).bit_length()
    bd = 1 << (d - 1).bit_length()
    bt = int(os.environ.get("CODRAFT_BRANCH_BT", "0")) or max(1, 4096 // (bg * bd))
    warps = int(os.environ.get("CODRAFT_BRANCH_WARPS", "4"))
    return bt, bg, bd, warps


def _check(q: Tensor, kb: Sequence[Tensor], vb: Sequence[Tensor]) -> tuple[int, int, int]:
    t, hq, d = q.shape
    hkv = kb[0].shape[1]
    shape = (t, hkv, d)
    for x in (*kb, *vb):
        if tuple(x.shape) != shape or x.stride() != kb[0].stride() or x.stride(-1) != 1:
            raise ValueError(
                f"branch keys/values must all be {list(shape)} with one layout and unit stride "
                f"in the head dim; got {list(x.shape)} strides {x.stride()} (call .contiguous())"
            )
    if q.stride(-1) != 1:
        raise ValueError("q must have unit stride in the head dim (call .contiguous())")
    return t, hq // hkv, hkv


def _padded(xs: Sequence[Tensor]) -> list[Tensor]:
    return list(xs) + [xs[0]] * (MAX_BRANCH - len(xs))


def merge(
    out_a: Tensor,
    lse_a: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    scale: float,
    out: Tensor | None = None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The trunk's ``(out_a [T, Hq, D], lse_a [T, Hq])`` merged with the branch: ``out`` (q's
    dtype unless given) and ``lse`` (fp32 unless given). ``out``/``lse`` may be ``out_a``/
    ``lse_a`` themselves (in place); any strides with a unit head-dim stride."""
    t, g, hkv = _check(q, kb, vb)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse is None else lse
    if t == 0:
        return out, lse
    from codraft.learner.attention.branch_triton_kernels import merge_kernel

    bt, bg, bd, warps = _tile(g, q.shape[2])
    merge_kernel[(-(-t // bt), hkv)](
        q, out_a, lse_a, out, lse, *_padded(kb), *_padded(vb), t, scale,
        q.stride(0), q.stride(1), out_a.stride(0), out_a.stride(1),
        lse_a.stride(0), lse_a.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1), kb[0].stride(0), kb[0].stride(1),
        G=g, D=q.shape[2], NB=len(kb), BT=bt, BG=bg, BD=bd, num_warps=warps,
    )  # fmt: skip
    return out, lse


def grad(
    dq: Tensor,
    dout: Tensor,
    q: Tensor,
    kb: Sequence[Tensor],
    vb: Sequence[Tensor],
    out: Tensor,
    lse: Tensor,
    scale: float,
) -> tuple[list[Tensor], list[Tensor]]:
    """The branch's gradients against the JOINT ``out``/``lse`` (``[T, Hq]``, fp32): ``dq`` gets
    the branch's share added in place; returns ``(dk list, dv list)`` in the dtype of ``kb[0]``."""
    t, g, hkv = _check(q, kb, vb)
    dks = [torch.empty_like(kb[0]) for _ in kb]
    dvs = [torch.empty_like(kb[0]) for _ in vb]  # one layout: kb[0]'s strides
    if t == 0:
        return dks, dvs
    for x, name in ((dq, "dq"), (dout, "dout"), (out, "out")):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in the head dim")
    from codraft.learner.attention.branch_triton_kernels import grad_kernel

    bt, bg, bd, warps = _tile(g, q.shape[2])
    grad_kernel[(-(-t // bt), hkv)](
        dq, dout, q, out, lse, *_padded(kb), *_padded(vb), *_padded(dks), *_padded(dvs),
        t, scale,
        dq.stride(0), dq.stride(1), dout.stride(0), dout.stride(1), q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        kb[0].stride(0), kb[0].stride(1),
        G=g, D=q.shape[2], NB=len(kb), BT=bt, BG=bg, BD=bd, num_warps=warps,
    )  # fmt: skip
    return dks, dvs
