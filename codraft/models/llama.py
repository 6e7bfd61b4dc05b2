"""The Llama-family target (Llama, SmolLM2, Qwen2, Qwen3, Mistral) and its safetensors loader.

Parameter names are transformers' names without the leading `model.` of the body
(`layers.0.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`), so loading a
transformers checkpoint is a rename. Outputs match transformers' on the same weights.

Pieces usable on their own (for a pipeline split applied from outside): `embed`, `rope`,
`layers[i](h, cos, sin, cu_seqlens)`, `norm` and `head`.

Two kinds of hidden state come out of a forward. Tap k is the residual stream after k decoder
layers, before any final norm (tap 0: the embeddings; tap L: the output of the last layer).
`last_hidden` is the target's final hidden state AFTER the final norm, the input of the lm_head:
what vLLM's model forward returns and transformers' `hidden_states[-1]` for these models. So
`logits == head(last_hidden) == lm_head(last_hidden)` and `last_hidden == norm(tap L)`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from codraft.models.config import TargetConfig, validate_tap_layers
from codraft.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, rope_inv_freq


@dataclass
class TargetOutput:
    """Result of `TargetModel.forward`. Shapes are [B, T, ...], or [N, ...] for packed input.

    logits: [.., V] = lm_head(last_hidden) (None when not asked for).
    taps: [.., n_taps * H], the tap layers' residual streams concatenated in the order asked
    (before any final norm).
    last_hidden: [.., H], the final hidden state AFTER the final norm (the lm_head's input).
    """

    logits: torch.Tensor | None
    taps: torch.Tensor | None
    last_hidden: torch.Tensor


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
) -> torch.Tensor:
    """q: [B, h, T, D], k/v: [B, kv_h, T, D] -> [B, h, T, D]; causal, optional sliding window."""
    T = q.shape[-2]
    if window is None or T <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    i = torch.arange(T, device=q.device)
    dist = i[:, None] - i[None, :]
    mask = (dist >= 0) & (dist < window)  # same band as transformers' sliding-window mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.layer_window(layer_idx)
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, self.n_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, self.n_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        if cu_seqlens is None:
            out = _causal_attention(q, k, v, self.window)
        else:  # packed documents (B == 1): causal within each document only
            bounds = cu_seqlens.tolist()
            out = torch.cat(
                [
                    _causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], self.window)
                    for a, b in zip(bounds[:-1], bounds[1:], strict=True)
                    if b > a
                ],
                dim=2,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cu_seqlens)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_rotary(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary frequencies, e.g. after building the model on the meta device."""
        c = self.config
        inv = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        self.rotary_emb.inv_freq = inv.to(device or self.embed_tokens.weight.device)

    # ------------------------------------------------------------------ pieces
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin [..., T, head_dim] for integer positions [..., T]."""
        return self.rotary_emb(positions, dtype)

    def head(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head alone: final (post-norm) hidden states [..., H] -> logits [..., V]."""
        return self.lm_head(last_hidden)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        tap_layers: Sequence[int] = (),
        return_logits: bool = True,
        cu_seqlens: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run the target.

        input_ids: [B, T] (a batch of equal-length rows, causal per row), or [N] packed
        documents with `cu_seqlens` (int [n_docs + 1], 0 .. N; causal within each document).
        positions: RoPE positions, same shape as input_ids; default arange per row/document.
        tap_layers: tap k = residual stream after k layers (0 = embeddings, L = after the last
        layer, before the final norm); concatenated in the order given. `last_hidden` is the
        final norm of the last layer's output, whatever the taps.
        """
        taps_wanted = validate_tap_layers(tap_layers, self.config.num_layers)
        packed = input_ids.dim() == 1
        if packed:
            cu_seqlens = _check_cu_seqlens(cu_seqlens, input_ids.shape[0], input_ids.device)
            if positions is None:
                positions = _packed_positions(cu_seqlens)
            input_ids, positions = input_ids[None], positions[None]
        elif input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError(
                    "cu_seqlens is for packed 1-D input_ids [N]; got input_ids of shape "
                    f"{tuple(input_ids.shape)}: flatten the documents or drop cu_seqlens"
                )
            if positions is None:
                T = input_ids.shape[1]
                positions = torch.arange(T, device=input_ids.device).expand_as(input_ids)
        else:
            raise ValueError(
                f"input_ids must be [B, T] or packed [N], got shape {tuple(input_ids.shape)}"
            )
        if positions.shape != input_ids.shape:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} != input_ids shape "
                f"{tuple(input_ids.shape)}"
            )

        h = self.embed(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        saved: dict[int, torch.Tensor] = {}
        if 0 in taps_wanted:
            saved[0] = h
        for i, layer in enumerate(self.layers, start=1):
            h = layer(h, cos, sin, cu_seqlens)
            if i in taps_wanted:
                saved[i] = h
        taps = torch.cat([saved[k] for k in taps_wanted], dim=-1) if taps_wanted else None
        h = self.norm(h)
        logits = self.head(h) if return_logits else None
        if packed:
            h = h[0]
            taps = taps[0] if taps is not None else None
            logits = logits[0] if logits is not None else None
        return TargetOutput(logits=logits, taps=taps, last_hidden=h)


def _check_cu_seqlens(cu: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if cu is None:
        return torch.tensor([0, n], dtype=torch.int32, device=device)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [n_docs + 1], got dtype {cu.dtype} "
            f"shape {tuple(cu.shape)}"
        )
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != n or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {n}, never decreasing; "
            f"got {cu.tolist()}"
        )
    return cu


def _packed_positions(cu: torch.Tensor) -> torch.Tensor:
    """Per-document positions 0..len-1 for packed documents described by cu_seqlens."""
    cu = cu.long()
    n = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return torch.arange(n, device=cu.device) - starts


# ---------------------------------------------------------------------- loading
def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a transformers folder: sharded via the index, or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise FileNotFoundError(
                f"{index.name} in {path} names shard(s) that are not there: {absent}; "
                "the download or conversion is incomplete"
            )
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {path}; expected a transformers model folder "
            "(a GGUF model must be converted to safetensors first)"
        )
    return files


def _list_names(names: Sequence[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_target(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    config: TargetConfig | None = None,
) -> TargetModel:
    """Load config.json + safetensors from a transformers folder into a frozen, eval TargetModel.

    The model is built on the meta device and the file tensors are assigned directly, so
    loading costs about one read of the weights. Missing, unexpected or mis-shaped tensors raise
    an error naming them. `config`: the folder's config.json when the caller has read it already.
    """
    path = Path(path)
    cfg = config if config is not None else TargetConfig.from_pretrained(path)
    files = safetensors_files(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = TargetModel(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")

    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    bad_shape: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as sf:
            for key in sf.keys():
                name = key.removeprefix("model.")
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed, old checkpoints sometimes carry it
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue  # tied to embed_tokens; some checkpoints store the copy anyway
                if name not in expected:
                    unexpected.append(key)
                    continue
                shape = tuple(sf.get_slice(key).get_shape())
                if shape != expected[name]:
                    bad_shape.append(f"{key} {shape} (expected {expected[name]})")
                    continue
                state[name] = sf.get_tensor(key).to(dtype)
    missing = sorted(set(expected) - set(state))
    problems = []
    if missing:
        problems.append(f"missing tensors: {_list_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_list_names(unexpected)}")
    if bad_shape:
        problems.append(f"wrong shapes: {_list_names(bad_shape)}")
    if problems:
        raise ValueError(
            f"weights in {path} do not fit the {cfg.model_type} config in its config.json ("
            + "; ".join(problems)
            + "); check that config.json and the safetensors files belong together"
        )
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_rotary(device)
    model.requires_grad_(False)
    return model.eval()
