"""vLLM's IPC weight-transfer backend, reading CUDA IPC handles as JSON (`codraft.ipc_handles`).

`codraft serve --weight-transfer ipc` runs vLLM with this backend, registered as
`codraft_ipc` by codraft's plugin in every engine process: it is vLLM's `ipc` engine (same init,
same layerwise reload, same packed and unpacked transfers) whose update info takes
`ipc_handles_json` instead of `ipc_handles_pickled`, so no pickle crosses the HTTP route.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from codraft.ipc_handles import KEY, decode_handles

NAME = "codraft_ipc"
IPC_ENGINE = "vllm.distributed.weight_transfer.ipc_engine"


def import_without(module: str, missing: str) -> types.ModuleType:
    """Import `module` even when the package `missing`, which it imports at the top but uses
    only on paths this process never takes, is not installed: the import sees a placeholder
    that raises on first use, and the placeholder leaves `sys.modules` at once, so no other
    import finds it. (vLLM 0.26's IPC engine imports ray for the trainer's ray send mode.)"""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != missing:
            raise
    placeholder = types.ModuleType(missing)

    def absent(attr: str) -> Any:
        raise ModuleNotFoundError(
            f"{module} used {missing}.{attr}, and {missing} is not installed", name=missing
        )

    placeholder.__getattr__ = absent  # type: ignore[method-assign]
    sys.modules[missing] = placeholder
    try:
        return importlib.import_module(module)
    finally:
        if sys.modules.get(missing) is placeholder:
            del sys.modules[missing]


class JsonIPCWeightTransferEngine(import_without(IPC_ENGINE, "ray").IPCWeightTransferEngine):
    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        update = dict(update_dict)
        if "ipc_handles_pickled" in update:
            raise ValueError(
                "ipc_handles_pickled: codraft reads no pickle; send the handles as "
                f"{KEY!r} (codraft.ipc_handles.encode_handles)"
            )
        if KEY in update:
            if update.get("ipc_handles") is not None:
                raise ValueError(f"give either ipc_handles or {KEY}, not both")
            update["ipc_handles"] = decode_handles(update.pop(KEY))
        return super().parse_update_info(update)


def register() -> None:
    """Register the backend with vLLM's factory (once per process; lazily imported)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            NAME, "codraft.server.ipc_json", "JsonIPCWeightTransferEngine"
        )
