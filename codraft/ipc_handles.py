"""CUDA IPC handles as JSON: how a trainer on the same GPU hands codraft serve its weights
without pickle.

vLLM's IPC weight-transfer backend ships each tensor as the arguments of
`torch.multiprocessing.reductions.rebuild_cuda_tensor` (what `reduce_tensor` returns: classes,
a dtype, byte strings, sizes), and over HTTP its client pickles them (`ipc_handles_pickled`,
which vLLM only reads with VLLM_ALLOW_INSECURE_SERIALIZATION=1). codraft takes no pickle over
the network, so the same arguments travel as plain JSON (`ipc_handles_json`): numbers, lists,
base64 bytes and the dtype's name, checked field by field, and rebuilt into the argument tuple
only from an allow-list of types. Nothing in a handle can name code to run.

One handle (per tensor, or per packed buffer) is ``{gpu_uuid: args}``; `encode_args` and
`decode_args` convert one args tuple; `encode_handles` / `decode_handles` a whole
`ipc_handles` value (a list of handles, one per tensor, or one handle of a packed buffer).
"""

from __future__ import annotations

import base64
from typing import Any

import torch

KEY = "ipc_handles_json"
MAX_HANDLES = 1 << 16  # tensors in one update chunk
MAX_DIMS = 16
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
        "bool", "float8_e4m3fn", "float8_e5m2",
    )
}  # fmt: skip
# reduce_tensor names the tensor's TypedStorage; the rebuild reads either the same way, and
# TypedStorage is what it is given back (its IPC class methods are the ones torch calls)
_STORAGES = (torch.storage.TypedStorage, torch.UntypedStorage)
_BYTES = ("handle", "ref_counter_handle", "event_handle")
_INTS = ("offset", "device", "storage_size", "storage_offset", "ref_counter_offset")
_FIELDS = frozenset(("size", "stride", "requires_grad", "event_sync_required", *_BYTES, *_INTS))


class HandleError(ValueError):
    """A JSON IPC handle that is not one: what was expected, what came."""


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def encode_args(args: tuple) -> dict[str, Any]:
    """`reduce_tensor(t)[1]` (rebuild_cuda_tensor's 15 arguments) as JSON types."""
    if len(args) != 15:
        raise HandleError(f"expected rebuild_cuda_tensor's 15 arguments, got {len(args)}")
    (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
     requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        raise HandleError(f"tensor class {cls!r}: only torch.Tensor and Parameter travel")
    if storage_cls not in _STORAGES:
        raise HandleError(f"storage class {storage_cls!r}: only {_STORAGES} travel")
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise HandleError(f"dtype {dtype}: not one of {sorted(_DTYPES)}")
    return {
        "size": list(size), "stride": list(stride), "offset": int(offset), "dtype": name,
        "device": int(device), "handle": _b64(handle), "storage_size": int(storage_size),
        "storage_offset": int(storage_offset), "requires_grad": bool(requires_grad),
        "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": int(ref_offset),
        "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync),
    }  # fmt: skip


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise HandleError(f"{key} must be a non-negative integer, got {v!r}")
    return v


def _ints(d: dict, key: str) -> list[int]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > MAX_DIMS:
        raise HandleError(f"{key} must be a list of at most {MAX_DIMS} integers, got {v!r}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise HandleError(f"{key} must hold non-negative integers, got {v!r}")
    return v


def _bytes(d: dict, key: str, optional: bool = False) -> bytes | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > 4096:
        raise HandleError(f"{key} must be base64 text (at most 4096 characters), got {v!r}")
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:
        raise HandleError(f"{key} is not valid base64") from None


def decode_args(d: Any) -> tuple:
    """The JSON form back into rebuild_cuda_tensor's arguments, checked."""
    if not isinstance(d, dict):
        raise HandleError(f"an IPC handle's arguments must be an object, got {type(d).__name__}")
    extra = set(d) - _FIELDS - {"dtype"}
    missing = (_FIELDS | {"dtype"}) - set(d)
    if extra or missing:
        raise HandleError(
            f"IPC handle fields: unexpected {sorted(extra)}, missing {sorted(missing)}"
        )
    dtype = _DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise HandleError(f"dtype {d['dtype']!r}: not one of {sorted(_DTYPES)}")
    for key in ("requires_grad", "event_sync_required"):
        if not isinstance(d[key], bool):
            raise HandleError(f"{key} must be true or false, got {d[key]!r}")
    return (
        torch.Tensor, torch.Size(_ints(d, "size")), tuple(_ints(d, "stride")), _int(d, "offset"),
        torch.storage.TypedStorage, dtype, _int(d, "device"), _bytes(d, "handle"),
        _int(d, "storage_size"), _int(d, "storage_offset"), d["requires_grad"],
        _bytes(d, "ref_counter_handle", optional=True), _int(d, "ref_counter_offset"),
        _bytes(d, "event_handle", optional=True), d["event_sync_required"],
    )  # fmt: skip


def _handle(value: Any, convert) -> dict[str, Any]:
    if not isinstance(value, dict) or not value or len(value) > 64:
        raise HandleError("an IPC handle must map 1..64 GPU UUIDs to arguments")
    out = {}
    for uuid, args in value.items():
        if not isinstance(uuid, str) or not 0 < len(uuid) <= 128:
            raise HandleError(f"GPU UUID {uuid!r}: expected a string of 1..128 characters")
        out[uuid] = convert(args)
    return out


def encode_handles(ipc_handles: list[dict] | dict) -> list[dict] | dict:
    """vLLM's `ipc_handles` (a list of {uuid: args}, or one for a packed buffer) as JSON."""
    if isinstance(ipc_handles, dict):
        return _handle(ipc_handles, encode_args)
    return [_handle(h, encode_args) for h in ipc_handles]


def decode_handles(value: Any) -> list[dict] | dict:
    """`ipc_handles_json` back into vLLM's `ipc_handles`, every field checked."""
    if isinstance(value, dict):
        return _handle(value, decode_args)
    if not isinstance(value, list) or len(value) > MAX_HANDLES:
        raise HandleError(f"{KEY} must be a list of at most {MAX_HANDLES} handles, or one handle")
    return [_handle(h, decode_args) for h in value]
