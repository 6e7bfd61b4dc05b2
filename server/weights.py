"""Weight checks and writes: a new draft or policy checked, then written into the running engine
between steps through vLLM's own load path.

Draft swap. A new checkpoint is read into memory once and checked (`load_checked`, or
`open_draft` for a swap: the checks of `codraft.draft.load_draft` by `codraft.server.draft_read`;
the bytes hashed are the bytes loaded, hashed in a thread meanwhile): files present, sha256 as
recorded (and as the caller says), tensor names/shapes/dtypes, d2t/t2d, the contract of the
serving engine (target hidden size and vocab, tap layers, the running draft's geometry, the
target fingerprint when the checkpoint records one) and every other config field the running
drafter baked in (intermediate size, norm eps, rope). Only then are the weights written into the
running drafter with vLLM's in-place reload (`model_loader.reload.inplace.reload_weights`:
vLLM's own `load_weights` plus post-load processing such as the CPU build's repacking), which
runs inside an RPC, i.e. between engine steps. The previous draft's weights stay in memory for
rollback; if writing the new weights fails, the previous ones are written back.

Policy reload. A new target folder must have the serving target's architecture (same
`model_fingerprint`), exactly its tensor names, shapes and dtypes (floats may differ in
width) in every shard's header, files as long as their headers say, and finite values (read
in a pre-pass over every shard for a policy up to `verify_max_bytes()`, so a bad second shard
is refused before the first is written; a larger one is checked tensor by tensor as it
streams); then `GPUModelRunner.reload_weights` streams it in place. The KV prefix cache
computed with the old weights must be reset by the engine's owner afterwards
(`reset_prefix_cache`); requests in flight during a policy reload see mixed weights.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import safetensors.torch
import torch
from safetensors import safe_open

from codraft.draft.checkpoint import (
    CONFIG_NAME,
    META_NAME,
    WEIGHTS_NAME,
    AnyDraftConfig,
    DraftCheckpointError,
    DraftContract,
    DraftMeta,
    config_from_hf,
    sha256_file,
)
from codraft.models.config import TargetConfig
from codraft.models.llama import safetensors_files
from codraft.server.draft_read import BufferPool, CheckedWeights, read_checked
from codraft.tap import model_fingerprint

log = logging.getLogger(__name__)


def _baked(cfg: AnyDraftConfig) -> tuple[str, ...]:
    """Config fields a running vLLM drafter has baked in; a new draft must agree on all."""
    return tuple(f.name for f in fields(cfg) if f.name != "dtype")


class SwapError(Exception):
    """A request the engine refuses; `status` is the HTTP status the control API returns."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------- drafts
@dataclass
class DraftSlot:
    """A draft the engine serves or keeps for rollback."""

    version: int
    sha256: str
    path: str
    loaded_at: str
    config: AnyDraftConfig
    weights: dict[str, torch.Tensor]  # checkpoint names, CPU tensors (dropped once staged)
    kernels: Any = field(default=None, repr=False)  # codraft.server.draft_kernels.KernelState

    def info(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "sha256": self.sha256,
            "path": self.path,
            "loaded_at": self.loaded_at,
            "kind": self.config.kind,
            "tap_layers": list(self.config.tap_layers),
        }


def load_checked(
    root: Path, expect: DraftContract | None = None
) -> tuple[AnyDraftConfig, DraftMeta, dict[str, torch.Tensor]]:
    """`codraft.draft.load_draft` without building the draft model: the same checks with the
    same messages (config, sidecar, contract, header and length, sha256, tensor names/shapes/
    dtypes, d2t/t2d) in one read of the weights, whose bytes are the ones loaded
    (`codraft.server.draft_read`). Building the model would cost more than the rest of a swap (it
    initialises every weight on the CPU). Raises DraftCheckpointError."""
    checked = read_checked(root, expect)
    checked.verify_sha()
    return checked.cfg, checked.meta, checked.tensors


