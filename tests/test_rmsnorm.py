"""RMSNorm's own backward (codraft.models.layers: one autograd Function that keeps the input and
1/rms) against autograd through the plain formula in fp64, and its forward bit for bit against
the plain formula in the input's dtype (transformers' Llama numerics: normed in fp32, cast back,
then scaled)."""

from __future__ import annotations

import pytest
import torch

from codraft.models import layers
from codraft.models.layers import RMSNorm

EPS = 1e-5


def plain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(4, 7, 32, generator=g, dtype=torch.float64)).to(dtype)
    w = 1 + torch.randn(32, generator=g, dtype=torch.float64)
    up = torch.randn(4, 7, 32, generator=g, dtype=torch.float64)
    return x, w, up


def grads(fn, x, w, up, x_grad: bool, dtype: torch.dtype):
    x = x.clone().requires_grad_(x_grad)
    w = w.to(torch.float64 if dtype == torch.float64 else torch.float32).clone().requires_grad_()
    out = fn(x, w)
    (out * up.to(out.dtype)).sum().backward()
    return out.detach(), x.grad, w.grad


def ours_grads(x, w, up, x_grad: bool, dtype: torch.dtype):
    norm = RMSNorm(w.shape[0], EPS).to(torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.no_grad():
        norm.weight.copy_(w)
    xx = x.clone().requires_grad_(x_grad)
    out = norm(xx)
    (out * up.to(out.dtype)).sum().backward()
    return out.detach(), xx.grad, norm.weight.grad


@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_is_the_plain_formula_and_gradients_match_fp64(
    dtype: torch.dtype, x_grad: bool
) -> None:
    x, w, up = case(dtype)
    out, gx, gw = ours_grads(x, w, up, x_grad, dtype)
    want = grads(plain, x, w, up, x_grad, dtype)
    assert out.dtype == want[0].dtype and torch.equal(out, want[0])
    ref = grads(plain, x.double(), w, up, x_grad, torch.float64)  # the fp64 truth
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert float((gw.double() - ref[2]).norm() / ref[2].norm()) < tol
    if x_grad:
        err = float((gx.double() - ref[1]).norm() / ref[1].norm())
        assert err < tol, err
        # no worse than autograd through the plain formula in the same dtype
        assert err <= float((want[1].double() - ref[1]).norm() / ref[1].norm()) * 1.05 + 1e-15
    else:
        assert gx is None


def test_a_wrong_backward_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted from here: the normalisation's own derivative (the mean term) left out."""
    x, w, up = case(torch.float64)
    ref = grads(plain, x, w, up, True, torch.float64)

    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        return (g * weight * rstd).to(x.dtype), (g * x * rstd).sum((0, 1)), None

    monkeypatch.setattr(layers._RMSNorm, "backward", staticmethod(backward))
    _, gx, _ = ours_grads(x, w, up, True, torch.float64)
    assert not torch.allclose(gx, ref[1], rtol=1e-6, atol=1e-6)


def test_without_grad_it_keeps_nothing_and_gives_the_same_values() -> None:
    x, w, _ = case(torch.bfloat16)
    norm = RMSNorm(32, EPS)
    with torch.no_grad():
        norm.weight.copy_(w)
        out = norm(x)
    assert out.grad_fn is None and torch.equal(out, plain(x, norm.weight))
