"""vLLM's RL weight-sync protocol, served by `codraft serve --weight-transfer BACKEND`.

RL trainers push policy weights into a running vLLM with vLLM's own routes (TRL's async GRPO
trainer, vLLM's `HTTPVLLMWeightSyncClient`): `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/start_draft_weight_update`
for the draft, `/pause`, `/resume`, `/is_paused`, and for colocated RL `/sleep`, `/wake_up`,
`/is_sleeping`, with `/server_info` and `/reset_prefix_cache`, which TRL's client also calls.
vLLM mounts them only in its development mode, next to routes that run
arbitrary RPCs; codraft serves them itself, with the same paths and bodies, behind the control
token, and keeps what it owns consistent with them (`codraft.server.transfer`):

- a session is bracketed by the worker extension: a policy that arrives this way becomes the
  serving policy version exactly as `POST /v1/policy` makes it (the prefix cache is reset; taps,
  the learner's data ages and response headers follow), a draft is checked (finite weights),
  versioned, kept for rollback, and put back when the transfer fails;
- `POST /finish_weight_update?version=N` names the new version (codraft's addition; without
  it the next one is taken), refused with 409 before vLLM finishes when it is not newer;
- while a session is open codraft's own swaps and policy loads answer 409;
- `/sleep` keeps the serving draft on the host, `/wake_up` installs it again (level 2 discards
  every weight, and trainers push only the policy back).

Security: every route wants the control token; bodies are JSON with size limits (64 KiB, and
16 MiB for `/update_weights`); IPC handles that vLLM's HTTP client sends pickled
(`ipc_handles_pickled`, which vLLM itself only reads with VLLM_ALLOW_INSECURE_SERIALIZATION=1)
are refused: codraft takes no pickle over the network. The CUDA backends (nccl, ipc) cannot move
weights on vLLM's CPU build: there `/init_weight_transfer_engine` and `/update_weights` answer
501, while sessions (start/finish, with no weights) and the rest work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request

from codraft.server.api import (
    BodyLimit,
    ControlRoute,
    EngineControl,
    _Body,
    _documented,
    _Reply,
    add_outer_middleware,
    read_body,
)
from codraft.server.auth import ControlError, bearer_auth

log = logging.getLogger(__name__)

BACKENDS = ("ipc", "nccl")
SMALL_PATHS = frozenset(
    {
        "/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
        "/finish_weight_update", "/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache",
    }
)  # fmt: skip
UPDATE_PATH = "/update_weights"
SYNC_PATHS = SMALL_PATHS | {
    UPDATE_PATH, "/is_paused", "/is_sleeping", "/get_world_size", "/server_info"
}  # fmt: skip
SMALL_BODY_BYTES = 64 << 10
UPDATE_BODY_BYTES = 16 << 20
PICKLED = "ipc_handles_pickled"


class InitRequest(_Body):
    init_info: dict[str, Any]


class UpdateRequest(_Body):
    update_info: dict[str, Any] | list[dict[str, Any]]


class SyncReply(_Reply):
    message: str


class PausedReply(_Reply):
    is_paused: bool


class SleepingReply(_Reply):
    is_sleeping: bool


class WorldSizeReply(_Reply):
    world_size: int


class ServerInfoReply(_Reply):
    vllm_config: dict[str, Any] | str


class ResetReply(_Reply):
    success: bool


def _pickled(value: Any) -> bool:
    if isinstance(value, dict):
        return PICKLED in value or any(_pickled(v) for v in value.values())
    if isinstance(value, list):
        return any(_pickled(v) for v in value)
    return False


NCCL_REFUSED = "NCCL error: invalid usage"
NCCL_HINT = (
    "; NCCL refused the group the trainer asked for: each rank needs its own GPU (a trainer on "
    "the engine's GPU cannot join it: use the ipc backend there), and world_size and "
    "rank_offset must match the engine's (GET /get_world_size)"
)


def _engine_error(what: str, e: Exception) -> ControlError:
    """vLLM's refusal of a call: 400 bad input, 409 out of order (its RuntimeErrors: no session
    open, one already open, the engine not configured for weight transfer) or a group NCCL
    refuses (a setup the trainer must change: not worth a retry), 500 otherwise."""
    status = 400 if isinstance(e, ValueError | TypeError | KeyError) else 500
    if isinstance(e, RuntimeError):
        status = 409
    detail = f"{what} failed: {type(e).__name__}: {e}"[:4000]
    if NCCL_REFUSED in str(e):  # (vLLM's engine reports a worker's failure as a plain Exception)
        status, detail = 409, detail + NCCL_HINT
    return ControlError(status, detail)


class WeightSync:
    """The engine client's weight-sync calls, bracketed by codraft's session RPCs."""

    def __init__(self, control: EngineControl, backend: str, on_cpu: bool) -> None:
        self.control = control
        self.backend = backend
        self.on_cpu = on_cpu

    @property
    def engine(self) -> Any:
        return self.control.engine

    def _needs_cuda(self, what: str) -> None:
        if self.on_cpu:
            raise ControlError(
                501,
                f"{what}: the {self.backend} backend moves weights between CUDA devices and "
                "this server runs vLLM's CPU build; sessions (start/finish) work here, weights "
                "move only on a GPU server",
            )

    async def _call(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except ControlError:
            raise
        except Exception as e:
            raise _engine_error(what, e) from e

    async def init(self, init_info: dict[str, Any]) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._needs_cuda("init_weight_transfer_engine")
        await self._call(
            "init_weight_transfer_engine",
            lambda: self.engine.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=init_info)
            ),
        )
        return {"message": "Weight transfer initialized", "backend": self.backend}

    async def start(self, kind: str) -> dict:
        """codraft's session first (a draft's snapshot), then vLLM's; undone if vLLM refuses."""

        async def body() -> dict:
            await self.control.rpc("codraft_transfer_begin", kind=kind)
            name = "start_draft_weight_update" if kind == "draft" else "start_weight_update"
            try:
                await self._call(name, getattr(self.engine, name))
            except ControlError:
                await self.control.rpc("codraft_transfer_end", ok=False)
                raise
            return {"message": f"{'Draft weight' if kind == 'draft' else 'Weight'} update started"}

        return await self.control.swap_locked(body, f"{kind} transfer start")

    async def update(self, update_info: dict | list) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if _pickled(update_info):
            raise ControlError(
                400,
                f"update_info carries {PICKLED!r}: codraft serve takes no pickle over the "
                "network. Use the nccl backend (its update_info is plain JSON), or send the "
                "IPC handles as JSON",
            )
        self._needs_cuda("update_weights")
        try:
            await self._call(
                "update_weights",
                lambda: self.engine.update_weights(
                    WeightTransferUpdateRequest(update_info=update_info)
                ),
            )
        except ControlError:
            # vLLM closes its session when a chunk fails; codraft's follows (a draft is restored)
            await self._abort("update_weights failed")
            raise
        return {"message": "Weights updated"}

    async def finish(self, version: int | None) -> dict:
        async def body() -> dict:
            checked = await self.control.rpc("codraft_transfer_check", version=version)
            kind = checked["kind"]
            try:
                await self._call("finish_weight_update", self.engine.finish_weight_update)
            except ControlError:
                await self.control.rpc("codraft_transfer_end", ok=False)
                raise
            reply = await self.control.rpc(
                "codraft_transfer_end", ok=True, version=checked["version"]
            )
            if reply.get("reset_prefix_cache"):
                await self.control.reset_prefix_cache(checked["version"])
            out = {"message": "Weight update finished", "kind": kind}
            for key in ("policy", "draft"):
                if key in reply:
                    out[key] = reply[key]
            return out

        return await self.control.swap_locked(body, "weight transfer finish")

    async def _abort(self, why: str) -> None:
        try:
            await self.control.rpc("codraft_transfer_end", ok=False)
        except ControlError as e:
            log.error("codraft: closing the weight transfer after %s failed: %s", why, e.message)

    async def sleep(self, level: int, mode: str) -> dict:
        async def body() -> dict:
            reply = await self.control.rpc("codraft_sleep", level=level)
            try:
                await self._call("sleep", lambda: self.engine.sleep(level, mode))
            except ControlError:
                await self.control.rpc("codraft_wake", tags=None)
                raise
            return {"message": f"asleep (level {level})", "draft": reply.get("draft")}

        return await self.control.swap_locked(body, "sleep")

    async def wake(self, tags: list[str] | None) -> dict:
        async def body() -> dict:
            await self._call("wake_up", lambda: self.engine.wake_up(tags))
            reply = await self.control.rpc("codraft_wake", tags=tags)
            return {"message": "awake", "draft": reply.get("draft")}

        return await self.control.swap_locked(body, "wake-up")


