"""The chunked logits + cross-entropy against plain autograd over the whole logits, in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codraft.learner import chunked_loss
from codraft.learner.chunked_loss import cross_entropy


def reference(h, w, t, hard):
    logp = F.log_softmax(h @ w.t(), dim=-1)
    if hard:
        return F.nll_loss(logp, t, reduction="sum"), (logp.argmax(-1) == t).sum()
    return -(t.softmax(-1) * logp).sum(), (logp.argmax(-1) == t.argmax(-1)).sum()


def case(hard: bool, rows: int = 11, dim: int = 6, vocab: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, dim, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, dim, generator=g, dtype=torch.float64, requires_grad=True)
    if hard:
        t = torch.randint(0, vocab, (rows,), generator=g)
    else:  # the teacher's logits over the draft vocab
        t = 2 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    return h, w, t


def grads(fn, h, w, t):
    loss, correct = fn(h, w, t)
    gh, gw = torch.autograd.grad(loss * 0.7, (h, w))  # a scale from above reaches both grads
    return loss.detach(), int(correct), gh, gw


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 11, 64])
def test_values_and_gradients_equal_the_whole_logits(hard: bool, chunk: int) -> None:
    h, w, t = case(hard)
    want = grads(lambda *a: reference(*a, hard), h, w, t)
    got = grads(lambda *a: cross_entropy(*a, hard=hard, chunk=chunk, acc=torch.float64), h, w, t)
    assert got[1] == want[1]
    for a, b in zip((got[0], got[2], got[3]), (want[0], want[2], want[3]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_under_bf16_autocast_matches_linear_under_autocast() -> None:
    h, w, t = (x.float() if x.is_floating_point() else x for x in case(False, rows=40, dim=16))
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = grads(lambda h, w, t: reference_autocast(h, w, t), h, w, t)
        got = grads(lambda *a: cross_entropy(*a, hard=False, chunk=7, acc=torch.float32), h, w, t)
    assert got[3].dtype == torch.float32  # the weight's gradient in the weight's dtype
    for a, b in zip((got[0], got[2], got[3]), (want[0], want[2], want[3]), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def reference_autocast(h, w, t):
    logp = F.log_softmax(F.linear(h, w).float(), dim=-1)
    return -(t.float().softmax(-1) * logp).sum(), (logp.argmax(-1) == t.argmax(-1)).sum()


def test_a_wrong_logit_gradient_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted from here: a sign error in the logits' gradient, and the teacher's logits taken
    for its probabilities; the comparison above must fail for both."""
    h, w, t = case(False)
    want = grads(lambda *a: reference(*a, False), h, w, t)

    def flipped(z, t, hard):
        return -torch.softmax(z, -1) * t.sum(-1, keepdim=True) + t

    monkeypatch.setattr(chunked_loss, "chunk_logit_grad", flipped)
    got = grads(lambda *a: cross_entropy(*a, hard=False, chunk=4, acc=torch.float64), h, w, t)
    assert not torch.allclose(got[2], want[2], rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    monkeypatch.setattr(chunked_loss, "soft_targets", lambda t, dtype: t.to(dtype))
    got = grads(lambda *a: cross_entropy(*a, hard=False, chunk=4, acc=torch.float64), h, w, t)
    assert not torch.allclose(got[2], want[2], rtol=1e-6, atol=1e-6)


def test_chunk_must_be_positive() -> None:
    h, w, t = case(True)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        cross_entropy(h, w, t, hard=True, chunk=0, acc=torch.float64)
