"""`model_fingerprint`: a short stable id of the target family, carried by every tap message.

Server and learner compute it from the target's config and compare: same fingerprint, same
architecture (layer count, widths, heads, vocab, rotary and norm settings). It does NOT cover
the weights: an RL policy changes its weights and keeps its fingerprint, and the tap header's
policy version is what tells weight versions apart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from codraft.models.config import TargetConfig

FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "o_proj_bias",
    "mlp_bias",
    "qk_norm",
    "sliding_window",
    "layer_types",
)


def _canon(v: Any) -> Any:
    """Numbers as floats (8 and 8.0 agree), rope 'type' spelled 'rope_type', tuples as lists."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, dict):
        return {("rope_type" if k == "type" else str(k)): _canon(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_canon(x) for x in v]
    raise TypeError(f"cannot fingerprint a config value of type {type(v).__name__}")


def model_fingerprint(config: Any, *, extra: dict[str, Any] | None = None) -> str:
    """A short stable id of the target *family*: "<model_type>-<16 hex>".

    `config` is a `TargetConfig`, a transformers config.json dict, or a model folder / config.json
    path. The digest is sha256 over the canonical JSON of the architecture-defining fields
    (`FINGERPRINT_FIELDS`) plus `extra` (e.g. a tokenizer hash). It does NOT cover the weights:
    an RL policy changes weights and keeps its fingerprint; the policy version tells weights apart.
    """
    if isinstance(config, str | Path):
        config = TargetConfig.from_pretrained(config)
    elif isinstance(config, dict):
        config = TargetConfig.from_dict(config)
    if not isinstance(config, TargetConfig):
        raise TypeError(
            f"model_fingerprint takes a TargetConfig, a config.json dict or a path, "
            f"got {type(config).__name__}"
        )
    canon = {k: _canon(getattr(config, k)) for k in FINGERPRINT_FIELDS}
    if extra:
        canon["extra"] = _canon(dict(extra))
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return f"{config.model_type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
