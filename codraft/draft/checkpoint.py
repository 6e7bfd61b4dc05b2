"""Draft checkpoints: the folder stock vLLM / SGLang load, plus codraft's sidecar.

A checkpoint is a directory holding

* `config.json`        the draft's config as the engine reads it: `DraftConfig.to_hf_dict()`
                       for an EAGLE-3 draft (architectures ["LlamaForCausalLMEagle3"]),
                       `DFlashConfig.to_hf_dict()` for a DFlash block drafter
                       (["DFlashDraftModel"]), `DSparkConfig.to_hf_dict()` for a DSpark
                       drafter (["Qwen3DSparkModel"]); the architecture names the kind
* `model.safetensors`  EAGLE-3: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t (int64),
                       t2d (bool); no embed_tokens (shared with the target). With a full-vocab
                       draft (draft_vocab_size == vocab_size) d2t/t2d are left out, because vLLM
                       then has no parameter to load d2t into and refuses the checkpoint.
                       DFlash: fc.weight, hidden_norm.weight, layers.{i}.*, norm.weight; no
                       embedding and no lm_head (both the target's). DSpark: DFlash's
                       tensors plus markov_head.markov_w1.weight and markov_w2.weight.
* `codraft.json`       `DraftMeta`: versions, tap layers, sha256 of model.safetensors, counters.

It is written into a temp dir and renamed into place (codraft.atomic), so a reader never sees a
partial one. `check_draft` validates a checkpoint without building the model (the server calls
it before a swap); `load_draft` validates and loads. Every failure is a `DraftCheckpointError`
naming the file, what was expected and what was found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import struct
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import safetensors.torch
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from codraft.atomic import atomic_write_dir
from codraft.draft.config import DraftConfig, dtype_name
from codraft.draft.dflash import DFlashDraft
from codraft.draft.dflash_config import DFLASH_ARCHITECTURE, DFlashConfig
from codraft.draft.dspark import DSparkDraft
from codraft.draft.dspark_config import DSPARK_ARCHITECTURE, DSparkConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import check_vocab_maps, identity_maps

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
META_NAME = "codraft.json"
META_SCHEMA = "codraft.draft.v1"
_ST_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
AnyDraftConfig = DraftConfig | DFlashConfig
# A draft's safetensors header names ~15 tensors in about 2 KB; a header larger than this is
# refused before it is read (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 1 << 20


class DraftCheckpointError(ValueError):
    """A draft checkpoint is missing, unreadable, corrupt, or does not fit its consumer."""


def _fail(where: Path | str, msg: str) -> NoReturn:
    raise DraftCheckpointError(f"{where}: {msg}")


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------------------- sidecar
@dataclass
class DraftMeta:
    """codraft.json: where a draft comes from. save_draft fills tap_layers, weights_sha256 and
    created_at (when empty)."""

    version: int = 0
    parent_version: int | None = None
    policy_version: int = 0
    tap_layers: tuple[int, ...] = ()
    target_fingerprint: str | None = None
    weights_sha256: str = ""
    created_at: str = ""
    counters: dict[str, int | float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tap_layers"] = list(self.tap_layers)
        return {"schema": META_SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftMeta:
        """Validate and build; raises ValueError naming the offending field."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, found {type(d).__name__}")
        if d.get("schema", META_SCHEMA) != META_SCHEMA:
            raise ValueError(f"schema is {d.get('schema')!r}, expected {META_SCHEMA!r}")
        for name in ("version", "policy_version"):
            if not _is_int(d.get(name, 0)) or d.get(name, 0) < 0:
                raise ValueError(f"{name} must be a non-negative int, found {d.get(name)!r}")
        parent = d.get("parent_version")
        if parent is not None and (not _is_int(parent) or parent < 0):
            raise ValueError(f"parent_version must be a non-negative int or null, found {parent!r}")
        taps = d.get("tap_layers", [])
        if not isinstance(taps, list | tuple) or not all(_is_int(t) for t in taps):
            raise ValueError(f"tap_layers must be a list of ints, found {taps!r}")
        sha = d.get("weights_sha256", "")
        if not isinstance(sha, str) or (
            sha and (len(sha) != 64 or set(sha) - set("0123456789abcdef"))
        ):
            raise ValueError(f"weights_sha256 must be 64 lowercase hex digits, found {sha!r}")
        fp = d.get("target_fingerprint")
        if fp is not None and not isinstance(fp, str):
            raise ValueError(f"target_fingerprint must be a string or null, found {fp!r}")
        counters = d.get("counters", {})
        if not isinstance(counters, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in counters.items()
        ):
            raise ValueError(f"counters must map names to numbers, found {counters!r}")
        return cls(
            version=d.get("version", 0),
            parent_version=parent,
            policy_version=d.get("policy_version", 0),
            tap_layers=tuple(taps),
            target_fingerprint=fp,
            weights_sha256=sha,
            created_at=str(d.get("created_at", "")),
            counters=dict(counters),
        )


