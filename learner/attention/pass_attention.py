"""Branch attention for ONE TTT pass, as one autograd Function.

TTT passes are sequential (pass d reads pass d-1's output), so the trainer calls this once per
pass with the query of pass d and the keys/values of passes 1..d (0-based here: ``ks[0]`` is the
trunk, ``ks[1:]`` the branch). The query at anchor i sees ``ks[0]`` at positions 0..i of its
document (one causal :func:`~learner.attention.block.block_forward` call) and ``ks[1:]`` at
position i only (a ``[T, Hq, d-1]`` score tensor). Both merge exactly by log-sum-exp and the
backward replays both with the joint output and lse, so the gradient through the lse survives.
The K passes together cost K trunk calls: the floor, since every pass attends to the whole trunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from learner.attention.block import Backend, block_backward, block_forward, merge_lse


def _expand(x: Tensor, rep: int) -> Tensor:
    """[B, T, Hkv, D] -> [B, T, Hkv*rep, D] (GQA: query head h uses kv head h // rep)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=2)


def _reduce(x: Tensor, rep: int) -> Tensor:
    """Inverse of _expand for gradients: sum over the query heads of each kv head."""
    if rep == 1:
        return x
    b, t, hq, d = x.shape
    return x.view(b, t, hq // rep, rep, d).sum(3)


def _branch_kv(ks: Sequence[Tensor], vs: Sequence[Tensor], rep: int, acc: torch.dtype):
    """The branch keys/values (passes 1..d-1, 0-based) stacked: [d-1, T, Hq, D] each."""
    return _expand(torch.stack(ks[1:]), rep).to(acc), _expand(torch.stack(vs[1:]), rep).to(acc)


class PassAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, backend, *kvs):  # type: ignore[override]
        n = len(kvs) // 2
        ks, vs = kvs[:n], kvs[n:]
        rep = q.shape[1] // ks[0].shape[1]
        out_a, lse_a = block_forward(
            q, ks[0], vs[0], cu_seqlens, cu_seqlens, causal=True, scale=scale, backend=backend
        )
        if n == 1:
            out, lse = out_a, lse_a.transpose(0, 1)
        else:
            acc = torch.promote_types(q.dtype, torch.float32)
            kb, vb = _branch_kv(ks, vs, rep, acc)  # [n-1, T, Hq, D]
            s = torch.einsum("thd,bthd->thb", q.to(acc), kb) * scale  # [T, Hq, n-1]
            lse_b = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse_b.unsqueeze(-1))
            out_b = torch.einsum("thb,bthd->thd", p, vb)
            out, lse = merge_lse(out_a.to(acc), lse_a.transpose(0, 1).to(acc), out_b, lse_b)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, *ks, *vs)
        ctx.n, ctx.rep, ctx.scale, ctx.backend = n, rep, scale, backend
        ctx.cu_seqlens = cu_seqlens
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, out, lse, *kvs = ctx.saved_tensors
        n, rep, scale = ctx.n, ctx.rep, ctx.scale
        ks, vs = kvs[:n], kvs[n:]
        dout = dout.contiguous()
        cu = ctx.cu_seqlens
        dq, dk0, dv0 = block_backward(
            dout, q, ks[0], vs[0], out, lse.transpose(0, 1), cu, cu,
            causal=True, scale=scale, backend=ctx.backend,
        )  # fmt: skip
        dks, dvs = [dk0], [dv0]
        if n > 1:
            acc = torch.promote_types(q.dtype, torch.float32)
            kb, vb = _branch_kv(ks, vs, rep, acc)
            qa, da = q.to(acc), dout.to(acc)
            s = torch.einsum("thd,bthd->thb", qa, kb) * scale
            p = torch.exp(s - lse.to(acc).unsqueeze(-1))  # joint lse: this block's share
            dvb = torch.einsum("thb,thd->bthd", p, da)
            dp = torch.einsum("thd,bthd->thb", da, vb)
            delta = (da * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dout * out_joint)
            ds = p * (dp - delta) * scale
            dq = dq.to(acc) + torch.einsum("thb,bthd->thd", ds, kb)
            dkb = torch.einsum("thb,thd->bthd", ds, qa)
            dkb, dvb = _reduce(dkb, rep), _reduce(dvb, rep)
            dks += [dkb[i].to(q.dtype) for i in range(n - 1)]
            dvs += [dvb[i].to(q.dtype) for i in range(n - 1)]
        return (dq.to(q.dtype), None, None, None, *dks, *dvs)


def pass_attention(
    q: Tensor,
    ks: Sequence[Tensor],
    vs: Sequence[Tensor],
    cu_seqlens: Tensor,
    scale: float | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Attention of pass d's queries q [T, Hq, D] over the trunk ks[0]/vs[0] (causal within the
    documents of cu_seqlens) and the branch ks[1:]/vs[1:] (own anchor only); -> [T, Hq, D]."""
    if len(ks) != len(vs) or not ks:
        raise ValueError(f"expected equal, non-empty key and value lists, got {len(ks)}/{len(vs)}")
    if q.shape[1] % ks[0].shape[1]:
        raise ValueError(
            f"query heads {q.shape[1]} must be a multiple of kv heads {ks[0].shape[1]}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return PassAttentionFn.apply(q, cu_seqlens, scale, backend, *ks, *vs)