def weight_sync_router(
    control: EngineControl,
    auth: Callable[..., Awaitable[None]],
    backend: str,
    *,
    on_cpu: bool,
) -> APIRouter:
    """vLLM's weight-sync, pause and sleep routes, codraft's way (module doc)."""
    sync = WeightSync(control, backend, on_cpu)
    r = APIRouter(
        dependencies=[Depends(auth)], tags=["RL weight sync (vLLM's protocol)"],
        route_class=ControlRoute,
    )  # fmt: skip
    engine = control.engine

    @r.post(
        "/init_weight_transfer_engine", **_documented(SyncReply, 400, 409, 501, body=InitRequest)
    )
    async def init_weight_transfer_engine(request: Request) -> dict:
        """vLLM's handshake with the trainer ({init_info}: the backend's own fields)."""
        body = await read_body(request, InitRequest)
        return await sync.init(body.init_info)

    @r.post("/start_weight_update", **_documented(SyncReply, 409))
    async def start_weight_update() -> dict:
        """Open a policy (target weights) update session; 409 while one is open."""
        return await sync.start("policy")

    @r.post("/start_draft_weight_update", **_documented(SyncReply, 409))
    async def start_draft_weight_update() -> dict:
        """Open a draft update session: the serving draft is kept to go back to."""
        return await sync.start("draft")

    @r.post("/update_weights", **_documented(SyncReply, 400, 409, 501, body=UpdateRequest))
    async def update_weights(request: Request) -> dict:
        """One chunk of weights ({update_info}: the backend's own fields, JSON only)."""
        body = await read_body(request, UpdateRequest)
        return await sync.update(body.update_info)

    @r.post("/finish_weight_update", **_documented(SyncReply, 409, 422))
    async def finish_weight_update(
        version: Annotated[int | None, Query(ge=0, le=2**53 - 1)] = None,
    ) -> dict:
        """Close the session: the weights become policy (or draft) `version` (default: the
        next); 409 when not newer (the session stays open), 422 for a draft whose weights are
        not finite (the previous draft serves again)."""
        return await sync.finish(version)

    @r.post("/pause", **_documented(SyncReply))
    async def pause(
        mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
        clear_cache: Annotated[bool, Query()] = True,
    ) -> dict:
        """Pause generation (vLLM's modes: abort, wait or keep in-flight requests)."""
        await sync._call(
            "pause", lambda: engine.pause_generation(mode=mode, clear_cache=clear_cache)
        )
        return {"message": "paused", "status": "paused"}

    @r.post("/resume", **_documented(SyncReply))
    async def resume() -> dict:
        """Resume generation after a pause."""
        await sync._call("resume", engine.resume_generation)
        return {"message": "resumed", "status": "resumed"}

    @r.get("/is_paused", **_documented(PausedReply))
    async def is_paused() -> dict:
        """{is_paused}."""
        return {"is_paused": await sync._call("is_paused", engine.is_paused)}

    @r.post("/sleep", **_documented(SyncReply, 409, 422))
    async def sleep(
        level: Annotated[int, Query(ge=1, le=2)] = 1,
        mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
    ) -> dict:
        """Put the engine to sleep (vLLM's levels: 1 offloads the weights, 2 discards them);
        the serving draft is kept on the host either way and comes back on wake-up."""
        return await sync.sleep(level, mode)

    @r.post("/wake_up", **_documented(SyncReply, 422))
    async def wake_up(tags: Annotated[list[str] | None, Query(max_length=8)] = None) -> dict:
        """Wake the engine (all of it, or the tagged parts: weights, kv_cache); the draft is
        installed again once the weights are awake."""
        return await sync.wake(tags or None)

    @r.get("/is_sleeping", **_documented(SleepingReply))
    async def is_sleeping() -> dict:
        """{is_sleeping}."""
        return {"is_sleeping": await sync._call("is_sleeping", engine.is_sleeping)}

    @r.get("/get_world_size", **_documented(WorldSizeReply))
    async def get_world_size(include_dp: Annotated[bool, Query()] = True) -> dict:
        """The engine's world size (TP x PP, times DP with include_dp), as vLLM answers."""
        parallel = engine.vllm_config.parallel_config
        size = parallel.world_size_across_dp if include_dp else parallel.world_size
        return {"world_size": size}

    @r.get("/server_info", **_documented(ServerInfoReply))
    async def server_info(
        config_format: Annotated[Literal["text", "json"], Query()] = "text",
    ) -> dict:
        """The engine's resolved configuration, as vLLM's development route gives it (TRL's
        client reads the dtype and the weight-transfer backend here); without vLLM's
        environment and system dumps, which this route has no business publishing."""
        config = engine.vllm_config
        if config_format == "text":
            return {"vllm_config": str(config)}
        import pydantic
        from vllm.config import VllmConfig

        dump = pydantic.TypeAdapter(VllmConfig).dump_python(config, mode="json", fallback=str)
        return {"vllm_config": dump}

    @r.post("/reset_prefix_cache", **_documented(ResetReply))
    async def reset_prefix_cache() -> dict:
        """Drop the prefix cache (trainers call it after a weight update; codraft already
        does at every finish)."""
        ok = await sync._call("reset_prefix_cache", engine.reset_prefix_cache)
        return {"success": ok is not False}

    return r


def install_weight_sync(
    app: FastAPI, control: EngineControl, token: str | None, backend: str
) -> None:
    """Add the weight-sync routes and their body limits to the control app `app`."""
    from vllm.platforms import current_platform

    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend must be one of {BACKENDS}, got {backend!r}")
    router = weight_sync_router(
        control, bearer_auth(token), backend, on_cpu=bool(current_platform.is_cpu())
    )
    app.include_router(router)
    add_outer_middleware(app, BodyLimit, max_bytes=SMALL_BODY_BYTES, paths=SMALL_PATHS)
    add_outer_middleware(app, BodyLimit, max_bytes=UPDATE_BODY_BYTES, paths={UPDATE_PATH})