# ---------------------------------------------------------------------------- contract
@dataclass(frozen=True)
class DraftContract:
    """What a consumer (the server, the learner resuming) requires of a draft checkpoint.
    Fields left None are not checked."""

    target_hidden_size: int
    target_vocab_size: int
    tap_layers: tuple[int, ...]
    kind: str | None = None  # "eagle3", "dflash" or "dspark"
    draft_vocab_size: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    target_fingerprint: str | None = None

    @classmethod
    def of(cls, cfg: AnyDraftConfig, *, exact: bool = True) -> DraftContract:
        """The contract a draft with config `cfg` satisfies (exact: also its whole geometry)."""
        geometry = dict(
            draft_vocab_size=cfg.draft_vocab_size,
            hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
        )
        return cls(
            target_hidden_size=cfg.target_hidden_size,
            target_vocab_size=cfg.vocab_size,
            tap_layers=tuple(cfg.tap_layers),
            kind=cfg.kind,
            **(geometry if exact else {}),
        )

    def problems(self, cfg: AnyDraftConfig, meta: DraftMeta | None = None) -> list[str]:
        """Every way `cfg` (and `meta`) breaks the contract, as 'what: expected X, found Y'."""
        pairs = [
            ("drafter kind", self.kind, cfg.kind),
            ("target hidden size", self.target_hidden_size, cfg.target_hidden_size),
            ("target vocab size", self.target_vocab_size, cfg.vocab_size),
            ("tap layers", list(self.tap_layers), list(cfg.tap_layers)),
            ("draft vocab size", self.draft_vocab_size, cfg.draft_vocab_size),
            ("hidden size", self.hidden_size, cfg.hidden_size),
            ("attention heads", self.num_attention_heads, cfg.num_attention_heads),
            ("kv heads", self.num_key_value_heads, cfg.num_key_value_heads),
            ("head dim", self.head_dim, cfg.head_dim),
        ]
        if meta is not None and meta.target_fingerprint is not None:
            pairs.append(("target fingerprint", self.target_fingerprint, meta.target_fingerprint))
        return [
            f"{what}: expected {want}, found {got}"
            for what, want, got in pairs
            if want is not None and want != got
        ]


# ---------------------------------------------------------------------------- save
def config_from_hf(hf: Any) -> AnyDraftConfig:
    """The draft config of a config.json, by its architecture (DFlash, DSpark or EAGLE-3)."""
    archs = (hf.get("architectures") or []) if isinstance(hf, dict) else []
    if DSPARK_ARCHITECTURE in archs:
        return DSparkConfig.from_hf_dict(hf)
    if DFLASH_ARCHITECTURE in archs:
        return DFlashConfig.from_hf_dict(hf)
    if not isinstance(hf, dict):
        raise ValueError(f"expected a JSON object, found {type(hf).__name__}")
    return DraftConfig.from_hf_dict(hf)


def _dflash_tensors(cfg: DFlashConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    H, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((H, cfg.num_taps * cfg.target_hidden_size), None),
        "hidden_norm.weight": ((H,), None),
        "norm.weight": ((H,), None),
    }
    for i in range(cfg.num_hidden_layers):
        for name, shape in (
            ("input_layernorm", (H,)), ("post_attention_layernorm", (H,)),
            ("self_attn.q_proj", (q, H)), ("self_attn.k_proj", (kv, H)),
            ("self_attn.v_proj", (kv, H)), ("self_attn.o_proj", (H, q)),
            ("self_attn.q_norm", (hd,)), ("self_attn.k_norm", (hd,)),
            ("mlp.gate_proj", (inter, H)), ("mlp.up_proj", (inter, H)),
            ("mlp.down_proj", (H, inter)),
        ):  # fmt: skip
            out[f"layers.{i}.{name}.weight"] = (shape, None)
    if isinstance(cfg, DSparkConfig):
        for name in ("markov_w1", "markov_w2"):
            out[f"markov_head.{name}.weight"] = ((cfg.vocab_size, cfg.markov_rank), None)
    return out


