"""The ``"cuda_flash"`` backend of :mod:`codraft.learner.attention.block`: flash attention in varlen
mode.

``aten._flash_attention_forward`` / ``_flash_attention_backward`` in varlen mode
(``cum_seq_q``/``cum_seq_k``), fp16/bf16 only, head dim a multiple of 8 and at most 256. Inputs are
validated by :mod:`codraft.learner.attention.block`; layouts are the ones documented there. CI has
no GPU: the CUDA tests skip there; run them on a GPU.

Kernel traps handled here (found by probing torch 2.11 CUDA):

* a fully masked row comes back from flash with ``lse = +inf`` (the CPU kernel returns 0); rows
  without keys are set to ``out = 0, lse = -inf`` structurally here;
* flash's backward expects a row without keys to carry ``lse = +inf`` (so
  ``P = exp(S - lse) = 0``); :func:`backward` converts ``-inf`` to ``+inf`` before calling it;
* flash's backward (torch 2.11, H200) hits an illegal memory access once tokens x heads x head
  dim of one call passes 2^31 (131072 tokens x 224 heads x 128); calls are split by heads
  (:func:`_flash_head_chunks`) to stay under ``_FLASH_MAX_ELEMENTS``.

Checked on an H200 (torch 2.11+cu130): the CUDA tests in tests/test_branch_attention.py pass,
a fully masked flash row comes back as ``out = 0, lse = +inf``, and varlen lse is ``[Hq, Tq]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from codraft.learner.attention.block_common import NEG_INF, Segments

# Most (rows x heads x rounded head dim) elements in one CUDA flash call; see _flash_head_chunks.
_FLASH_MAX_ELEMENTS = 2**30


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


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    seg: Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one block; rows that see no key get ``out = 0, lse = -inf``."""
    _cuda_check(q)
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
        lse = torch.where(has.unsqueeze(0), lse, torch.full_like(lse, NEG_INF))
        out = torch.where(has[:, None, None], out, torch.zeros_like(out))
    return out, lse


def backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    seg: Segments,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block, replayed against the (joint) ``out`` and ``lse``."""
    _cuda_check(q)
    tq, hq, d = q.shape
    hkv = k.shape[1]
    lse = lse.float()
    lse = lse.masked_fill(lse == NEG_INF, float("inf"))  # flash: a row without keys has +inf
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
