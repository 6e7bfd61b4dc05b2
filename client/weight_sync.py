"""The trainer's side of vLLM's weight-sync protocol, as `codraft serve --weight-transfer`
serves it (docs/rl.md): a session client, and the update info of tensors shared through CUDA
IPC with their handles as JSON (`codraft.ipc_handles`), since codraft serve reads no pickle.

    with WeightSyncClient("http://127.0.0.1:8001", token=...) as sync:
        sync.init({})                                      # ipc: nothing to rendezvous
        sync.start()                                       # or start(draft=True)
        for chunk in chunks(model.state_dict().items()):   # tensors on the server's GPU
            sync.update(ipc_update_info(chunk))            # keep the tensors alive until finish
        sync.finish(version=7)                             # policy (or draft) v7

Any client of vLLM's protocol drives the same routes (with the control token); this one adds
only the JSON handles and codraft's `?version=`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

from codraft.client.calls import detail
from codraft.client.errors import http_error
from codraft.client.settings import resolve_base_url, resolve_token


def ipc_update_info(named: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """update_info for tensors on a CUDA device: names, dtypes, shapes and one JSON IPC handle
    per tensor, keyed by the device's UUID. The tensors must stay alive (and unchanged) until
    the server has finished the update."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    from codraft.ipc_handles import KEY, encode_args

    names, dtypes, shapes, handles = [], [], [], []
    for name, t in named:
        if not t.is_cuda:
            raise ValueError(f"{name}: CUDA IPC shares CUDA tensors, this one is on {t.device}")
        t = t.detach().contiguous()
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        _, args = reduce_tensor(t)
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        handles.append({uuid: encode_args(args)})
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, KEY: handles}


class WeightSyncClient:
    """Synchronous client of the weight-sync routes; errors raise CodraftHTTPError."""

    def __init__(
        self, base_url: str | None = None, token: str | None = None, timeout: float = 600.0
    ) -> None:
        headers = {"Accept": "application/json"}
        if (tok := resolve_token(token)) is not None:
            headers["Authorization"] = f"Bearer {tok}"
        self._http = httpx.Client(base_url=resolve_base_url(base_url), headers=headers,
                                  timeout=timeout)  # fmt: skip

    def _post(self, path: str, json: Any = None, **params: Any) -> dict[str, Any]:
        params = {k: v for k, v in params.items() if v is not None}
        # every control POST says JSON, bodyless ones too: the server refuses others (415)
        headers = {"Content-Type": "application/json"}
        r = self._http.post(path, json=json, params=params, headers=headers)
        if r.status_code >= 400:
            raise http_error("POST", str(r.url), r.status_code, detail(r))
        return r.json() if r.content else {}

    def init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start(self, draft: bool = False) -> dict[str, Any]:
        return self._post("/start_draft_weight_update" if draft else "/start_weight_update")

    def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
        return self._post("/update_weights", {"update_info": update_info})

    def finish(self, version: int | None = None) -> dict[str, Any]:
        return self._post("/finish_weight_update", version=version)

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._post("/pause", mode=mode)

    def resume(self) -> dict[str, Any]:
        return self._post("/resume")

    def sleep(self, level: int = 1) -> dict[str, Any]:
        return self._post("/sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._post("/wake_up", tags=tags)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> WeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
