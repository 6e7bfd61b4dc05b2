"""Block-drafter (DFlash) attention against the dense fp64 reference, values and gradients.

The reference (`dense_block_draft_attention`) states the mask by positions: the query at
position a + s of the block anchored at a sees the context before a and its whole block. The
product folds that into rows and slots; a planted bug in either half must show.
"""

from __future__ import annotations

import pytest
import torch
from planted_bugs import plant

from codraft.learner.attention import block_draft
from codraft.learner.attention.block_draft import block_draft_attention
from codraft.learner.attention.reference import dense_block_draft_attention

PACKINGS = [[1, 5, 17, 3], [9], [2, 2, 11]]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _errors(
    slots: int,
    lengths: list[int],
    dtype: torch.dtype,
    heads: tuple[int, int] = (4, 2),
    backend: str = "cpu_flash",
    seed: int = 0,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    t, (hq, hkv), d = sum(lengths), heads, 8
    cu = _cu(lengths)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    inputs = [rnd(slots, t, hq, d), rnd(t, hkv, d), rnd(t, hkv, d)]
    inputs += [rnd(slots, t, hkv, d), rnd(slots, t, hkv, d)]
    dout = rnd(slots, t, hq, d)
    got_in = [x.clone().requires_grad_() for x in inputs]
    ref_in = [x.double().clone().requires_grad_() for x in inputs]
    got = block_draft_attention(*got_in, cu, backend=backend)
    ref = dense_block_draft_attention(*ref_in, cu)
    got.backward(dout)
    ref.backward(dout.double())
    names = ("dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")
    errs = {"out": float((got.detach().double() - ref.detach()).abs().max())}
    for name, a, b in zip(names, got_in, ref_in, strict=True):
        errs[name] = float((a.grad.double() - b.grad).abs().max())
    return errs


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lengths", PACKINGS, ids=["4docs", "1doc", "3docs"])
@pytest.mark.parametrize("slots", [1, 4])
def test_block_draft_attention_matches_dense(backend, dtype, lengths, slots):
    errs = _errors(slots, lengths, dtype, backend=backend)
    assert max(errs.values()) < TOL[dtype], errs


def test_block_draft_attention_gqa_and_mha():
    for heads in ((6, 3), (3, 3), (4, 1)):
        errs = _errors(3, PACKINGS[0], torch.float64, heads=heads)
        assert max(errs.values()) < TOL[torch.float64], (heads, errs)


def test_block_draft_attention_shape_errors():
    q = torch.zeros(2, 5, 4, 8)
    kc, kb = torch.zeros(5, 2, 8), torch.zeros(2, 5, 2, 8)
    cu = _cu([5])
    with pytest.raises(ValueError, match="k_blk/v_blk"):
        block_draft_attention(q, kc, kc, kb[:1], kb[:1], cu)
    with pytest.raises(ValueError, match="expected q"):
        block_draft_attention(q[0], kc, kc, kb, kb, cu)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        block_draft_attention(q[:, :, :3], kc, kc, kb, kb, cu)


# --------------------------------------------------------------------------------------------
# planted bugs, installed from the test side
# --------------------------------------------------------------------------------------------


def _block_causal(mp: pytest.MonkeyPatch) -> None:
    """The block made causal: slot s sees slots 0..s of its row only (DFlash's block is not)."""
    scores = block_draft._block_scores

    def causal_scores(q, kb, scale):
        s = scores(q, kb, scale)
        n = s.shape[0]
        later = torch.arange(n).view(n, 1, 1, 1, 1) < torch.arange(n).view(1, 1, 1, 1, n)
        return s.masked_fill(later, float("-inf"))

    mp.setattr(block_draft, "_block_scores", causal_scores)


def _own_lse_replay(mp: pytest.MonkeyPatch) -> None:
    """The branch's backward replayed with its own lse instead of the joint one."""
    backward = block_draft._block_backward

    def own(dout, q, kb, vb, out, lse, scale):
        own_out, own_lse = block_draft._block_forward(q, kb, vb, scale)
        return backward(dout, q, kb, vb, own_out, own_lse, scale)

    mp.setattr(block_draft, "_block_backward", own)


@pytest.mark.parametrize("bug", ["causal_off_by_one", "block_causal", "own_lse_replay"])
def test_planted_bug_is_caught(bug, monkeypatch):
    run = lambda: _errors(4, PACKINGS[0], torch.float64, seed=3)  # noqa: E731
    assert max(run().values()) < TOL[torch.float64]
    if bug == "block_causal":
        _block_causal(monkeypatch)
    elif bug == "own_lse_replay":
        _own_lse_replay(monkeypatch)
    else:
        plant(bug, monkeypatch)
    errs = run()
    assert max(errs.values()) > 1e-3, errs
    if bug == "own_lse_replay":  # forward untouched, only gradients move
        assert errs["out"] < TOL[torch.float64], errs