def read_initial_draft(path: str) -> DraftSlot:
    """The draft vLLM loaded at start: a codraft checkpoint (version from codraft.json), or any
    EAGLE-3 or DFlash folder (version 0)."""
    root = Path(path)
    try:
        cfg, meta, weights = load_checked(root)
        return DraftSlot(meta.version, meta.weights_sha256, str(root), utc_now(), cfg, weights)
    except DraftCheckpointError as e:
        log.warning("initial draft %s is no complete codraft checkpoint (%s): version 0", path, e)
    cfg = config_from_hf(json.loads((root / CONFIG_NAME).read_text()))
    weights = root / WEIGHTS_NAME
    return DraftSlot(
        0, sha256_file(weights), str(root), utc_now(), cfg, safetensors.torch.load_file(weights)
    )


@dataclass
class OpenedDraft:
    """A new draft that passed every check but the checksum, still being computed: `slot`'s
    weights must not be installed before `verify()` has returned."""

    slot: DraftSlot
    checked: CheckedWeights

    def verify(self) -> None:
        _verify_sha(self.checked)


def _verify_sha(checked: CheckedWeights) -> None:
    try:
        checked.verify_sha()
    except DraftCheckpointError as e:
        raise SwapError(422, f"draft checkpoint rejected: {e}") from None


def open_draft(
    path: str,
    version: int | None,
    sha256: str | None,
    running: DraftSlot,
    fingerprint: str | None,
    pool: BufferPool | None = None,
) -> OpenedDraft:
    """Read and check a new checkpoint against the running draft (see module doc), its sha256
    computed in a thread meanwhile; `version` None takes codraft.json's. Raises SwapError 404
    (no such path) or 422 (anything wrong with the checkpoint)."""
    root = Path(path)
    if not root.exists():
        raise SwapError(404, f"draft checkpoint not found: {path} does not exist")
    contract = DraftContract.of(running.config, exact=True)
    contract = DraftContract(**{**vars(contract), "target_fingerprint": fingerprint})
    try:
        checked = read_checked(root, contract, pool)
    except DraftCheckpointError as e:
        raise SwapError(422, f"draft checkpoint rejected: {e}") from None
    try:
        _check_fits(checked.cfg, checked.meta, root, version, sha256, running)
    except BaseException:
        try:  # a checksum error comes first, as in load_checked
            _verify_sha(checked)
        finally:
            checked.release()
        raise
    meta = checked.meta
    slot = DraftSlot(
        meta.version, meta.weights_sha256, str(root), utc_now(), checked.cfg, checked.tensors
    )
    return OpenedDraft(slot, checked)


def check_load_args(path: Any, version: Any, sha256: Any) -> tuple[str, int | None, str | None]:
    """A draft load's arguments as the control API passes them; 422 for malformed ones."""
    if not isinstance(path, str) or not path:
        raise SwapError(422, f"path must be a non-empty string, got {path!r}")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or version < 0
    ):
        raise SwapError(422, f"version must be a non-negative integer or null, got {version!r}")
    if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64):
        raise SwapError(422, f"sha256 must be 64 hex digits or null, got {sha256!r}")
    return path, version, sha256


# How far one load may move a version forward. Versions only grow, so a single jump to the top
# of the range (2**53 - 1, the largest the control API takes) would refuse every later publish.
MAX_VERSION_STEP = 1_000_000


def check_version_step(kind: str, version: int, floor: int) -> None:
    """422 when `version` lies more than MAX_VERSION_STEP above `floor` (the highest draft
    installed, or the serving policy's version)."""
    if version > floor + MAX_VERSION_STEP:
        raise SwapError(
            422,
            f"{kind} version {version} is more than {MAX_VERSION_STEP} above v{floor}, the "
            f"{'highest installed' if kind == 'draft' else 'serving'} one: versions count "
            f"publishes, number this one {floor + 1} (up to {floor + MAX_VERSION_STEP})",
        )


def check_newer(version: int, highest: int, current: int) -> None:
    """409 unless `version` is above `highest`, the highest an engine has installed (a rollback
    makes an older draft current, and a version must still name one draft only: responses and
    per-version metrics carry it); 422 for a jump past MAX_VERSION_STEP."""
    check_version_step("draft", version, highest)
    if version <= highest:
        after = "" if highest == current else f", though v{current} serves after a rollback"
        raise SwapError(
            409,
            f"draft version {version} is not newer than v{highest}, the highest this "
            f"server has installed{after}: number the draft {highest + 1} or higher",
        )


