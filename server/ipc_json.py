"""vLLM's IPC weight-transfer backend, reading CUDA IPC handles as JSON (`codraft.ipc_handles`).

`codraft serve --weight-transfer ipc` runs vLLM with this backend, registered as
`codraft_ipc` by codraft's plugin in every engine process: it is vLLM's `ipc` engine (same init,
same layerwise reload, same packed and unpacked transfers) whose update info takes
`ipc_handles_json` instead of `ipc_handles_pickled`, so no pickle crosses the HTTP route.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

from codraft.ipc_handles import KEY, decode_handles

NAME = "codraft_ipc"


class JsonIPCWeightTransferEngine(IPCWeightTransferEngine):
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
