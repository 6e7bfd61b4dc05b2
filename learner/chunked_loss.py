"""The draft's logits and cross-entropy, a chunk of tokens at a time.

A TTT pass's loss needs the draft-vocab logits of every valid anchor, [R, Vd], and autograd
would keep them (with their fp32 log-softmax) for backward, K times a step: at 16K tokens and a
32K draft vocab that is most of the step's memory. `cross_entropy` computes lm_head, the
log-softmax and the loss `chunk` rows at a time inside one autograd Function that keeps only
its inputs (the normed hidden states, cast once to the matmuls' dtype, lm_head's weight, the
targets: with `index`, the rows of a targets tensor the caller holds anyway, so no copy of
them); backward computes each chunk's logits again and from them the gradients of the hidden
states and of the weight:

    d/dz [ -sum_v t_v log softmax(z)_v ] = softmax(z) * sum_v t_v - t

(t the one-hot of a label, or soft targets). Soft targets come as the teacher's logits over
the draft vocab, in the teacher's dtype, and t = softmax of them is taken here a chunk at a
time, in the loss's dtype: the step never holds the teacher's probabilities, [N, Vd] fp32
(4 Vd bytes a token; the bf16 logits are 2 Vd). Under autocast the matmuls run in autocast's
dtype as `nn.Linear` would, the softmaxes and the loss in fp32 (fp64 when the inputs are fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(h: Tensor) -> torch.dtype:
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return h.dtype


def soft_targets(teacher_logits: Tensor, dtype: torch.dtype) -> Tensor:
    """One chunk's teacher probabilities [c, V] in `dtype` from its logits [c, V]."""
    return torch.softmax(teacher_logits.to(dtype), dim=-1)


def chunk_logit_grad(z: Tensor, t: Tensor, hard: bool) -> Tensor:
    """d loss / d z for one chunk: z [c, V] logits (accumulation dtype), t [c, V] soft targets
    (probabilities in z's dtype) or [c] labels."""
    p = torch.softmax(z, dim=-1)
    if hard:
        return p.scatter_add(1, t[:, None], torch.full_like(p[:, :1], -1.0))
    return p * t.sum(-1, keepdim=True) - t


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, index, hard, chunk, acc):  # type: ignore[override]
        cd = _compute_dtype(h)
        w = weight.to(cd)
        ce = torch.zeros((), dtype=acc, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        ctx.h_dtype = h.dtype
        h = h.to(cd)  # the matmuls read it in cd: kept so (under autocast bf16, not fp32)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                z = F.linear(h[s : s + chunk], w).to(acc)
                logp = F.log_softmax(z, dim=-1)
                t = _rows(targets, index, s, chunk)
                if hard:
                    ce -= logp.gather(1, t[:, None]).sum()
                    correct += (z.argmax(-1) == t).sum()
                else:
                    ce -= (soft_targets(t, acc) * logp).sum()
                    correct += (z.argmax(-1) == t.argmax(-1)).sum()
        ctx.save_for_backward(h, weight, targets, index)
        ctx.hard, ctx.chunk, ctx.acc, ctx.cd = hard, chunk, acc, cd
        ctx.mark_non_differentiable(correct)
        return ce, correct

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct):  # type: ignore[override]
        h, weight, targets, index = ctx.saved_tensors
        cd, acc, chunk = ctx.cd, ctx.acc, ctx.chunk
        w = weight.to(cd)
        gh = torch.empty_like(h, dtype=ctx.h_dtype) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk):
                hc = h[s : s + chunk]
                z = F.linear(hc, w).to(acc)
                t = _rows(targets, index, s, chunk)
                if not ctx.hard:
                    t = soft_targets(t, acc)
                g = (chunk_logit_grad(z, t, ctx.hard) * grad_ce).to(cd)
                if gh is not None:
                    gh[s : s + chunk] = (g @ w).to(gh.dtype)
                if gw is not None:
                    gw += (g.t() @ hc).to(acc)
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None, None, None


def _rows(targets: Tensor, index: Tensor | None, start: int, chunk: int) -> Tensor:
    if index is None:
        return targets[start : start + chunk]
    return targets[index[start : start + chunk]]


def cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    hard: bool,
    chunk: int,
    acc: torch.dtype,
    index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(sum over rows of the cross-entropy of softmax(h @ weight.T) against `targets`, the
    number of rows whose argmax matches the target's), `chunk` rows at a time. h [R, D] (the
    normed hidden states of the rows that count), weight [V, D], targets [R, V] teacher logits
    (the soft target is their softmax, taken here) or [R] labels (`hard`) - or, with `index`
    [R], targets[index] (targets [N, V] or [N], read a chunk at a time, never copied whole);
    acc is the dtype of the softmaxes and the loss."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 row, got {chunk}")
    rows = h.shape[0] if index is None else index.shape[0]
    if rows != h.shape[0] or (index is None and targets.shape[0] != h.shape[0]):
        raise ValueError(
            f"h has {h.shape[0]} rows, targets {targets.shape[0]}, index "
            f"{None if index is None else index.shape[0]}: expected one target per row"
        )
    return _ChunkedCE.apply(h, weight, targets, index, hard, chunk, acc)