def check_request(
    root: Path, found_version: int, found_sha256: str, version: int | None, sha256: str | None
) -> None:
    """The checkpoint's own version and sha256 against what the request says (None: anything);
    422 when they differ."""
    if version is not None and found_version != version:
        raise SwapError(
            422,
            f"{root / META_NAME} records version {found_version}, the request says {version}: "
            "publish each version in its own checkpoint directory",
        )
    if sha256 is not None and sha256.lower() != found_sha256:
        raise SwapError(
            422,
            f"sha256 mismatch: the request expects {sha256}, {root / WEIGHTS_NAME} is "
            f"{found_sha256}",
        )


def _check_fits(
    cfg: AnyDraftConfig,
    meta: DraftMeta,
    root: Path,
    version: int | None,
    sha256: str | None,
    running: DraftSlot,
) -> None:
    check_request(root, meta.version, meta.weights_sha256, version, sha256)
    differ = [
        f"{name}: expected {getattr(running.config, name)!r}, found {getattr(cfg, name)!r}"
        for name in _baked(running.config)
        if getattr(cfg, name) != getattr(running.config, name)
    ]
    if differ:
        raise SwapError(
            422,
            f"draft checkpoint rejected: {root}: config differs from the running draft, which "
            "cannot change shape or constants in place: " + "; ".join(differ),
        )


