"""`DFlashDraft`: the DFlash block drafter, as vLLM's qwen3_dflash computes it.

Parameter names are the checkpoint's tensor names (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`);
the embedding and the lm_head are the target's, shared and frozen (`set_target_head`), never
saved. With tokens laid out as rows (see `codraft.learner.attention.block_draft`: row i of a
document is the block anchored at position i + 1, slot s at position i + 1 + s):

    ctx          = hidden_norm(fc(cat(taps)))                  [T, H], the target's context
    h            = embed(block tokens)                         [S, T, H]: anchor, mask, ...
    per layer:   x = input_layernorm(h)
                 q, k, v = q/k/v_proj(x); q, k = q_norm(q), k_norm(k); RoPE at block positions
                 k_ctx, v_ctx = k/v_proj(ctx); k_ctx = k_norm(k_ctx); RoPE at context positions
                 h = h + o_proj(attention(q, (k_ctx, v_ctx), (k, v)))
                 h = h + mlp(post_attention_layernorm(h))
    logits       = lm_head(norm(h))                            slot s >= 1 proposes position i+1+s

`forward` is the plain reference: attention from an explicit mask (O(T^2), for checks); a trainer
passes its own attention (q, k_ctx, v_ctx, k, v) -> out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from codraft.draft.dflash_config import DFlashConfig
from codraft.draft.model import _Shared
from codraft.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope

BlockAttnFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


def rows_and_slots(cu_seqlens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, ...]:
    """For packed documents (int32 cu_seqlens [B + 1]) -> (ctx_positions [T], block_positions
    [S, T], source [S, T]): row i's slot s sits at position i + 1 + s of its document, and holds
    the token at packed index source[s, i], or -1 where that position lies past the document."""
    cu = cu_seqlens.long()
    t = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    ctx_pos = torch.arange(t) - cu[doc]
    slot = torch.arange(block_size).unsqueeze(1)
    blk_pos = ctx_pos.unsqueeze(0) + 1 + slot
    source = torch.arange(t).unsqueeze(0) + 1 + slot
    source = torch.where(source < cu[doc + 1].unsqueeze(0), source, torch.full_like(source, -1))
    return ctx_pos, blk_pos, source


def dense_block_attention_fn(cu_seqlens: torch.Tensor) -> BlockAttnFn:
    """Block-drafter attention from an explicit [S*T, T + S*T] mask: the reference."""
    cu = cu_seqlens.long()

    def attn(q, k_ctx, v_ctx, k_blk, v_blk):
        s_, t, hq, d = q.shape
        hkv = k_ctx.shape[1]
        doc = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
        row = torch.arange(t)
        qdoc, qrow = doc.repeat(s_), row.repeat(s_)
        see_ctx = (qdoc[:, None] == doc[None, :]) & (row[None, :] <= qrow[:, None])
        see_blk = qrow[:, None] == qrow[None, :]
        mask = torch.cat([see_ctx, see_blk], dim=1).to(q.device)
        k = torch.cat([k_ctx, k_blk.reshape(s_ * t, hkv, d)]).repeat_interleave(hq // hkv, 1)
        v = torch.cat([v_ctx, v_blk.reshape(s_ * t, hkv, d)]).repeat_interleave(hq // hkv, 1)
        out = F.scaled_dot_product_attention(
            q.reshape(s_ * t, hq, d).transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask,
        )  # fmt: skip
        return out.transpose(0, 1).reshape(s_, t, hq, d)

    return attn


class DFlashDraft(nn.Module):
    def __init__(
        self,
        config: DFlashConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg = config
        self.fc = nn.Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.__dict__["rotary"] = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.__dict__["_embed"] = _Shared(None)
        self.__dict__["_head"] = _Shared(None)
        self.to(device=device, dtype=dtype or cfg.torch_dtype)

    def set_target_head(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Share the target's embedding [vocab, H] and lm_head [vocab, H] (the embedding when
        the target ties them); both stay frozen and outside the state_dict."""
        want = (self.config.vocab_size, self.config.hidden_size)
        for name, w in (("embedding", embed), ("lm_head", lm_head)):
            if w is not None and tuple(w.shape) != want:
                raise ValueError(f"target {name} has shape {list(w.shape)}, expected {list(want)}")
        self.__dict__["_embed"] = _Shared(embed.detach())
        self.__dict__["_head"] = _Shared((lm_head if lm_head is not None else embed).detach())

    def _shared(self, key: str) -> torch.Tensor:
        w = self.__dict__[key].value
        if w is None:
            raise RuntimeError("the draft has no target head: call set_target_head() first")
        return w

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self._shared("_embed")
        return F.embedding(ids.to(w.device), w).to(self.fc.weight.dtype)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, n_taps * target_H] taps in tap-layer order -> the context stream [T, H]."""
        if taps.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"taps have width {taps.shape[-1]}, expected {self.fc.in_features} = "
                f"{self.config.num_taps} taps x target hidden {self.config.target_hidden_size}"
            )
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def block_tokens(self, input_ids: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """[S, T] block inputs: slot 0 the anchor token (the mask past a document's end), the
        other slots the mask token."""
        out = torch.full(
            source.shape, self.config.mask_token_id, dtype=torch.long, device=source.device
        )
        anchor = input_ids.to(source.device).long()[source[0].clamp(min=0)]
        out[0] = torch.where(source[0] >= 0, anchor, out[0])
        return out

    def layer(
        self,
        i: int,
        h: torch.Tensor,
        ctx: torch.Tensor,
        ctx_pos: torch.Tensor,
        blk_pos: torch.Tensor,
        attn: BlockAttnFn,
    ) -> torch.Tensor:
        cfg, layer = self.config, self.layers[i]
        a = layer.self_attn
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x = layer.input_layernorm(h)
        v = a.v_proj(x).unflatten(-1, (hkv, d))
        vc = a.v_proj(ctx).unflatten(-1, (hkv, d))
        # the norms compute in fp32; attention takes one dtype (the projections', under autocast)
        q = a.q_norm(a.q_proj(x).unflatten(-1, (hq, d))).to(v.dtype)
        k = a.k_norm(a.k_proj(x).unflatten(-1, (hkv, d))).to(v.dtype)
        kc = a.k_norm(a.k_proj(ctx).unflatten(-1, (hkv, d))).to(vc.dtype)
        cos, sin = self.rotary(blk_pos.to(x.device), q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cos, sin = self.rotary(ctx_pos.to(x.device), kc.dtype)
        kc = apply_rope(kc, cos, sin)
        h = h + a.o_proj(attn(q, kc, vc, k, v).flatten(-2))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., vocab] through the target's lm_head."""
        return F.linear(self.norm(h), self._shared("_head").to(h.dtype))

    def hidden(
        self,
        input_ids: torch.Tensor,
        taps: torch.Tensor,
        cu_seqlens: torch.Tensor,
        attn: BlockAttnFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's block over packed documents: input_ids [T], taps [T, n_taps * H_t],
        cu_seqlens int32 [B + 1] -> (the last layer's output [S, T, H], before the final
        norm; source [S, T]: the packed index of the token each slot stands for, -1 past the
        document)."""
        # index tensors built on the host once a step (a small copy), then kept on the device
        ctx_pos, blk_pos, source = (
            t.to(input_ids.device) for t in rows_and_slots(cu_seqlens.cpu(), self.config.block_size)
        )
        h = self.embed(self.block_tokens(input_ids, source))
        ctx = self.context(taps)
        attn = attn or dense_block_attention_fn(cu_seqlens.cpu())
        for i in range(len(self.layers)):
            h = self.layer(i, h, ctx, ctx_pos, blk_pos, attn)
        return h, source

    def forward(
        self,
        input_ids: torch.Tensor,
        taps: torch.Tensor,
        cu_seqlens: torch.Tensor,
        attn: BlockAttnFn | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` read out: (logits [S, T, vocab], source [S, T])."""
        h, source = self.hidden(input_ids, taps, cu_seqlens, attn)
        return self.logits(h), source

    def proposals(
        self, h: torch.Tensor, source: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state of each proposal [D, T, H], the packed index it proposes [D, T],
        -1 past the document): slot s >= 1 proposes the token at its own position."""
        return h[1:], source[1:]

    def readout(self, h: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Proposal logits from proposal hidden states (`previous`, the token before each
        proposed one, only matters to drafts with a sequential stage: DSpark)."""
        return self.logits(h)

    def markov_features(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A sequential stage's bias as features and head columns: DFlash has none."""
        return None

    def head_weight(self) -> torch.Tensor:
        """The target's lm_head weight [vocab, H] the draft reads out with (frozen)."""
        return self._shared("_head")
