"""`Eagle3Draft`: the one-layer EAGLE-3 draft, as vLLM's llama_eagle3 computes it.

Parameter names are the checkpoint's tensor names (`fc`, `midlayer.*`, `norm`, `lm_head`, plus the
`d2t` / `t2d` buffers). One draft step, with vLLM's default variant (no norm_before_residual,
norm_before_fc, fc_norm or norm_output):

    h0       = fc(cat(taps))                       first pass only
    residual = h
    x        = cat(input_layernorm(embed(token)), hidden_norm(h))          width 2H
    q, k, v  = q/k/v_proj(x), RoPE on q and k
    residual = o_proj(attention(q, k, v)) + residual
    prenorm  = mlp(post_attention_layernorm(residual)) + residual          next pass's h
    logits   = lm_head(norm(prenorm))                                       over the draft vocab

The step is exposed in pieces (`fuse`, `qkv`, `finish`, `logits`) so a trainer can put its own
attention between `qkv` and `finish`. Shapes: every piece takes tokens as `[..., T]` with any
leading dims, including none: a packed THD batch is 1-D `[T]` tokens with `[T]` positions (the
caller's attention keeps documents apart). `forward` is the plain reference: causal attention
over each `[T]` row, i.e. one sequence per row.

The embedding is the target's, shared and frozen: `set_embedding(weight)` keeps a detached
reference outside the module tree (not a parameter, not a buffer, not in `state_dict`, not moved
by `.to()`, shared rather than copied by `copy.deepcopy`), or pass `embeds` to `qkv` directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from codraft.draft.config import DraftConfig
from codraft.draft.vocab import check_vocab_maps, identity_maps
from codraft.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _Shared:
    """Holds a tensor owned by someone else (the target's embedding): deepcopy keeps the
    reference, so a shadow copy of the draft does not duplicate the embedding."""

    def __init__(self, value: torch.Tensor | None) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class Eagle3Attention(nn.Module):
    """The projections of the draft's attention; the attention itself is the caller's choice."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        qkv_in = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(qkv_in, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(qkv_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(qkv_in, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class Eagle3Layer(nn.Module):
    """The draft's single decoder layer, `midlayer` in the checkpoint."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over the T axis of q [..., T, heads, hd], k/v [..., T, kv_heads, hd] (GQA)."""
    rep = q.shape[-2] // k.shape[-2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=-2)
        v = v.repeat_interleave(rep, dim=-2)
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=True
    )
    return out.transpose(-3, -2)


