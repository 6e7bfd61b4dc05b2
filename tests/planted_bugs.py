"""Planted bugs for the attention mutation checks, installed from the test side.

Each bug is a function that patches product code through a ``pytest.MonkeyPatch`` (a module's
function replaced by a wrong one, or an autograd Function by a wrong subclass); the product code
itself has no switch for any of them. A mutation check runs its comparison once clean, plants the
bug, and runs it again: the reference must then disagree.

``plant(name, monkeypatch)`` installs one bug; ``planted(name)`` is the same as a context
manager, for code that runs outside a test function (the gloo workers of tests/test_cp.py, which
plant the bug in every spawned rank).

Bugs (the names the tests use):

* ``causal_off_by_one``: causal blocks let query i see key i + 1 of its document too (the
  cpu_flash kernel called with that mask, and the math backend's scores masked that way);
* ``empty_row_lse_zero``: rows with no visible key carry lse 0 instead of -inf (every block
  backend, and the empty branch of pass 0 in ``branch_attention``);
* ``branch_diag_only`` / ``branch_skip_own``: pass p's branch sees only pass p's key / passes
  1..p-1 (its own key missing), in ``branch_attention``;
* ``own_lse_replay``: ``branch_attention``'s backward replays trunk and branch each with its own
  out/lse (the merge done "outside": the gradient through the lse is lost);
* ``wrong_half``: ring steps s <= r use the back half of the arriving shard, forward and backward;
* ``dropped_lse_grad``: the ring's trunk blocks replay without the ``rowsum(dout * out)`` term;
* ``branch_own_lse``: the ring's branch backward replays with its own out/lse, not the joint ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

from codraft.learner.attention import block_cpu, block_cuda, block_math, branch, ring, ring_branch
from codraft.learner.attention.block_common import NEG_INF

# ------------------------------------------------------------------------- block backends


def _one_ahead_mask(n: int, dtype: torch.dtype) -> Tensor:
    """Additive mask [n, n] where query i sees keys 0..i+1."""
    allowed = torch.ones(n, n, dtype=torch.bool).tril(diagonal=1)
    return torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, NEG_INF)


def _causal_off_by_one(mp: pytest.MonkeyPatch) -> None:
    cpu_forward, cpu_backward = block_cpu.kernel_forward, block_cpu.kernel_backward
    math_scores = block_math._math_scores

    def kernel_forward(q, k, v, causal, scale):
        if not causal:
            return cpu_forward(q, k, v, causal, scale)
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        mask = _one_ahead_mask(q.shape[2], q.dtype)
        out, lse = kernel(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse

    def kernel_backward(dout, q, k, v, out, lse, causal, scale):
        if not causal:
            return cpu_backward(dout, q, k, v, out, lse, causal, scale)
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        mask = _one_ahead_mask(q.shape[2], q.dtype)
        dq, dk, dv = kernel(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return dq, dk, dv

    def scores(qc, kd, row0, causal, scale, acc):
        s = math_scores(qc, kd, row0, False, scale, acc)
        if not causal:
            return s
        rows = torch.arange(row0, row0 + qc.shape[0], device=qc.device).unsqueeze(1)
        cols = torch.arange(kd.shape[0], device=qc.device).unsqueeze(0)
        return s.masked_fill(cols > rows + 1, NEG_INF)

    mp.setattr(block_cpu, "kernel_forward", kernel_forward)
    mp.setattr(block_cpu, "kernel_backward", kernel_backward)
    mp.setattr(block_math, "_math_scores", scores)


def _zero_empty_lse(result: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    out, lse = result
    return out, lse.masked_fill(lse == NEG_INF, 0.0)


def _empty_row_lse_zero(mp: pytest.MonkeyPatch) -> None:
    for backend in (block_cpu, block_cuda, block_math):
        real = backend.forward
        mp.setattr(backend, "forward", lambda *a, real=real: _zero_empty_lse(real(*a)))
    pass_forward = branch._branch_pass_forward
    mp.setattr(branch, "_branch_pass_forward", lambda *a: _zero_empty_lse(pass_forward(*a)))


# ------------------------------------------------------------------------- branch attention


class _OwnLseReplay(branch.BranchAttentionFn):
    """BranchAttentionFn whose backward replays the trunk and each pass's branch with their own
    out/lse, each weighted by its share of the merged output: right for the output, wrong for the
    gradient through the lse."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, backend):  # type: ignore[override]
        out_a, lse_a = branch._trunk_forward(q, k, v, cu_seqlens, scale, backend)
        acc = branch._acc(q.dtype)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        outs_b, lses_b = [], []
        for p in range(q.shape[0]):
            out_b, lse_b = branch._branch_pass_forward(q[p], k, v, p, scale)
            out[p], lse[p] = branch.merge_lse(out_a[p], lse_a[p].to(acc), out_b, lse_b)
            outs_b.append(out_b)
            lses_b.append(lse_b)
        out_b, lse_b = torch.stack(outs_b).to(q.dtype), torch.stack(lses_b)
        ctx.opts = (scale, backend)
        ctx.save_for_backward(q, k, v, cu_seqlens, out_a, lse_a, out_b, lse_b, lse)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        scale, backend = ctx.opts
        q, k, v, cu, out_a, lse_a, out_b, lse_b, lse = ctx.saved_tensors
        w_a = torch.exp(lse_a.to(lse.dtype) - lse).unsqueeze(-1)
        w_b = torch.exp(lse_b - lse).unsqueeze(-1)
        dq_a, dk0, dv0 = branch._trunk_backward(
            (dout * w_a).to(q.dtype), q, k, v, out_a, lse_a, cu, scale, backend
        )
        dq = dq_a.to(lse.dtype)
        dk = torch.zeros(k.shape, dtype=lse.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=lse.dtype, device=v.device)
        dk[0], dv[0] = dk0, dv0
        for p in range(q.shape[0]):
            dq_b = branch._branch_pass_backward(
                dout[p] * w_b[p], q[p], k, v, out_b[p], lse_b[p], p, scale, dk, dv
            )
            if dq_b is not None:
                dq[p] += dq_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _own_lse_replay(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(branch, "BranchAttentionFn", _OwnLseReplay)


def _branch_diag_only(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(branch, "_branch_keys", lambda p: range(max(p, 1), p + 1))


def _branch_skip_own(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(branch, "_branch_keys", lambda p: range(1, p))


# ------------------------------------------------------------------------- ring attention


def _wrong_half(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(ring, "_front", lambda lay, x: lay.take_back(x))
    mp.setattr(ring, "_add_front", lambda lay, dst, src: lay.add_back(dst, src))


def _dropped_lse_grad(mp: pytest.MonkeyPatch) -> None:
    real = ring.trunk_backward

    def trunk_backward(dout, q, k, v, out, lse, *rest):
        # delta = rowsum(dout * out) = 0: the lse's share of the gradient is lost
        return real(dout, q, k, v, torch.zeros_like(out), lse, *rest)

    mp.setattr(ring, "trunk_backward", trunk_backward)


def _branch_own_lse(mp: pytest.MonkeyPatch) -> None:
    real = ring.branch_backward_into

    def branch_backward_into(dq, dout, q, kb, vb, out, lse, scale):
        acc = torch.promote_types(q.dtype, torch.float32)
        own_out = torch.zeros(q.shape, dtype=acc, device=q.device)
        own_lse = torch.full(q.shape[:2], NEG_INF, dtype=acc, device=q.device)
        ring_branch.branch_merge_into(own_out, own_lse, q, kb, vb, scale)  # the branch alone
        return real(dq, dout, q, kb, vb, own_out, own_lse, scale)

    mp.setattr(ring, "branch_backward_into", branch_backward_into)


PLANTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "causal_off_by_one": _causal_off_by_one,
    "empty_row_lse_zero": _empty_row_lse_zero,
    "branch_diag_only": _branch_diag_only,
    "branch_skip_own": _branch_skip_own,
    "own_lse_replay": _own_lse_replay,
    "wrong_half": _wrong_half,
    "dropped_lse_grad": _dropped_lse_grad,
    "branch_own_lse": _branch_own_lse,
}


def plant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Install the planted bug `name`; undone with the monkeypatch."""
    PLANTS[name](monkeypatch)


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """The planted bug `name` while the block runs."""
    with pytest.MonkeyPatch.context() as mp:
        plant(name, mp)
        yield
