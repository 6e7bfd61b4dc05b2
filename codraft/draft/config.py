"""`DraftConfig`: the shape of an EAGLE-3 draft, and its config.json as vLLM and SGLang read it.

Tap layer ids, and how each engine reads them (checked against vLLM 0.32's source):

* codraft: tap k is the residual stream after k decoder layers, before the final norm (tap 0 =
  the embeddings, tap L = the last layer's output).
* vLLM: `eagle_aux_hidden_state_layer_ids` at the top level of the draft config (the V1 model
  runner reads it there first, then in `eagle_config`; the V2 runner, vLLM's default on CUDA,
  reads it only there: without it the target falls back to its own default layers) goes through
  `set_aux_hidden_state_layers` into the target's `aux_hidden_state_layers`; in
  `LlamaModel.forward` the target calls `_maybe_add_hidden_state(aux, idx + 1, hidden, residual)`
  after decoder layer `idx` (and with `start_layer` before the first one), which appends
  `hidden + residual` when `idx + 1` is in the list. So vLLM's id k is the residual stream after
  k layers: the same convention as codraft, written unchanged.
* vLLM appends aux states in layer order, not list order, and only once per layer, so a list that
  is not strictly increasing would be silently reordered or shortened against what `fc` was
  trained on. DraftConfig therefore requires strictly increasing tap layers.
* SGLang: `set_eagle3_layers_to_capture` adds 1 to every id ("for the ith layer, it takes the
  output of the (i-1)th layer"), so SGLang's id v means the residual after v + 1 layers. A
  config for SGLang must carry `tap - 1`: `to_hf_dict(engine="sglang")` writes that, and
  `from_hf_dict(..., engine="sglang")` reads it back. The default, and what codraft ships, is
  vLLM's convention.

Embeddings are shared with the target (a codraft checkpoint carries no `embed_tokens`), and vLLM
shares the target's embedding with the draft only when the widths match, so `hidden_size` must
equal `target_hidden_size`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from codraft.models.config import read_rope

if TYPE_CHECKING:
    from codraft.models.config import TargetConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names vLLM's registry maps to its Llama EAGLE-3 draft (llama_eagle3.Eagle3LlamaForCausalLM).
ACCEPTED_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
ENGINES = ("vllm", "sglang")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
DEFAULT_DRAFT_VOCAB = 32000
# Variants of the vLLM/SpecForge EAGLE-3 layer that codraft's draft does not implement.
_UNSUPPORTED_FLAGS = (
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "attention_bias",
    "mlp_bias",
)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def check_heads(heads: int, kv_heads: int, head_dim: int) -> None:
    """GQA and rotary constraints of a draft's attention."""
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")