class _DropSharedWarnings(logging.Filter):
    """The drafter shares the target's embedding (and keeps its rotary tables): vLLM's reload
    warns that it found no weights for them, which is expected here."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (
            "Failed to load weights" in text or "weights were not loaded from checkpoint" in text
        )


@contextlib.contextmanager
def _quiet_shared_warnings() -> Iterator[None]:
    names = (
        "vllm.model_executor.model_loader.reload.layerwise",
        "vllm.model_executor.model_loader.reload.inplace",
    )
    filt = _DropSharedWarnings()
    loggers = [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(filt)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(filt)


def write_draft_weights(runner: Any, vllm_config: Any, weights: dict[str, torch.Tensor]) -> None:
    """Write checkpoint-format draft weights into the running drafter, in place."""
    from vllm.config import set_current_vllm_config

    from codraft.server.compat import reload_weights_inplace as reload_weights  # per vLLM release
    from codraft.server.hooks import drafter_model

    spec = vllm_config.speculative_config
    # reload_weights reads model_config, load_config and lora_config of the config it is given:
    # the drafter's model config, the engine's load config, no LoRA on the drafter.
    draft_config = SimpleNamespace(
        model_config=spec.draft_model_config, load_config=vllm_config.load_config, lora_config=None
    )
    from codraft.server.draft_kernels import derived_tensors, rebuild_derived

    model = drafter_model(runner)
    with set_current_vllm_config(vllm_config), _quiet_shared_warnings(), torch.inference_mode():
        reload_weights(draft_config, model, iter(weights.items()), None, True)
        if derived_tensors(model):  # DFlash's fused context K/V: see rebuild_derived
            rebuild_derived(model, weights)


# ---------------------------------------------------------------------------- policy
@dataclass
class PolicySlot:
    version: int
    path: str
    loaded_at: str

    def info(self) -> dict[str, Any]:
        return {"version": self.version, "path": self.path, "loaded_at": self.loaded_at}


_ST_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def safetensors_layout(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of a safetensors file, checking that the file is as long as its
    header says (a truncated or padded file is refused before any tensor is read)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: {size} bytes, not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{file}: header length {n} does not fit a {size}-byte file")
        header = json.loads(f.read(n))
    out, end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info["dtype"], tuple(info["shape"])
        begin, stop = info["data_offsets"]
        itemsize = _ST_ITEMSIZE.get(dtype)
        if itemsize is not None and stop - begin != itemsize * math.prod(shape):
            raise ValueError(
                f"{file}: tensor {name} spans {stop - begin} bytes, expected "
                f"{itemsize * math.prod(shape)} for {dtype} {list(shape)}"
            )
        out[name] = (dtype, shape)
        end = max(end, stop)
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "longer than its header says"
        raise ValueError(f"{file}: {what} ({size} bytes, header describes {8 + n + end})")
    return out


def folder_layout(path: Path) -> tuple[list[Path], dict[str, tuple[str, tuple[int, ...]]]]:
    files = safetensors_files(path)
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        layout.update(safetensors_layout(file))
    return files, layout


_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
VERIFY_MAX_BYTES_ENV = "CODRAFT_POLICY_VERIFY_MAX_BYTES"
VERIFY_MAX_BYTES = 64 << 30  # policies up to this size have every value read before the load


def verify_max_bytes() -> int:
    """The largest policy (bytes of its weight files) whose values are all checked before the
    first write: `CODRAFT_POLICY_VERIFY_MAX_BYTES` in the engine's environment, else
    VERIFY_MAX_BYTES. A larger policy has its values checked tensor by tensor as it streams
    (then a bad value in a later shard is found after earlier ones were written, and the
    previous policy must be restored)."""
    raw = os.environ.get(VERIFY_MAX_BYTES_ENV)
    if raw is None:
        return VERIFY_MAX_BYTES
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("%s=%r is no integer; using %d", VERIFY_MAX_BYTES_ENV, raw, VERIFY_MAX_BYTES)
        return VERIFY_MAX_BYTES


def policy_broken_message(what: str, transfer: bool = False) -> str:
    """What a client is told while the target's weights are undefined (a failed policy load
    that could not be restored, or a failed policy weight transfer)."""
    fix = "complete a policy weight transfer, " if transfer else ""
    return (
        f"{what}: the target's weights are undefined and generation is refused; load a good "
        f"policy (POST /v1/policy with a newer version), {fix}or restart the server"
    )


def _layout_problems(
    layout: dict[str, tuple[str, tuple[int, ...]]], want: dict[str, tuple[str, tuple[int, ...]]]
) -> list[str]:
    missing = sorted(set(want) - set(layout))
    extra = sorted(set(layout) - set(want))
    common = sorted(set(want) & set(layout))
    shapes = [
        f"{k} {list(layout[k][1])} (expected {list(want[k][1])})"
        for k in common
        if layout[k][1] != want[k][1]
    ]
    dtypes = [
        f"{k} {layout[k][0]} (expected {want[k][0]})"
        for k in common
        if layout[k][0] != want[k][0] and not {layout[k][0], want[k][0]} <= _FLOATS
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}")
    if extra:
        problems.append(f"unexpected tensors {extra[:8]}")
    if shapes:
        problems.append(f"wrong shapes {shapes[:8]}")
    if dtypes:
        problems.append(f"wrong dtypes {dtypes[:8]}")
    return problems


def check_policy(path: str, serving: dict[str, Any]) -> list[Path]:
    """Check a policy folder against the serving target; return its weight files.

    Nothing is written before all of it passed: the architecture (fingerprint), every shard's
    header (tensor names, shapes and dtypes against the serving layout; a float tensor may
    come in another float dtype, vLLM converts it; files as long as their headers say), and,
    for a policy of up to `verify_max_bytes()`, every value (finite), all shards read once
    here and once more by the load (the page cache usually serves the second read).
    `serving` holds "fingerprint" and "layout" (name -> (dtype, shape)) of the serving target.
    Raises SwapError 404 / 422."""
    root = Path(path)
    if not root.exists():
        raise SwapError(404, f"policy folder not found: {path} does not exist")
    try:
        cfg = TargetConfig.from_pretrained(root)
        fp = model_fingerprint(cfg)
    except (OSError, ValueError, TypeError) as e:
        raise SwapError(422, f"policy {path}: unusable config.json: {e}") from None
    if fp != serving["fingerprint"]:
        raise SwapError(
            422,
            f"policy {path} has another architecture than the serving target: fingerprint "
            f"{fp}, expected {serving['fingerprint']} (a policy must keep the target's shapes)",
        )
    try:
        files, layout = folder_layout(root)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise SwapError(422, f"policy {path}: unreadable weights: {e}") from None
    want = serving.get("layout")
    if want:
        problems = _layout_problems(layout, want)
        if problems:
            raise SwapError(
                422, f"policy {path} does not fit the serving target: " + "; ".join(problems)
            )
    size = sum(f.stat().st_size for f in files)
    if size <= verify_max_bytes():
        try:
            for _ in _stream(files):  # each tensor checked as it is read (see _stream)
                pass
        except (OSError, ValueError, RuntimeError) as e:
            raise SwapError(
                422, f"policy {path} refused before any weight was written: {e}"
            ) from None
    return files


def check_finite(file: Path, name: str, tensor: torch.Tensor) -> None:
    """ValueError naming the tensor when a floating-point one holds NaN or Inf."""
    if tensor.is_floating_point() and tensor.numel() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(
            f"{file.name}: tensor {name} holds {bad} NaN or Inf value(s) of {tensor.numel()}; "
            "a policy's weights must be finite"
        )


def _stream(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `files`, each checked finite (ValueError) before it is handed on."""
    for file in files:
        with safe_open(str(file), framework="pt") as sf:
            for name in sf.keys():
                tensor = sf.get_tensor(name)
                check_finite(file, name, tensor)
                yield name, tensor