class Eagle3Draft(nn.Module):
    def __init__(
        self,
        config: DraftConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Parameters in `dtype` (default: config.dtype); d2t/t2d start as the identity map."""
        super().__init__()
        self.config = config
        cfg = config
        self.fc = nn.Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        d2t, t2d = identity_maps(cfg.draft_vocab_size, cfg.vocab_size)
        here = self.lm_head.weight.device  # where the module is built (`with torch.device(...)`)
        self.register_buffer("d2t", d2t.to(here))
        self.register_buffer("t2d", t2d.to(here))
        # Kept out of the module tree so `.to(bfloat16)` never rounds the inverse frequencies.
        self.__dict__["rotary"] = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.__dict__["_embed"] = _Shared(None)
        self.to(device=device, dtype=dtype or cfg.torch_dtype)

    # ------------------------------------------------------------------ vocab and embedding
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (see codraft.draft.vocab.build_draft_vocab)."""
        check_vocab_maps(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def set_embedding(self, weight: torch.Tensor | nn.Embedding) -> None:
        """Share the target's token embedding [vocab_size, hidden_size] (kept frozen)."""
        if isinstance(weight, nn.Embedding):
            weight = weight.weight
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != want:
            raise ValueError(
                f"embedding weight has shape {list(weight.shape)}, expected {list(want)} "
                "[target vocab_size, hidden_size]"
            )
        self.__dict__["_embed"] = _Shared(weight.detach())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.__dict__["_embed"].value
        if w is None:
            raise RuntimeError(
                "the draft has no embedding: call set_embedding(target embed_tokens weight) "
                "first, or pass embeds to qkv()"
            )
        return F.embedding(input_ids.to(w.device), w).to(self.fc.weight.dtype)

    # ------------------------------------------------------------------ step pieces
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[..., T, n_taps * target_H] target taps (in tap-layer order) -> h0 [..., T, H].

        Taps of any float dtype are cast to the draft's, except taps already in autocast's
        dtype under autocast (bf16, as the target sends them): `fc` reads those as they are,
        with no fp32 copy made and no second bf16 copy kept for backward."""
        want = self.fc.in_features
        if taps.shape[-1] != want:
            raise ValueError(
                f"taps have width {taps.shape[-1]}, expected {want} = {self.config.num_taps} "
                f"taps x target hidden {self.config.target_hidden_size}"
            )
        dev = taps.device.type
        if not (torch.is_autocast_enabled(dev) and taps.dtype == torch.get_autocast_dtype(dev)):
            taps = taps.to(self.fc.weight.dtype)
        return self.fc(taps)

    def qkv(
        self, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, h [..., T, H], positions [..., T] -> q [..., T, heads, hd], k and v
        [..., T, kv_heads, hd] (RoPE applied to q and k), residual [..., T, H]."""
        cfg, layer = self.config, self.midlayer
        residual = h
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], dim=-1)
        lead = x.shape[:-1]
        attn = layer.self_attn
        q, k, v = shared_input_linears(
            x, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        )
        q = q.view(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(*lead, cfg.num_key_value_heads, cfg.head_dim)
        # q's dtype, not x's: under autocast the projections come out bf16 while x is fp32,
        # and fp32 cos/sin would promote q and k away from v
        cos, sin = self.rotary(positions.to(x.device), q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn_out [..., T, heads, hd], residual [..., T, H] -> prenorm hidden [..., T, H]."""
        layer = self.midlayer
        residual = layer.self_attn.o_proj(attn_out.flatten(-2)) + residual
        mlp = layer.mlp
        gate, up = shared_input_linears(
            layer.post_attention_layernorm(residual), mlp.gate_proj.weight, mlp.up_proj.weight
        )
        return mlp.down_proj(F.silu(gate) * up) + residual

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """prenorm [..., T, H] -> draft-vocab logits [..., T, draft_vocab_size]."""
        return self.lm_head(self.norm(prenorm))

    def forward(
        self,
        input_ids: torch.Tensor,
        h: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: str | AttnFn = "causal",
        embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over sequences `[..., T]` -> (draft logits, prenorm hidden).

        h is fc(taps) on the first pass and the previous pass's prenorm after that; positions
        default to 0..T-1 per row. attn "causal" is causal attention within each row; a callable
        (q, k, v) -> out replaces it.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=h.device).expand(input_ids.shape)
        if embeds is None:
            embeds = self.embed(input_ids)
        if attn == "causal":
            attn = causal_attention
        elif not callable(attn):
            raise ValueError(f"attn must be 'causal' or a callable (q, k, v) -> out, got {attn!r}")
        q, k, v, residual = self.qkv(embeds, h, positions)
        prenorm = self.finish(attn(q, k, v), residual)
        return self.logits(prenorm), prenorm

    # ------------------------------------------------------------------ target ids
    def draft_to_target_ids(self) -> torch.Tensor:
        """Target id of every draft id: int64 [draft_vocab_size]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids (any shape) -> target token ids: id + d2t[id]."""
        draft_ids = draft_ids.to(self.d2t.device)
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] -> [..., vocab_size], -inf outside the draft vocab (as vLLM)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), -torch.inf)
        out[..., self.draft_to_target_ids().to(out.device)] = draft_logits
        return out


class _SharedInputLinears(torch.autograd.Function):
    """x @ w.T for several weights of one input, under autocast: x cast to autocast's dtype
    once and kept once for backward. Autocast itself casts x again for every projection and
    keeps every copy. The products are autocast's (bf16, the input's gradients summed in x's
    dtype); each call's weight gradients come back in the weights' dtype, where autocast's
    cached bf16 copy of a weight would first sum the gradients of a step's calls (the K
    passes) in bf16."""

    @staticmethod
    def forward(ctx, x, dtype, *weights):  # type: ignore[override]
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(dtype)
            outs = tuple(F.linear(xc, w.to(dtype)) for w in weights)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype = x.dtype
        return outs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        xc, *weights = ctx.saved_tensors
        gx = None
        gws = []
        with torch.autocast(xc.device.type, enabled=False):
            for g, w in zip(grads, weights, strict=True):
                if g is None:
                    gws.append(None)
                    continue
                g = g.to(xc.dtype)
                if ctx.needs_input_grad[0]:
                    part = (g @ w.to(xc.dtype)).to(ctx.x_dtype)
                    gx = part if gx is None else gx + part
                flat_g, flat_x = g.reshape(-1, g.shape[-1]), xc.reshape(-1, xc.shape[-1])
                gws.append((flat_g.t() @ flat_x).to(w.dtype))
        return gx, None, *gws


def shared_input_linears(x: torch.Tensor, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each weight (no biases). Under autocast the input is cast and kept
    once instead of once per projection (the q/k/v input, the MLP's gate/up input)."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return tuple(F.linear(x, w) for w in weights)
    return _SharedInputLinears.apply(x, torch.get_autocast_dtype(dev), *weights)