def expected_tensors(
    cfg: AnyDraftConfig,
) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Checkpoint tensor name -> (shape, dtype); dtype None means the draft's float dtype."""
    if isinstance(cfg, DFlashConfig):
        return _dflash_tensors(cfg)
    H, hd = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        "fc.weight": ((H, cfg.num_taps * cfg.target_hidden_size), None),
        "midlayer.input_layernorm.weight": ((H,), None),
        "midlayer.hidden_norm.weight": ((H,), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ((H, q), None),
        "midlayer.post_attention_layernorm.weight": ((H,), None),
        "midlayer.mlp.gate_proj.weight": ((inter, H), None),
        "midlayer.mlp.up_proj.weight": ((inter, H), None),
        "midlayer.mlp.down_proj.weight": ((H, inter), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((cfg.draft_vocab_size, H), None),
    }
    if not cfg.full_vocab:
        out["d2t"] = ((cfg.draft_vocab_size,), torch.int64)
        out["t2d"] = ((cfg.vocab_size,), torch.bool)
    return out


def save_draft(
    out_dir: str | os.PathLike,
    model: Eagle3Draft | DFlashDraft,
    meta: DraftMeta,
    *,
    overwrite: bool = False,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write `model` as a checkpoint directory `out_dir`, atomically; return its path.

    Float tensors are written in `dtype` (default: model.config.dtype) and config.json's
    torch_dtype says so. The sha256 and tap layers recorded in codraft.json are computed here;
    meta.tap_layers, if set, must match the model's.
    """
    out = Path(out_dir)
    cfg = replace(model.config, dtype=dtype_name(dtype or model.config.dtype))
    if meta.tap_layers and tuple(meta.tap_layers) != cfg.tap_layers:
        _fail(
            out,
            f"meta.tap_layers {list(meta.tap_layers)} != model tap layers {list(cfg.tap_layers)}",
        )
    try:
        DraftMeta.from_dict(meta.to_dict())
    except ValueError as e:
        _fail(out, f"invalid {META_NAME} content: {e}")
    want = expected_tensors(cfg)
    tensors = {}
    for name, t in model.state_dict().items():
        if name in ("d2t", "t2d") and cfg.full_vocab:
            continue
        t = t.detach().to("cpu")
        tensors[name] = (t.to(cfg.torch_dtype) if t.is_floating_point() else t).contiguous()
    if set(tensors) != set(want):
        _fail(out, f"model tensors {sorted(tensors)} differ from the format's {sorted(want)}")
    if not cfg.full_vocab:
        check_vocab_maps(tensors["d2t"], tensors["t2d"], cfg.vocab_size, cfg.draft_vocab_size)
    with atomic_write_dir(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        final_meta = replace(
            meta,
            tap_layers=cfg.tap_layers,
            weights_sha256=sha256_file(tmp / WEIGHTS_NAME),
            created_at=meta.created_at or _utc_now(),
        )
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
        (tmp / META_NAME).write_text(json.dumps(final_meta.to_dict(), indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------- checks
def _read_json(path: Path) -> Any:
    if not path.is_file():
        _fail(
            path.parent,
            f"missing file {path.name} (a codraft draft checkpoint holds "
            f"{CONFIG_NAME}, {WEIGHTS_NAME} and {META_NAME})",
        )
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(path, f"unreadable JSON: {e}")


def read_meta(path: str | os.PathLike) -> DraftMeta:
    """The codraft.json sidecar of checkpoint dir `path` (e.g. its sha256 for POST /v1/draft)."""
    file = Path(path) / META_NAME
    try:
        return DraftMeta.from_dict(_read_json(file))
    except DraftCheckpointError:
        raise
    except ValueError as e:
        _fail(file, str(e))


def _read_config_and_meta(
    root: Path, expect: DraftContract | None
) -> tuple[AnyDraftConfig, DraftMeta]:
    if not root.is_dir():
        _fail(root, "checkpoint directory not found" if not root.exists() else "not a directory")
    real_root = root.resolve()
    for name in (CONFIG_NAME, WEIGHTS_NAME, META_NAME):
        if not (root / name).is_file():
            _fail(
                root,
                f"missing file {name} (a codraft draft checkpoint holds "
                f"{CONFIG_NAME}, {WEIGHTS_NAME} and {META_NAME})",
            )
        real = (root / name).resolve()
        if real.parent != real_root:
            _fail(
                root / name,
                f"is a link to {real}, outside the checkpoint folder {real_root}; a checkpoint's "
                "files must lie in its folder (copy the file instead of linking it)",
            )
    try:
        cfg = config_from_hf(_read_json(root / CONFIG_NAME))
    except DraftCheckpointError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        _fail(root / CONFIG_NAME, f"not a usable draft config (EAGLE-3, DFlash or DSpark): {e}")
    meta = read_meta(root)
    if tuple(meta.tap_layers) != cfg.tap_layers:
        _fail(
            root,
            f"tap layers disagree: {CONFIG_NAME} has {list(cfg.tap_layers)}, "
            f"{META_NAME} has {list(meta.tap_layers)}",
        )
    if expect is not None:
        bad = expect.problems(cfg, meta)
        if bad:
            _fail(root, "checkpoint does not fit this consumer: " + "; ".join(bad))
    return cfg, meta


Header = dict[str, tuple[str, tuple[int, ...], int, int]]


def _read_header(f: BinaryIO, size: int, where: Path) -> Header:
    """Parse and check a safetensors header: name -> (dtype, shape, begin, end)."""
    head = f.read(8)
    if len(head) < 8:
        _fail(where, f"truncated or not a safetensors file: {size} bytes, need at least 8")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES and 8 + n <= size:
        _fail(
            where,
            f"safetensors header of {n} bytes; a draft checkpoint's header is at most "
            f"{MAX_HEADER_BYTES} bytes (about 2 KB is usual): not a codraft draft, or corrupt",
        )
    if 8 + n > size:
        _fail(
            where,
            f"truncated or not a safetensors file: header length {n} does not fit "
            f"in the file's {size} bytes",
        )
    try:
        raw = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(where, f"unreadable safetensors header: {e}")
    if not isinstance(raw, dict):
        _fail(where, "unreadable safetensors header: not a JSON object")
    out: Header = {}
    data_end = 0
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            _fail(where, f"unreadable safetensors header entry for {name!r}: {info!r}")
        if dt not in _ST_DTYPES:
            _fail(where, f"tensor {name} has unsupported dtype {dt}")
        nbytes = math.prod(shape) * _ST_DTYPES[dt][1]
        if end - begin != nbytes or begin < 0:
            _fail(where, f"tensor {name}: offsets {begin}..{end} do not hold {list(shape)} {dt}")
        out[name] = (dt, shape, begin, end)
        data_end = max(data_end, end)
    if 8 + n + data_end != size:
        what = "truncated" if 8 + n + data_end > size else "has trailing bytes"
        _fail(where, f"{what}: the header describes {8 + n + data_end} bytes, the file has {size}")
    return out


def _check_tensors(header: Header, cfg: AnyDraftConfig, where: Path) -> torch.dtype:
    """Names, shapes and dtypes against the config; returns the float dtype."""
    want = expected_tensors(cfg)
    if cfg.full_vocab and "d2t" in header:
        _fail(
            where,
            f"d2t present although draft_vocab_size == vocab_size ({cfg.vocab_size}): "
            "vLLM has no draft_id_to_target_id parameter then and refuses the checkpoint; "
            "drop d2t/t2d or use a smaller draft vocab (a DFlash draft has neither)",
        )
    missing = sorted(set(want) - set(header))
    if missing:
        _fail(where, f"missing tensor(s) {missing}")
    extra = sorted(set(header) - set(want))
    if extra:
        _fail(
            where,
            f"unexpected tensor(s) {extra} (expected exactly {sorted(want)}; "
            "embeddings, and a DFlash draft's lm_head, are the target's and never stored)",
        )
    for name, (shape, _) in want.items():
        if header[name][1] != shape:
            _fail(
                where,
                f"tensor {name} has shape {list(header[name][1])}, expected "
                f"{list(shape)} for {CONFIG_NAME}'s geometry",
            )
    for name, (_, dt) in want.items():
        if dt is not None and _ST_DTYPES[header[name][0]][0] != dt:
            _fail(where, f"tensor {name} has dtype {header[name][0]}, expected {dt}")
    floats = {header[n][0] for n, (_, dt) in want.items() if dt is None}
    if len(floats) != 1 or not _ST_DTYPES[next(iter(floats))][0].is_floating_point:
        _fail(where, f"weights must share one float dtype, found {sorted(floats)}")
    dtype = _ST_DTYPES[floats.pop()][0]
    if dtype != cfg.torch_dtype:
        _fail(where, f"tensors are {dtype} but {CONFIG_NAME} says torch_dtype {cfg.dtype}")
    return dtype


def _check_sha(actual: str, meta: DraftMeta, where: Path) -> None:
    if not meta.weights_sha256:
        _fail(where, f"{META_NAME} records no weights_sha256; cannot verify {WEIGHTS_NAME}")
    if actual != meta.weights_sha256:
        _fail(
            where,
            f"sha256 mismatch: {META_NAME} records {meta.weights_sha256}, "
            f"{WEIGHTS_NAME} hashes to {actual}",
        )


def _check_maps(d2t: torch.Tensor, t2d: torch.Tensor, cfg: DraftConfig, where: Path) -> None:
    try:
        check_vocab_maps(d2t, t2d, cfg.vocab_size, cfg.draft_vocab_size)
    except ValueError as e:
        _fail(where, f"d2t/t2d inconsistent: {e}")


def _check_finite(tensors: dict[str, torch.Tensor], where: Path) -> None:
    """Every float weight finite: a NaN or Inf would make every proposal garbage (or NaN
    logits in the engine)."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            _fail(where, f"tensor {name} holds {nan} NaN and {inf} infinite values")


def check_draft(
    path: str | os.PathLike, expect: DraftContract | None = None
) -> tuple[AnyDraftConfig, DraftMeta]:
    """Validate a checkpoint (files, config, sidecar, contract, header, sha256, tensor names,
    shapes, dtypes, d2t/t2d) without building the model or reading the float weights (so
    not whether they are finite: `load_draft` and the server's swap check that too). Raises
    DraftCheckpointError."""
    root = Path(path)
    cfg, meta = _read_config_and_meta(root, expect)
    weights = root / WEIGHTS_NAME
    with open(weights, "rb") as f:
        header = _read_header(f, os.fstat(f.fileno()).st_size, weights)
    _check_sha(sha256_file(weights), meta, weights)
    _check_tensors(header, cfg, weights)
    if not cfg.full_vocab:
        try:
            with safe_open(str(weights), framework="pt") as st:
                d2t, t2d = st.get_tensor("d2t"), st.get_tensor("t2d")
        except Exception as e:  # safetensors raises its own error types
            _fail(weights, f"unreadable safetensors file: {e}")
        _check_maps(d2t, t2d, cfg, weights)
    return cfg, meta


def load_draft(
    path: str | os.PathLike,
    *,
    expect: DraftContract | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Eagle3Draft | DFlashDraft, DraftMeta]:
    """Validate (as check_draft) and load a checkpoint; the weights are read once, so the
    verified bytes are the loaded bytes. The model is in the stored dtype; call
    `set_embedding` (EAGLE-3) or `set_target_head` (DFlash) before use."""
    root = Path(path)
    cfg, meta = _read_config_and_meta(root, expect)
    weights = root / WEIGHTS_NAME
    try:
        data = weights.read_bytes()
    except OSError as e:
        _fail(weights, f"unreadable: {e}")
    header = _read_header(io.BytesIO(data), len(data), weights)
    _check_sha(hashlib.sha256(data).hexdigest(), meta, weights)
    dtype = _check_tensors(header, cfg, weights)
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own error types
        _fail(weights, f"unreadable safetensors file: {e}")
    _check_finite(tensors, weights)
    if isinstance(cfg, DFlashConfig):
        cls = DSparkDraft if isinstance(cfg, DSparkConfig) else DFlashDraft
        model: Eagle3Draft | DFlashDraft = cls(cfg, dtype=dtype, device="meta")
        model.load_state_dict(tensors, strict=True, assign=True)
        return model.to(device), meta
    if cfg.full_vocab:
        tensors["d2t"], tensors["t2d"] = identity_maps(cfg.draft_vocab_size, cfg.vocab_size)
    _check_maps(tensors["d2t"], tensors["t2d"], cfg, weights)
    model = Eagle3Draft(cfg, dtype=dtype, device="meta")
    model.load_state_dict(tensors, strict=True, assign=True)
    return model.to(device), meta