def checked_taps(taps: Sequence[Any], lowest: int, why: str) -> tuple[int, ...]:
    """Tap layers as ints, at least `lowest` and strictly increasing (vLLM collects taps in
    layer order, once per layer, so any other order would silently feed fc a different input
    than it was trained on); `why` explains `lowest` in the error."""
    out = tuple(_as_int("tap layer", t) for t in taps)
    if not out:
        raise ValueError("tap_layers must name at least one target layer")
    if out[0] < lowest or any(a >= b for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(
            f"tap_layers must be >= {lowest} and strictly increasing, got {list(out)}: vLLM "
            f"collects taps in layer order, once per layer{why}"
        )
    return out


def normalise_floats(cfg: Any) -> None:
    """The float and dtype fields every draft config shares, in canonical form."""
    cfg.rms_norm_eps = float(cfg.rms_norm_eps)
    cfg.rope_theta = float(cfg.rope_theta)
    cfg.rope_scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    cfg.dtype = dtype_name(cfg.dtype)


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name ("bfloat16", ...) of a torch dtype or dtype name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        return name
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")


@dataclass
class DraftConfig:
    """One-layer EAGLE-3 draft. Defaults: a draft for SmolLM2-135M (30 layers, vocab 49152)."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152  # the target's vocabulary
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    target_hidden_size: int = 576
    tap_layers: tuple[int, ...] = (2, 15, 27)  # codraft convention; strictly increasing
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "max_position_embeddings",
            "target_hidden_size",
        ):
            value = _as_int(name, getattr(self, name))
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
            setattr(self, name, value)
        check_heads(self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) cannot exceed the target vocab_size "
                f"({self.vocab_size})"
            )
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size "
                f"({self.target_hidden_size}): the draft shares the target's embeddings, and "
                "vLLM only shares them when the widths match (a codraft checkpoint has no "
                "embed_tokens of its own)"
            )
        self.tap_layers = checked_taps(self.tap_layers, 0, "")
        normalise_floats(self)

    kind = "eagle3"  # the drafter kind (a class attribute, not a field)

    # ------------------------------------------------------------------ derived
    @property
    def num_taps(self) -> int:
        return len(self.tap_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def full_vocab(self) -> bool:
        """True when the draft predicts over the whole target vocabulary (no d2t/t2d needed)."""
        return self.draft_vocab_size == self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_target(
        cls,
        target: TargetConfig,
        *,
        draft_vocab_size: int | None = None,
        tap_layers: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> DraftConfig:
        """A draft with the target's attention geometry, rotary settings and hidden size.

        draft_vocab_size defaults to min(32000, target vocab); tap_layers to
        `target.default_tap_layers()` (codraft convention, checked against the target's depth).
        """
        from codraft.models.config import validate_tap_layers

        if tap_layers is None:
            tap_layers = target.default_tap_layers()
        taps = validate_tap_layers(tap_layers, target.num_hidden_layers)
        if draft_vocab_size is None:
            draft_vocab_size = min(DEFAULT_DRAFT_VOCAB, target.vocab_size)
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads or target.num_attention_heads,
            head_dim=target.head_dim or target.hidden_size // target.num_attention_heads,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_hidden_size=target.hidden_size,
            tap_layers=taps,
            dtype=dtype or target.dtype or "bfloat16",
        )

    # ------------------------------------------------------------------ config.json
    def to_hf_dict(self, engine: str = "vllm") -> dict[str, Any]:
        """The config.json that stock vLLM (and, with engine="sglang", SGLang) loads for eagle3."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
        shift = 1 if engine == "sglang" else 0
        if shift and self.tap_layers[0] < 1:
            raise ValueError("SGLang cannot express tap 0 (the embeddings): its ids are tap - 1")
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "torch_dtype": self.dtype,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "use_cache": True,
            "eagle_aux_hidden_state_layer_ids": [t - shift for t in self.tap_layers],
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [t - shift for t in self.tap_layers],
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], engine: str = "vllm") -> DraftConfig:
        """Read an EAGLE-3 Llama draft config.json (transformers 4 or 5 spelling)."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; expected one of {ENGINES}")
        archs = hf.get("architectures") or []
        if not any(a in ACCEPTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"architectures is {archs}, expected {[ARCHITECTURE]} (an EAGLE-3 Llama draft)"
            )
        if hf.get("model_type") != "llama":
            raise ValueError(f"model_type is {hf.get('model_type')!r}, expected 'llama'")
        if hf.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"num_hidden_layers is {hf.get('num_hidden_layers')}, expected 1 "
                "(codraft drafts have exactly one decoder layer)"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act is {hf.get('hidden_act')!r}, expected 'silu'")
        on = [k for k in _UNSUPPORTED_FLAGS if hf.get(k) or (hf.get("eagle_config") or {}).get(k)]
        if on:
            raise ValueError(f"unsupported EAGLE-3 variant: {on} set; codraft implements none")
        eagle = hf.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError("eagle_config.use_aux_hidden_state is false; EAGLE-3 needs taps")
        nested, top = (
            eagle.get("eagle_aux_hidden_state_layer_ids"),
            hf.get("eagle_aux_hidden_state_layer_ids"),
        )
        if nested and top and list(nested) != list(top):
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids is {list(top)} at the top level but "
                f"{list(nested)} in eagle_config; vLLM's runners read different ones: make "
                "them equal"
            )
        ids = top or nested
        if not ids:
            raise ValueError(
                "config has no eagle_config.eagle_aux_hidden_state_layer_ids; tap layers are "
                "part of every codraft checkpoint and are never defaulted"
            )
        shift = 1 if engine == "sglang" else 0
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            vocab = int(hf["vocab_size"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e.args[0]!r}") from None
        theta, scaling = read_rope(hf)
        return cls(
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            vocab_size=vocab,
            draft_vocab_size=hf.get("draft_vocab_size") or vocab,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            target_hidden_size=hf.get("target_hidden_size") or hidden,
            tap_layers=tuple(_as_int("tap layer", t) + shift for t in ids),
            dtype=hf.get("torch_dtype") or hf.get("dtype") or "bfloat16",
        )
