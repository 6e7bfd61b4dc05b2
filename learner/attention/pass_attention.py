"""Branch attention for ONE TTT pass, as one autograd Function.

TTT passes are sequential (pass d reads pass d-1's output), so the trainer calls this once per
pass with the query of pass d and the keys/values of passes 1..d (0-based here: ``ks[0]`` is the
trunk, ``ks[1:]`` the branch). The query at anchor i sees ``ks[0]`` at positions 0..i of its
document (one causal :func:`~learner.attention.block.block_forward` call) and ``ks[1:]`` at
position i only (``d-1`` scores per query head). Both merge exactly by log-sum-exp and the
backward replays both with the joint output and lse, so the gradient through the lse survives.
The K passes together cost K trunk calls: the floor, since every pass attends to the whole trunk.

The branch is computed one branch pass at a time on grouped views (query heads as
``[Hkv, G]``), in fp32, without expanding keys/values to the query heads: its temporaries are a
few ``[T, Hq, D]`` tensors whatever d is, and it saves nothing beyond the joint out and lse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from learner.attention.block import Backend, block_backward, block_forward, merge_lse


def _branch_keys(ks: Sequence[Tensor], vs: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """The branch keys/values: passes 1..d-1 (0-based), each [T, Hkv, D]."""
    return list(ks[1:]), list(vs[1:])


def _grouped(x: Tensor, hkv: int, acc: torch.dtype) -> Tensor:
    """[T, Hq, D] -> [T, Hkv, G, D] in the accumulation dtype (GQA: head h uses kv h // G)."""
    t, hq, d = x.shape
    return x.to(acc).view(t, hkv, hq // hkv, d)


def _scores(qg: Tensor, kb: Sequence[Tensor], scale: float) -> Tensor:
    """Branch scores [T, Hkv, G, n]: query i against its own anchor's key in each branch pass."""
    return torch.stack([(qg * k.to(qg.dtype).unsqueeze(2)).sum(-1) for k in kb], -1) * scale


class PassAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cu_seqlens, scale, backend, *kvs):  # type: ignore[override]
        n = len(kvs) // 2
        ks, vs = kvs[:n], kvs[n:]
        hkv = ks[0].shape[1]
        out_a, lse_a = block_forward(
            q, ks[0], vs[0], cu_seqlens, cu_seqlens, causal=True, scale=scale, backend=backend
        )
        kb, vb = _branch_keys(ks, vs)
        if not kb:
            out, lse = out_a, lse_a.transpose(0, 1)
        else:
            acc = torch.promote_types(q.dtype, torch.float32)
            qg = _grouped(q, hkv, acc)
            s = _scores(qg, kb, scale)  # [T, Hkv, G, n-1]
            lse_b = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse_b.unsqueeze(-1))
            out_b = torch.zeros_like(qg)
            for j, v in enumerate(vb):
                out_b += p[..., j, None] * v.to(acc).unsqueeze(2)
            t, hq, d = q.shape
            out, lse = merge_lse(
                out_a.to(acc),
                lse_a.transpose(0, 1).to(acc),
                out_b.view(t, hq, d),
                lse_b.view(t, hq),
            )
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, *ks, *vs)
        ctx.n, ctx.scale, ctx.backend = n, scale, backend
        ctx.cu_seqlens = cu_seqlens
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, out, lse, *kvs = ctx.saved_tensors
        n, scale = ctx.n, ctx.scale
        ks, vs = kvs[:n], kvs[n:]
        dout = dout.contiguous()
        cu = ctx.cu_seqlens
        dq, dk0, dv0 = block_backward(
            dout, q, ks[0], vs[0], out, lse.transpose(0, 1), cu, cu,
            causal=True, scale=scale, backend=ctx.backend,
        )  # fmt: skip
        kb, vb = _branch_keys(ks, vs)
        if not kb:
            return (dq, None, None, None, dk0, dv0)
        acc = torch.promote_types(q.dtype, torch.float32)
        t, hq, d = q.shape
        hkv = ks[0].shape[1]
        qg, dg = _grouped(q, hkv, acc), _grouped(dout, hkv, acc)
        delta = (dg * _grouped(out, hkv, acc)).sum(-1)  # rowsum(dout * out_joint) [T, Hkv, G]
        lse_g = lse.to(acc).view(t, hkv, hq // hkv)
        dqg = _grouped(dq, hkv, acc).clone()
        dks, dvs = [dk0], [dv0]
        for k, v in zip(kb, vb, strict=True):
            kf, vf = k.to(acc).unsqueeze(2), v.to(acc).unsqueeze(2)
            p = torch.exp((qg * kf).sum(-1) * scale - lse_g)  # this block's share of the joint
            dvs.append((p.unsqueeze(-1) * dg).sum(2).to(v.dtype))
            ds = p * ((dg * vf).sum(-1) - delta) * scale
            dqg += ds.unsqueeze(-1) * kf
            dks.append((ds.unsqueeze(-1) * qg).sum(2).to(k.dtype))
        return (dqg.view(t, hq, d).to(q.dtype), None, None, None, *dks, *dvs)


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
