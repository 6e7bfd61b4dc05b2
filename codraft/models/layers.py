"""Building blocks shared by the target and the draft: RMSNorm, rotary embedding, SwiGLU MLP.

Numerics follow transformers' Llama implementation (norm computed in fp32, then cast back), so a
model assembled from these blocks matches transformers' outputs on the same weights. Under
autograd RMSNorm is one Function with its own backward, so that training keeps only the norm's
input and 1/rms rather than its fp32 intermediates (tests/test_rmsnorm.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) in fp32 (fp64 for fp64 inputs), and 1 / rms(x) [..., 1]."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd, rstd


class _RMSNorm(torch.autograd.Function):
    """weight * (x / rms(x)), the normed value cast to x's dtype before the scale (as
    transformers' Llama), keeping for backward only x and 1 / rms(x) (or, when x needs no
    gradient, the normed value the weight's gradient reads). Composed of plain ops, autograd
    would keep the fp32 copy of x, the fp32 normed value and its cast: 4H + 4H + aH bytes a
    row where this keeps aH + 4, and x is often kept by its consumer anyway."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        n, rstd = _normed(x, eps)
        n = n.to(x.dtype)
        ctx.x_needs_grad = ctx.needs_input_grad[0]
        if ctx.x_needs_grad:
            ctx.save_for_backward(x, weight, rstd)
        else:
            ctx.save_for_backward(n, weight)
        return weight * n

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if not ctx.x_needs_grad:
            n, weight = ctx.saved_tensors
            gw = (g * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
            return None, gw, None
        x, weight, rstd = ctx.saved_tensors
        nf = x.to(rstd.dtype) * rstd
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g * nf.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        gn = (g * weight).to(rstd.dtype)  # through the cast to x's dtype as through identity
        gx = rstd * (gn - nf * (gn * nf).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            n, _ = _normed(x, self.eps)
            return self.weight * n.to(x.dtype)
        return _RMSNorm.apply(x, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with Llama-3 style scaling when configured.

    float32 reproduces transformers' tables bit for bit; float64 serves exact fp64 checks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_scaling type {kind!r}; expected one of default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given integer positions (any shape), computed on the fly."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.__dict__["inv_freq64"] = rope_inv_freq(head_dim, theta, scaling, torch.float64)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Angles in fp32 (as transformers computes them), or in fp64 for fp64 outputs."""
        if dtype == torch.float64:
            inv, acc = self.__dict__["inv_freq64"], torch.float64
        else:
            inv, acc = self.inv_freq.float(), torch.float32
        freqs = positions.to(acc)[..., None] * inv.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