def write_policy_weights(runner: Any, vllm_config: Any, files: list[Path]) -> None:
    """Stream target weights into the running target, in place (a non-finite tensor stops the
    stream with ValueError: the caller restores the previous policy)."""
    from vllm.config import set_current_vllm_config

    from codraft.server.hooks import target_model

    with set_current_vllm_config(vllm_config), torch.inference_mode():
        try:
            runner.reload_weights(
                weights_iterator=_stream(files), weights_path=None, is_checkpoint_format=True
            )
        except BaseException:
            _end_interrupted_reload(runner.get_model(), vllm_config)
            raise
        retie_lm_head(target_model(runner), vllm_config)


def _end_interrupted_reload(model: Any, vllm_config: Any) -> None:
    """vLLM's layerwise reload puts every layer on the meta device and buffers its weights
    until the layer has them all; a stream that stops midway (a bad tensor) leaves the layers
    not yet complete on meta, with wrapped loaders, and a second reload (the restore) then
    fails on them. Finish the reload as vLLM would: layers that got no weight take their
    kernel tensors back (the old weights), partly loaded ones are processed as they are (the
    restore rewrites them)."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(model, vllm_config.model_config)
    except Exception:
        log.exception("codraft: finishing an interrupted policy reload failed")


def retie_lm_head(model: Any, vllm_config: Any) -> None:
    """After a reload, make a tied lm_head serve the new embedding.

    A tied checkpoint has no lm_head tensor, so the reload never visits the head: its weight
    may still be the old tensor, and on CPU its GEMM holds a packed copy made at load time
    (`cpu_linear`). Copy the embedding in when the storage differs, then let the head's
    method rebuild whatever it derived from its weight."""
    if not getattr(vllm_config.model_config.hf_config, "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "weight"):
        return
    if head.weight.data_ptr() != embed.weight.data_ptr():
        head.weight.data.copy_(embed.weight.data)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def serving_target(vllm_config: Any) -> dict[str, Any]:
    """Fingerprint and tensor layout of the target vLLM was started with."""
    mc = vllm_config.model_config
    return target_at(mc.model, mc.hf_config.to_dict)


def target_at(model: str | os.PathLike, hf_config: Callable[[], dict]) -> dict[str, Any]:
    """Fingerprint and tensor layout of the target an engine serves from `model`: a folder, or
    a hub id (then `hf_config()`, the config the engine resolved, and no layout)."""
    root = Path(model)
    if (root / "config.json").is_file():
        fingerprint = model_fingerprint(root)
        try:
            layout = folder_layout(root)[1]
        except (OSError, ValueError, KeyError):
            layout = {}
    else:
        fingerprint = model_fingerprint(hf_config())
        layout = {}
    return {"path": os.fspath(model), "fingerprint": fingerprint, "layout": layout}
