"""`DFlashConfig`: the shape of a DFlash block drafter, and its config.json as vLLM reads it.

A DFlash draft (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", 2026)
proposes a whole block in one forward: the block is ``[anchor token, mask, ..., mask]`` at the
positions after the last verified token, every draft layer attends to the block
(bidirectionally) and to the target's context, and each mask slot's output is the proposal for
its own position. The target's context enters as keys/values: the tapped residual streams are
concatenated, fused by ``fc``, normalised by ``hidden_norm``, and projected by every draft
layer's own ``k_proj``/``v_proj`` (with its ``k_norm`` and RoPE at the context positions).

vLLM (the ``DFlashDraftModel`` architecture, ``qwen3_dflash.DFlashQwen3ForCausalLM``) reads:

* ``dflash_config.target_layer_ids``: vLLM adds 1 and captures the residual stream *entering*
  layer ``id + 1``, i.e. after ``id + 1`` decoder layers. codraft's tap ``k`` is the residual
  after ``k`` layers, so ``target_layer_ids = [tap - 1 for tap in tap_layers]`` and tap 0 (the
  embeddings) cannot be expressed. vLLM appends taps in layer order, so they are strictly
  increasing here, as for EAGLE-3.
* ``dflash_config.mask_token_id``: the token id of every mask slot; its embedding is the
  target's row for that id (the draft shares the target's embedding and lm_head and ships
  neither).
* Qwen3 attention (``q_norm``/``k_norm`` per head), bias-free, every layer non-causal.
* ``num_target_layers`` (the target's layer count), which SGLang checks the ids against.
* ``block_size`` is what the draft was trained on; vLLM proposes ``num_speculative_tokens``
  tokens from ``1 + num_speculative_tokens`` slots, which should be at most ``block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from codraft.draft.config import DTYPES, _as_int, check_heads, checked_taps, normalise_floats
from codraft.models.config import read_rope

if TYPE_CHECKING:
    from codraft.models.config import TargetConfig

DFLASH_ARCHITECTURE = "DFlashDraftModel"


def dflash_tap_layers(num_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """DFlash's choice of target layers, in codraft's tap convention: `num_taps` layer ids
    spread evenly from layer 1 to layer L - 3 (as the DFlash authors' training code picks
    them), plus one (the residual after that layer). A target under 5 layers has too few for
    that span: its ids spread over 0..L - 2 instead (as many distinct ones as fit)."""
    if num_layers < 2:
        raise ValueError(f"a {num_layers}-layer target has no layer for a DFlash tap")
    lo, hi = (1, num_layers - 3) if num_layers >= 5 else (0, num_layers - 2)
    if num_taps == 1:
        return ((lo + hi) // 2 + 1,)
    ids = sorted({round(lo + i * (hi - lo) / (num_taps - 1)) for i in range(num_taps)})
    return tuple(i + 1 for i in ids)


@dataclass
class DFlashConfig:
    """A DFlash draft. Defaults: two layers for SmolLM2-135M (30 layers, vocab 49152)."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    target_hidden_size: int = 576
    tap_layers: tuple[int, ...] = (2, 9, 15, 21, 28)  # codraft convention; strictly increasing
    block_size: int = 8
    mask_token_id: int = 0
    dtype: str = "bfloat16"
    # the target's layer count: SGLang checks the target layer ids against it and, without
    # it, against the draft's own (2), refusing any id above; vLLM does not read it
    num_target_layers: int | None = 30

    def __post_init__(self) -> None:
        for name in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
            "target_hidden_size", "block_size",
        ):  # fmt: skip
            value = _as_int(name, getattr(self, name))
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            setattr(self, name, value)
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (the anchor and at least one mask slot), got "
                f"{self.block_size}"
            )
        check_heads(self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if self.num_target_layers is not None:
            self.num_target_layers = _as_int("num_target_layers", self.num_target_layers)
            if max(self.tap_layers, default=0) > self.num_target_layers:
                raise ValueError(
                    f"tap layers {list(self.tap_layers)} reach past the target's "
                    f"{self.num_target_layers} layers"
                )
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size "
                f"({self.target_hidden_size}): the draft embeds its block with the target's "
                "embedding and reads it out with the target's lm_head"
            )
        self.mask_token_id = _as_int("mask_token_id", self.mask_token_id)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary "
                f"0..{self.vocab_size - 1}: the mask slot is embedded with the target's row"
            )
        self.tap_layers = checked_taps(
            self.tap_layers,
            1,
            "; DFlash's target_layer_ids are tap - 1, so tap 0 (the embeddings) has no id",
        )
        normalise_floats(self)

    kind = "dflash"  # the drafter kind (a class attribute, not a field)

    @property
    def num_taps(self) -> int:
        return len(self.tap_layers)

    @property
    def proposals(self) -> int:
        """Tokens one block proposes: the slots after the anchor."""
        return self.block_size - 1

    @property
    def draft_vocab_size(self) -> int:
        """The draft reads out with the target's lm_head: the whole target vocabulary."""
        return self.vocab_size

    @property
    def full_vocab(self) -> bool:
        return True

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_target(
        cls,
        target: TargetConfig,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 2,
        block_size: int = 8,
        tap_layers: Sequence[int] | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> DFlashConfig:
        """A draft with the target's attention geometry, rotary settings and widths; taps
        default to `dflash_tap_layers(L)`."""
        from codraft.models.config import validate_tap_layers

        taps = validate_tap_layers(
            tap_layers if tap_layers is not None else dflash_tap_layers(target.num_hidden_layers),
            target.num_hidden_layers,
        )
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads or target.num_attention_heads,
            head_dim=target.head_dim or target.hidden_size // target.num_attention_heads,
            vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_hidden_size=target.hidden_size,
            num_target_layers=target.num_hidden_layers,
            tap_layers=taps,
            block_size=block_size,
            mask_token_id=mask_token_id,
            dtype=dtype or target.dtype or "bfloat16",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that stock vLLM loads with `{"method": "dflash"}`."""
        rope: dict[str, Any] = {"rope_type": "default", **(self.rope_scaling or {})}
        rope["rope_theta"] = self.rope_theta
        return {
            "architectures": [DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "use_sliding_window": False,
            "block_size": self.block_size,
            **({"num_target_layers": self.num_target_layers} if self.num_target_layers else {}),
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": [t - 1 for t in self.tap_layers],
            },
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> DFlashConfig:
        """Read a DFlash draft config.json (the kind `to_hf_dict` writes)."""
        archs = hf.get("architectures") or []
        if DFLASH_ARCHITECTURE not in archs:
            raise ValueError(f"architectures is {archs}, expected [{DFLASH_ARCHITECTURE!r}]")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act is {hf.get('hidden_act')!r}, expected 'silu'")
        if hf.get("attention_bias"):
            raise ValueError("attention_bias is set; codraft's DFlash draft has no biases")
        if hf.get("layer_types") or hf.get("use_sliding_window"):
            raise ValueError("sliding-window DFlash layers are not supported by codraft")
        dflash = hf.get("dflash_config") or {}
        if dflash.get("causal") or hf.get("is_causal"):
            raise ValueError("a causal DFlash draft is not what codraft trains (blocks are not)")
        ids = dflash.get("target_layer_ids")
        if not ids:
            raise ValueError("config has no dflash_config.target_layer_ids")
        if "mask_token_id" not in dflash:
            raise ValueError("config has no dflash_config.mask_token_id")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e.args[0]!r}") from None
        theta, scaling = read_rope(hf)
        return cls(
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            target_hidden_size=hf.get("target_hidden_size") or hidden,
            num_target_layers=hf.get("num_target_layers", dflash.get("num_target_layers")),
            tap_layers=tuple(_as_int("target layer id", t) + 1 for t in ids),
            block_size=hf.get("block_size", 8),
            mask_token_id=dflash["mask_token_id"],
            dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        )
