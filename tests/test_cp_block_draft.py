"""Block-drafter (DFlash) attention under context parallelism, on real gloo groups of 2 and 4
ranks, against the dense fp64 reference of the whole batch (the single-process computation):
output and the gradients of q, the context and the block keys/values. Planted bugs (the ring's
halves swapped; the block seeing only the slot's own key) must fail."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist
from gloo import max_over_ranks
from planted_bugs import planted

from codraft.learner.attention import ring_block_draft
from codraft.learner.attention.reference import dense_block_draft_attention
from codraft.learner.attention.ring_block_draft import ring_block_draft_attention
from codraft.learner.parallel.ring_comm import Ring
from codraft.learner.parallel.zigzag import shard, zigzag_layout

WORLDS = (2, 4)
LAYOUTS = {"single": [16], "min": [2], "packed": [2, 6, 2, 10, 4]}  # x cp tokens each
S, HQ, HKV, HD = 3, 4, 2, 8
TOL = {"fp64": 1e-10, "fp32": 1e-4}


def _error(ring: Ring, lengths: list[int], dtype: torch.dtype) -> float:
    cp = ring.size
    cu = torch.tensor([0, *torch.tensor(lengths).mul(cp).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    g = torch.Generator().manual_seed(3)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    full = [rnd(S, n, HQ, HD), rnd(n, HKV, HD), rnd(n, HKV, HD), rnd(S, n, HKV, HD)]
    full.append(rnd(S, n, HKV, HD))
    dout = rnd(S, n, HQ, HD)
    ref_in = [x.to(dtype).double().requires_grad_() for x in full]
    ref = dense_block_draft_attention(*ref_in, cu)
    g_ref = torch.autograd.grad(ref, ref_in, dout)

    lay = zigzag_layout(cu, cp, ring.rank)

    def local(x: torch.Tensor) -> torch.Tensor:  # rows are dim 1 for [S, T, ...] tensors
        return shard(x, lay) if x.dim() == 3 else shard(x.transpose(0, 1), lay).transpose(0, 1)

    loc = [local(x).to(dtype).contiguous().requires_grad_() for x in full]
    out = ring_block_draft_attention(*loc, lay, ring)
    grads = torch.autograd.grad(out, loc, local(dout).to(dtype).contiguous())
    errs = [(out.detach().double() - local(ref.detach())).abs().max()]
    errs += [(a.double() - local(b)).abs().max() for a, b in zip(grads, g_ref, strict=True)]
    return max(float(e) for e in errs)


def _own_slot_only(mp_: pytest.MonkeyPatch) -> None:
    merge = ring_block_draft.branch_merge_into
    slot = iter(range(10**6))

    def own(out, lse, q, kb, vb, scale):
        s = next(slot) % len(kb)
        merge(out, lse, q, kb[s : s + 1], vb[s : s + 1], scale)

    mp_.setattr(ring_block_draft, "branch_merge_into", own)


def _cases(rank: int, world: int) -> dict[str, float]:
    ring = Ring.of(dist.group.WORLD)
    res = {}
    for name, lengths in LAYOUTS.items():
        for dt, dtype in (("fp64", torch.float64), ("fp32", torch.float32)):
            res[f"{name}/{dt}"] = _error(ring, lengths, dtype)
    with planted("wrong_half"):
        res["mut/wrong_half"] = _error(ring, LAYOUTS["packed"], torch.float64)
    with pytest.MonkeyPatch.context() as m:
        _own_slot_only(m)
        res["mut/own_slot_only"] = _error(ring, LAYOUTS["packed"], torch.float64)
    return res


@cache
def _run(world: int) -> dict[str, float]:
    return max_over_ranks(_cases, world)


CASES = [f"{name}/{dt}" for name in LAYOUTS for dt in TOL]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_dense_single_process_result(world: int, case: str) -> None:
    err = _run(world)[case]
    assert err < TOL[case.split("/")[1]], f"{case} at cp={world}: max error {err:.3g}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bug", ["wrong_half", "own_slot_only"])
def test_planted_bugs_are_caught(world: int, bug: str) -> None:
    assert _run(world)[f"mut/{bug}"] > 1e-3


def test_a_ring_of_one_is_the_single_device_attention() -> None:
    for lengths in LAYOUTS.values():
        assert _error(Ring.of(None), lengths, torch.float64) < TOL["fp64"]
