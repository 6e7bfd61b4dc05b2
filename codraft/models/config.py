"""`TargetConfig`: the shape of a Llama-family target, read from a transformers config.json.

Supported `model_type`s: llama (incl. SmolLM2), qwen2 (q/k/v bias), qwen3 (q/k RMSNorm over
head_dim), mistral (sliding window). Both spellings of the rotary settings are understood: the
transformers-4 `rope_theta` + `rope_scaling` keys and the transformers-5 `rope_parameters` dict.

Tap convention (docs/architecture.md, Contracts): tap k is the residual stream after k decoder
layers, before the final norm; tap 0 is the token embeddings, tap L the output of the last layer.
The final hidden state (`last_hidden` of the model and of a tap message) is not a tap: it is taken
after the final norm, so it equals norm(tap L).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class TargetConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: same as num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for qwen2)
    o_proj_bias: bool = False  # bias on o_proj (llama/qwen3 with attention_bias; never qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # effective window (None: off); see layer_types
    layer_types: tuple[str, ...] = ()  # per layer "full_attention"/"sliding_attention"; () = full
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str | None = None  # the checkpoint's dtype as written in config.json, informational
    extra: dict[str, Any] = field(default_factory=dict, repr=False)  # untouched other keys

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported target model_type {self.model_type!r}; codraft supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        self.layer_types = tuple(self.layer_types) or ("full_attention",) * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the model has "
                f"{self.num_hidden_layers} layers"
            )
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"unsupported layer_types {bad}; expected only {LAYER_TYPES}")
        if self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope type {kind!r}; codraft supports "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )

    # ------------------------------------------------------------------ derived
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size used by decoder layer `layer` (0-based), or None for full."""
        if self.sliding_window is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def default_tap_layers(self) -> tuple[int, int, int]:
        return default_tap_layers(self.num_hidden_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> TargetConfig:
        """Build from a transformers-style config.json dict (transformers 4 or 5 spelling)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported target model_type {model_type!r} in config; codraft supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; Llama-family targets use 'silu'")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            vocab = int(hf["vocab_size"])
            inter = int(hf["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e.args[0]!r}") from None
        theta, scaling = read_rope(hf)
        bias = bool(hf.get("attention_bias", False))
        qkv_bias, o_bias = {
            "llama": (bias, bias),
            "qwen2": (True, False),
            "qwen3": (bias, bias),
            "mistral": (False, False),
        }[model_type]
        window, layer_types = _read_sliding(hf, model_type, layers)
        known = set(f.name for f in dataclasses.fields(cls)) | {
            "rope_parameters",
            "torch_dtype",
            "use_sliding_window",
            "max_window_layers",
            "hidden_act",
        }
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            layer_types=layer_types,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TargetConfig:
        """Read `<path>/config.json` (or `path` itself when it names a .json file)."""
        p = Path(path)
        file = p if p.suffix == ".json" else p / "config.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"no config.json at {file}; expected a transformers model folder "
                "(config.json + *.safetensors)"
            )
        with open(file) as f:
            return cls.from_dict(json.load(f))


def read_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the v4 or the v5 spelling."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and all(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                "per-layer-type rope_parameters are not supported for Llama-family targets; "
                f"got keys {sorted(params)}"
            )
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {kind!r}; codraft supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return theta, scaling


def _read_sliding(
    hf: dict[str, Any], model_type: str, layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """Effective sliding window and per-layer types, following transformers' rules."""
    full = ("full_attention",) * layers
    if model_type == "llama":
        return None, full
    window = hf.get("sliding_window")
    if model_type == "mistral":
        return (int(window), ("sliding_attention",) * layers) if window else (None, full)
    # qwen2 / qwen3: the window exists only with use_sliding_window; layers from max_window_layers
    if not hf.get("use_sliding_window", False) or not window:
        return None, tuple(hf.get("layer_types") or full)
    types = hf.get("layer_types")
    if not types:
        first = int(hf.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return int(window), tuple(types)


def default_tap_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3 tap layers in codraft's convention (tap k = residual after k layers).

    The standard choice is (2, L//2, L-3). For 4 <= L <= 6 that is not strictly increasing, so
    (1, L//2, L-1) is used instead (three distinct interior layers). Models with fewer than 4
    layers have no three distinct interior taps: pass tap layers explicitly.
    """
    L = num_layers
    if L < 4:
        raise ValueError(
            f"cannot choose default EAGLE-3 tap layers for a {L}-layer model (need at least 4 "
            "layers for three distinct interior taps); pass tap layers explicitly, each in 0..L"
        )
    taps = (2, L // 2, L - 3)
    if taps[0] < taps[1] < taps[2]:
        return taps
    return (1, L // 2, L - 1)


def validate_tap_layers(taps: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Check tap indices are ints in 0..num_layers; return them as a tuple (order kept)."""
    out = []
    for t in taps:
        try:
            if isinstance(t, bool):
                raise TypeError
            t = operator.index(t)
        except TypeError:
            raise TypeError(f"tap layer ids must be integers, got {t!r} in {list(taps)}") from None
        if not 0 <= t <= num_layers:
            raise ValueError(
                f"tap layer {t} is out of range for a {num_layers}-layer target: valid taps are "
                f"0 (embeddings) .. {num_layers} (after the last layer, before the final norm)"
            )
        out.append(t)
    return tuple(out)
