"""The codraft control API: draft swaps, policy updates, the tap, probes (docs/architecture.md).

Every route is a thin layer over one `collective_rpc` method of the worker extension
(`codraft.server.worker_ext.CodraftWorkerExtension`); rank 0's reply is the answer. A reply
`{"ok": False, "status": S, "error": M}` becomes HTTP S (400..599) with `{"detail": M}`.

- `control_router(control, auth)`: GET/POST /v1/draft, GET/POST /v1/draft/prepare, POST
  /v1/draft/rollback, POST /v1/policy, GET/PUT /v1/tap, all behind the bearer-token dependency
  `auth`.
- `probe_router(control)`: GET /health (engine alive), GET /ready (engine ready and a draft
  loaded, from the state EngineControl's refresher caches: no engine RPC per probe);
  unauthenticated. /metrics is in `codraft.server.metrics`.
- `BodyLimit`: ASGI middleware, 413 for control request bodies over `max_body_bytes`, before a
  single byte more is read.

Bodies are parsed here (not by FastAPI) so that authentication always comes first and every
malformed body is a 422 naming what was expected; pydantic models reject unknown fields. With a
checkpoint root configured (`codraft serve --checkpoint-root`), draft and policy paths must
resolve inside it (403 otherwise). Engine failures that are not the request's fault: 502 (bad
reply or RPC error), 503 (engine dead), 504 (no answer in time). Draft swaps, rollbacks and
policy loads share one lock: one runs at a time, the others wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from codraft.server.auth import ControlError, bearer_auth, control_error_response
from codraft.server.committed import recorded_paths, write_record
from codraft.server.draft_store import DraftStore

log = logging.getLogger(__name__)

# Versions are JSON-safe integers: JSON Schema and JavaScript clients hold them exactly.
MAX_VERSION = 2**53 - 1
CONTROL_PATHS = frozenset(
    {
        "/v1/draft",
        "/v1/draft/prepare",
        "/v1/draft/rollback",
        "/v1/draft/digest",
        "/v1/policy",
        "/v1/tap",
        "/v1/stats",
    }
)


@dataclass
class ControlSettings:
    rpc_timeout_s: float = 120.0  # a draft or policy load (sha256 + contract + swap)
    probe_timeout_s: float = 5.0  # /ready, /metrics, GET routes
    swap_wait_s: float = 300.0  # how long a swap waits for the one in progress
    refresh_s: float = 0.5  # how often the cached draft/policy versions are re-read
    # how often the cached counters (/metrics) are re-read; None: only when asked
    stats_refresh_s: float | None = 5.0
    commit_poll_s: float = 0.005  # a draft swap asks this often whether its draft is prepared
    max_body_bytes: int = 8192
    checkpoint_root: str | None = None  # if set, loaded paths must resolve inside it
    committed_file: str | None = None  # where the serving draft is recorded (server.committed)
    draft_store: str | None = None  # the server's copies of its drafts (server.draft_store)


# ------------------------------------------------------------------------- request bodies
_Path = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
_Version = Annotated[StrictInt, Field(ge=0, le=MAX_VERSION)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


_Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class DraftLoadRequest(_Body):
    version: _Version
    path: _Path
    sha256: _Sha256 | None = None


class DraftPrepareRequest(_Body):
    path: _Path
    version: _Version | None = None  # None: the checkpoint's own (its codraft.json)
    sha256: _Sha256 | None = None


class RollbackRequest(_Body):
    reason: Annotated[str, Field(max_length=200)] = "manual"


class PolicyLoadRequest(_Body):
    version: _Version
    path: _Path


class TapUpdateRequest(_Body):
    enabled: StrictBool | None = None
    mode: Literal["full", "ids", "off"] | None = None
    sample_rate: (
        Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)] | None
    ) = None
    endpoint: (
        Annotated[str, Field(max_length=4096, pattern=r"^(tcp|ipc|inproc)://[^\s\x00]+$")] | None
    ) = None


B = TypeVar("B", bound=_Body)


# ------------------------------------------------------------------------- replies (documented)
class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorReply(BaseModel):
    detail: str


class RollbackEntry(_Reply):
    from_version: int
    to_version: int
    reason: str
    auto: bool
    at: str


class DraftReply(_Reply):
    """The serving draft (and whatever else the engine reports with it)."""

    version: int | None
    sha256: str | None = None
    path: str | None = None
    loaded_at: str | None = None
    kind: Literal["eagle3", "dflash"] | None = None
    tap_layers: list[int] | None = None
    previous_version: int | None = None
    previous_path: str | None = None
    rollbacks: list[RollbackEntry] | None = None


class TensorDigest(BaseModel):
    shape: list[int]
    dtype: str
    device: str
    sum: float | int | str  # "nan" / "inf" / "-inf" when not finite
    sum_sq: float | str | None = None  # floating-point tensors only


class DigestReply(BaseModel):
    """Checksums of every tensor the serving draft reads that is not the target's."""

    version: int | None
    tensors: dict[str, TensorDigest]


class PrepareReply(_Reply):
    ticket: str
    path: str
    version: int | None
    state: Literal["preparing"]


class StagedReply(_Reply):
    ticket: str
    path: str
    state: Literal["preparing", "ready", "failed"]


class PolicyReply(_Reply):
    version: int | None


class TapReply(_Reply):
    enabled: bool | None = None
    mode: str | None = None


class VersionCounts(BaseModel):
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float


class StatsReply(_Reply):
    """The engine's counters as of this request (/metrics serves them from a cache)."""

    acceptance: dict[str, VersionCounts]
    draft_version: int | None = None
    policy_version: int | None = None


_STATUS_TEXT = {
    400: "the engine refused the request's content (weight sync)",
    401: "no or a wrong bearer token",
    403: "the path lies outside the checkpoint root",
    404: "no such checkpoint (or nothing staged)",
    409: "not newer than the serving version, no previous draft, or out of turn with a "
    "weight-transfer session",
    413: "request body over the limit",
    422: "malformed body, or a checkpoint that fails its checks",
    500: "loaded, but a step after the load failed (the committed-draft record could not be "
    "written: the swap is rolled back), or a policy that failed and could not be undone",
    501: "the weight-transfer backend cannot run on this build (vLLM's CPU build)",
    502: "the engine's reply was unusable",
    503: "the engine is dead, or another swap holds the lock too long",
    504: "the engine did not answer in time",
}


def _documented(
    reply: type[BaseModel], *codes: int, body: type[_Body] | None = None, ok: int = 200
) -> dict[str, Any]:
    """Route keywords that put the reply, the error statuses and the body in the OpenAPI
    schema. Bodies are parsed by `read_body` (after the token check), not by FastAPI, so the
    schema is given as openapi_extra."""
    common = (401, 422, 502, 503, 504) + ((413,) if body is not None else ())
    responses: dict[int | str, Any] = {ok: {"model": reply}}
    for code in sorted(set(common + codes)):
        responses[code] = {"model": ErrorReply, "description": _STATUS_TEXT[code]}
    kw: dict[str, Any] = {"response_model": None, "responses": responses, "status_code": ok}
    if body is not None:
        schema = body.model_json_schema()
        kw["openapi_extra"] = {
            "requestBody": {
                "required": body is not RollbackRequest,
                "content": {"application/json": {"schema": schema}},
            }
        }
    return kw


def _loc(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err.get("loc", ())) or "body"


async def read_body(request: Request, model: type[B], *, empty_ok: bool = False) -> B:
    """Parse the JSON body as `model`; 422 with a readable message on anything else."""
    raw = await request.body()
    if not raw.strip():
        if empty_ok:
            return model()
        raise ControlError(422, f"expected a JSON object with fields {list(model.model_fields)}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ControlError(422, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ControlError(422, f"expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{_loc(err)}: {err['msg']} (got {str(err.get('input'))[:80]!r})"
            if err.get("type") != "missing"
            else f"{_loc(err)}: field required"
            for err in e.errors()
        )
        raise ControlError(422, f"invalid {model.__name__}: {problems}") from None


# ------------------------------------------------------------------------- engine RPCs
class EngineControl:
    """The codraft RPCs of one engine client, with the swap lock and a cached version pair.

    The cache (`versions()`) feeds the X-Codraft-*-Version response headers without an engine
    round trip per request: swaps through this API update it from their reply at once; a
    background task re-reads it every `refresh_s` (to see automatic rollbacks).
    """

    def __init__(self, engine: Any, settings: ControlSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or ControlSettings()
        self.swap_lock = asyncio.Lock()
        self.draft_version: int | None = None
        self.policy_version: int | None = None
        # the engine's word that the target's weights are undefined (a failed policy load it
        # could not undo): generation answers 503 with it (server.policy_gate), /ready too
        self.policy_broken: str | None = None
        self._epoch = 0  # bumped by every swap, so a slower refresh never undoes it
        self.draining = False  # set on SIGTERM: /ready answers 503 while requests drain
        self._refresher: asyncio.Task | None = None
        # the last codraft_info / codraft_stats replies and when they came (time.monotonic()):
        # /ready and /metrics read these, never the engine (the refresher keeps them fresh)
        self.last_info: dict | None = None
        self.last_stats: dict | None = None
        self.info_at: float | None = None
        self.info_error: str | None = None  # what the last codraft_info failed with
        self.refresh_errors = 0  # failed background refreshes
        self._recorded: tuple | None = None  # the draft last written to committed_file
        self.store = DraftStore(self.settings.draft_store) if self.settings.draft_store else None
        self._staged_path: str | None = None  # the store's folder of the last draft prepared
        self._record_lock = asyncio.Lock()
        # where complete responses' version headers came from: "engine" (the draft serving
        # when the request finished) or "arrival" (the engine could not tell: the cached
        # version when the request arrived)
        self.header_sources: dict[str, int] = {"engine": 0, "arrival": 0}

    async def rpc(self, method: str, timeout: float | None = None, **kwargs: Any) -> dict:
        """Rank 0's reply to `method(**kwargs)`; ControlError for failures of any kind."""
        timeout = timeout or self.settings.rpc_timeout_s
        try:
            replies = await asyncio.wait_for(
                self.engine.collective_rpc(method, timeout=timeout, kwargs=kwargs),
                timeout + min(5.0, timeout),
            )
        except TimeoutError:
            raise ControlError(
                504, f"engine did not answer {method} within {timeout:.0f} s"
            ) from None
        except Exception as e:  # engine dead, worker extension missing, RPC raised
            if type(e).__name__ == "EngineDeadError":
                raise ControlError(503, f"the engine is dead: {e}") from e
            raise ControlError(
                502, f"engine RPC {method} failed: {type(e).__name__}: {e}"[:2000]
            ) from e
        reply = replies[0] if isinstance(replies, list | tuple) and replies else replies
        if not isinstance(reply, dict) or "ok" not in reply:
            raise ControlError(
                502, f"engine RPC {method} answered {str(reply)[:200]!r}; expected a dict with 'ok'"
            )
        self._note_broken(reply)
        if not reply["ok"]:
            status = reply.get("status")
            status = status if isinstance(status, int) and 400 <= status <= 599 else 500
            raise ControlError(status, str(reply.get("error") or f"{method} failed")[:4000])
        return reply

    # -------------------------------------------------------------- cached versions
    def versions(self) -> tuple[int | None, int | None]:
        return self.draft_version, self.policy_version

    def _note_broken(self, reply: dict) -> None:
        """Every engine reply says whether the target's weights are undefined (worker_ext's
        `policy_broken`): the gate and /ready know it from the reply of the load that broke
        them, and from the next reply after a load that mended them."""
        if "policy_broken" not in reply:
            return
        broken = reply["policy_broken"]
        broken = str(broken)[:2000] if broken is not None else None
        if broken != self.policy_broken:
            if broken is None:
                log.warning("the target's weights are defined again: generation is served")
            else:
                log.error("generation refused until a policy loads: %s", broken)
        self.policy_broken = broken

    def _note(self, reply: dict) -> None:
        draft, policy = reply.get("draft"), reply.get("policy")
        if isinstance(draft, dict) and "version" in draft:
            self.draft_version = draft["version"]
        if isinstance(policy, dict) and "version" in policy:
            self.policy_version = policy["version"]

    async def _record(self, reply: dict, epoch: int | None = None) -> None:
        """Record a new serving draft (before a swap's reply goes out), so that a restart serves
        it; the write (fsync'ed) runs off the event loop, one at a time. A refresh's write
        (`epoch` given) is dropped once a swap has begun since its read, and a failed one is
        logged (the next refresh tries again); a swap's failed write raises ControlError 500
        (`swap_locked` then undoes the swap)."""
        draft = reply.get("draft")
        if not isinstance(draft, dict) or self.settings.committed_file is None:
            return
        key = (draft.get("version"), draft.get("sha256"), draft.get("path"))
        async with self._record_lock:
            if key == self._recorded or None in key or epoch not in (None, self._epoch):
                return
            try:
                await asyncio.to_thread(write_record, Path(self.settings.committed_file), draft)
                self._recorded = key
            except OSError as e:
                if epoch is None:
                    raise ControlError(
                        500,
                        f"draft v{key[0]} could not be recorded in "
                        f"{self.settings.committed_file} ({type(e).__name__}: {e})",
                    ) from None
                log.error(
                    "draft v%s serves but could not be recorded in %s (%s): a restart would "
                    "serve an older draft", key[0], self.settings.committed_file, e,
                )  # fmt: skip

    async def _undo_unrecorded(self, reply: dict, before: int | None, e: ControlError) -> None:
        """A swap whose record could not be written: the record is what a restart serves, so
        the engine goes back to the draft the record still names (a rollback), and the swap
        is answered with 500. A rollback that could not be recorded cannot be undone (the
        draft rolled back from is not kept): it is reported, and the refresh retries the
        record. Always raises ControlError."""
        draft = reply.get("draft") if isinstance(reply.get("draft"), dict) else {}
        version = draft.get("version")
        if "rolled_back_from" in reply or version == before:
            raise ControlError(
                500,
                f"{e.message}; the engine serves v{version} but a restart would serve what the "
                f"record names (retried every {self.settings.refresh_s:g} s): fix the work dir",
            )
        try:
            undo = await self.rpc(
                "codraft_rollback_draft", reason=f"draft v{version} could not be recorded"
            )
        except ControlError as e2:
            raise ControlError(
                500,
                f"{e.message}, and rolling the engine back to the recorded draft failed too "
                f"({e2.message}): v{version} serves, a restart would serve the recorded one",
            ) from None
        self._note(undo)
        back = (undo.get("draft") or {}).get("version")
        raise ControlError(
            500,
            f"{e.message}: rolled back to v{back}, the draft the record names, so that a "
            f"restart serves what serves now; fix the work dir (space, permissions) and "
            f"publish again as v{version + 1 if isinstance(version, int) else '?'} or higher",
        )

    async def keep(self, path: str) -> str:
        """The store's copy of the draft at `path` (the path itself without a store); under the
        swap lock, so that no prune removes it before the engine has read it."""
        if self.store is None:
            return path
        try:
            return await asyncio.to_thread(self.store.keep, path)
        except OSError as e:
            raise ControlError(
                500, f"could not keep a copy of {path} in {self.store.root}: {e}"
            ) from None

    async def _prune(self, reply: dict) -> None:
        """Drop the store's entries that nothing holds after a change of the serving draft."""
        draft = reply.get("draft")
        if self.store is None or not isinstance(draft, dict):
            return
        holding = {draft.get("path"), draft.get("previous_path"), self._staged_path}
        if self.settings.committed_file is not None:
            holding |= recorded_paths(Path(self.settings.committed_file))
        try:
            await asyncio.to_thread(self.store.prune, {p for p in holding if isinstance(p, str)})
        except OSError as e:
            log.warning("pruning the draft store %s failed: %s", self.store.root, e)

    async def info(self) -> dict:
        epoch = self._epoch
        try:
            reply = await self.rpc("codraft_info", timeout=self.settings.probe_timeout_s)
        except ControlError as e:
            self.info_error = e.message
            raise
        self.last_info, self.info_at, self.info_error = reply, time.monotonic(), None
        if epoch == self._epoch and not self.swap_lock.locked():
            self._note(reply)
            await self._record(reply, epoch)  # an automatic rollback, or the draft at start
        return reply

    async def refresh_stats(self) -> dict:
        """Re-read the engine's counters into `last_stats` (what /metrics serves)."""
        self.last_stats = await self.rpc("codraft_stats", timeout=self.settings.probe_timeout_s)
        return self.last_stats

    def stale_info(self) -> str | None:
        """Why the cached codraft_info cannot vouch for the engine (none yet, or none for
        longer than a refresh and its timeout take), or None when it is fresh."""
        if self.info_error is not None:
            return self.info_error
        if self.info_at is None:
            return "the engine has not answered codraft_info yet"
        age = time.monotonic() - self.info_at
        limit = 2 * (self.settings.refresh_s + self.settings.probe_timeout_s)
        if age > limit:
            return f"the engine has not answered codraft_info for {age:.0f} s"
        return None

    async def _refresh_forever(self) -> None:
        stats_due = 0.0
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await self.info()
                every = self.settings.stats_refresh_s
                if every is not None and time.monotonic() >= stats_due:
                    stats_due = time.monotonic() + every
                    await self.refresh_stats()
            except ControlError as e:
                self.refresh_errors += 1
                log.debug("codraft_info/codraft_stats refresh failed: %s", e.message)

    def start(self) -> None:
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    def stop_refreshing(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
            self._refresher = None

    # -------------------------------------------------------------- swaps
    async def swap(self, method: str, **kwargs: Any) -> dict:
        """Run a state-changing RPC under the swap lock and update the cached versions."""
        return await self.swap_locked(lambda: self.rpc(method, **kwargs), method)

    async def swap_locked(
        self, body: Callable[[], Awaitable[dict]], what: str = "draft swap"
    ) -> dict:
        """Run `body` (state-changing RPCs) under the swap lock; update the cached versions
        from its reply."""
        try:
            await asyncio.wait_for(self.swap_lock.acquire(), self.settings.swap_wait_s)
        except TimeoutError:
            raise ControlError(
                503, f"another swap has held the lock for over {self.settings.swap_wait_s:.0f} s"
            ) from None
        try:
            self._epoch += 1
            t0 = time.perf_counter()
            before = self.draft_version
            reply = await body()
            self._note(reply)
            try:
                await self._record(reply)
            except ControlError as e:
                await self._undo_unrecorded(reply, before, e)
            await self._prune(reply)
            log.info("%s done in %.1f ms", what, 1000 * (time.perf_counter() - t0))
            return reply
        finally:
            self._epoch += 1
            self.swap_lock.release()

    async def reset_prefix_cache(self, policy_version: int) -> None:
        """After new target weights: KV computed with the old ones must not be reused, so drop
        the prefix cache and recompute running requests with the new weights."""
        try:
            await self.engine.reset_prefix_cache(reset_running_requests=True)
        except Exception as e:
            raise ControlError(
                500,
                f"policy v{policy_version} is loaded but resetting the prefix cache failed "
                f"({type(e).__name__}: {e}); cached KV of the old policy may be reused",
            ) from e

    async def prepare_draft(self, path: str, version: int | None, sha256: str | None) -> dict:
        """Stage a draft ahead of its swap (`codraft_prepare_draft`, under the swap lock so that
        it never supersedes the draft a swap in progress is waiting for): the reply is the
        ticket at once; reading, hashing, checking and staging run in the worker's thread."""
        t0 = time.perf_counter()

        async def body() -> dict:
            kept = await self.keep(path)
            self._staged_path = kept
            return await self.rpc(
                "codraft_prepare_draft", path=kept, version=version, sha256=sha256
            )

        reply = await self.swap_locked(body, "draft prepare")
        return {
            "ticket": reply["ticket"],
            "path": path,
            "version": reply.get("version"),
            "state": "preparing",
            "prepare_rpc_ms": 1e3 * (time.perf_counter() - t0),
        }

    async def swap_draft(self, path: str, version: int, sha256: str | None) -> dict:
        """A draft swap, under the swap lock. `codraft_swap_draft` commits the staged draft
        when it is this checkpoint (prepared ahead, files unchanged): one RPC. Otherwise it
        starts the read/hash/check/staging in a worker thread and returns a ticket;
        `codraft_commit_draft` is then asked every `commit_poll_s` until the draft is prepared,
        and installs it between two engine steps. The reply's `timing_ms` adds this side's view
        to the engine's: `total_ms`, `first_rpc_ms` (the first RPC's round trip),
        `commit_rpcs` (RPCs in all), `prepared_ahead`, and `wait_ms` = total - the preparation
        this swap waited for - install_ms (RPC round trips and waits for step boundaries)."""
        t0 = time.perf_counter()

        async def body() -> dict:
            kept = await self.keep(path)
            reply = await self.rpc("codraft_swap_draft", path=kept, version=version, sha256=sha256)
            t1 = time.perf_counter()
            ahead, rpcs, ticket = bool(reply.get("prepared_ahead")), 1, reply.get("ticket")
            deadline = t1 + self.settings.rpc_timeout_s
            while not reply.get("ready"):
                if time.perf_counter() > deadline:
                    raise ControlError(
                        504,
                        f"draft v{version} was not prepared within "
                        f"{self.settings.rpc_timeout_s:.0f} s",
                    )
                await asyncio.sleep(self.settings.commit_poll_s)
                reply = await self.rpc("codraft_commit_draft", ticket=ticket)
                ticket = reply.get("ticket", ticket)  # a new one when the files changed
                rpcs += 1
            timing = dict(reply.get("timing_ms") or {})
            total = 1e3 * (time.perf_counter() - t0)
            waited = 0.0 if ahead and rpcs == 1 else timing.get("prepare_ms", 0.0)
            timing.update(
                total_ms=total,
                first_rpc_ms=1e3 * (t1 - t0),
                commit_rpcs=rpcs,
                prepared_ahead=ahead,
                wait_ms=total - min(waited, total) - timing.get("install_ms", 0.0),
            )
            return {**reply, "timing_ms": timing}

        return await self.swap_locked(body)


# ------------------------------------------------------------------------- routes
def checked_path(control: EngineControl, path: str) -> str:
    """`path` with symlinks resolved; 403 when a checkpoint root is set and it lies outside
    (and outside the server's own draft store, whose folders GET /v1/draft names)."""
    real = os.path.realpath(path)
    root = control.settings.checkpoint_root
    if root is not None:
        top = os.path.realpath(root)
        tops = [top] + ([os.path.realpath(control.store.root)] if control.store else [])
        if all(os.path.commonpath([t, real]) != t for t in tops):
            raise ControlError(
                403,
                f"{path} is outside the checkpoint root {root} this server loads from; publish "
                "checkpoints under it",
            )
    return real


async def draft_state(control: EngineControl) -> dict:
    """The loaded draft (codraft_info) with the acceptance stats of its version."""
    info, stats = await asyncio.gather(control.info(), control.refresh_stats())
    draft = dict(info.get("draft") or {})
    acceptance = stats.get("acceptance") or {}
    draft["acceptance"] = acceptance.get(str(draft.get("version")))
    return draft


class ControlRoute(APIRoute):
    """A route that answers ControlError itself (from the auth dependency, body parsing or the
    engine) as `{"detail": message}`: the app's exception handlers are not involved, so the
    routes behave the same on vLLM's app (whose handlers reshape errors into OpenAI's format and
    whose middleware stack is built before codraft's routes are added) as on the control app."""

    allowed: tuple[str, ...] = ()  # every method of this path (set by control_router)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A 405 names every method of the path in Allow, not only this route's (GET and POST
        /v1/draft are two routes; Starlette would answer with the first one's alone)."""
        if self.methods and scope["method"] not in self.methods and self.allowed:
            allow = ", ".join(self.allowed)
            response = JSONResponse(
                {"detail": f"{scope['method']} is not allowed on {self.path}; allowed: {allow}"},
                status_code=405,
                headers={"Allow": allow},
            )
            await response(scope, receive, send)
            return
        await super().handle(scope, receive, send)

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except ControlError as e:
                return await control_error_response(request, e)
            except RequestValidationError as e:  # query parameters (bodies: read_body)
                problems = "; ".join(
                    f"{_loc(err)}: {err['msg']} (got {str(err.get('input'))[:80]!r})"
                    for err in e.errors()
                )
                return await control_error_response(request, ControlError(422, problems))

        return answer


def control_router(control: EngineControl, auth: Callable[..., Awaitable[None]]) -> APIRouter:
    r = APIRouter(dependencies=[Depends(auth)], tags=["codraft control"], route_class=ControlRoute)

    @r.get("/v1/draft", **_documented(DraftReply))
    async def get_draft() -> dict:
        """The loaded draft: version, sha256, path, loaded_at, tap layers, acceptance stats."""
        return await draft_state(control)

    @r.get("/v1/draft/digest", **_documented(DigestReply))
    async def draft_digest() -> dict:
        """Checksums (float64 sum and sum of squares, shape, dtype) of every tensor the serving
        draft reads that is not the target's: the drafter's parameters, buffers and derived
        tensors, and its proposer's. Compare two to see that a push landed, or what a sleep
        or a transfer changed."""
        return await control.rpc("codraft_draft_digest")

    @r.post("/v1/draft", **_documented(DraftReply, 403, 404, 409, 500, body=DraftLoadRequest))
    async def post_draft(request: Request) -> dict:
        """Load a new draft {version, path, sha256}: 409 not newer, 422 contract or checksum,
        404 missing; the previous draft keeps serving on every failure. A draft staged by POST
        /v1/draft/prepare (same path, files unchanged) is only installed. The reply is the new
        draft plus `timing_ms` (see EngineControl.swap_draft)."""
        body = await read_body(request, DraftLoadRequest)
        path = checked_path(control, body.path)
        reply = await control.swap_draft(path, body.version, body.sha256)
        return {**reply["draft"], "timing_ms": reply["timing_ms"]}

    @r.post(
        "/v1/draft/prepare",
        **_documented(PrepareReply, 403, 404, 409, body=DraftPrepareRequest, ok=202),
    )
    async def prepare_draft(request: Request) -> dict:
        """Stage a draft ahead {path, version?, sha256?}: 202 with a ticket at once, then the
        server reads, hashes, checks and stages it in the background; a later POST /v1/draft
        of the same checkpoint (files unchanged) only installs it. 409 not newer, 404 missing,
        422 malformed, 403 outside the checkpoint root; a check that fails later is reported
        by GET /v1/draft/prepare and by the POST /v1/draft of that checkpoint. One draft is
        staged at a time: a new prepare replaces it."""
        body = await read_body(request, DraftPrepareRequest)
        path = checked_path(control, body.path)
        return await control.prepare_draft(path, body.version, body.sha256)

    @r.get("/v1/draft/prepare", **_documented(StagedReply, 404))
    async def staged_draft() -> dict:
        """The staged draft: ticket, path, version, state (preparing, ready, failed), status and
        error when it failed, timing_ms when ready; 404 when none is staged."""
        reply = await control.rpc("codraft_staged_draft", timeout=control.settings.probe_timeout_s)
        return reply["staged"]

    @r.post("/v1/draft/rollback", **_documented(DraftReply, 409, 500, body=RollbackRequest))
    async def rollback_draft(request: Request) -> dict:
        """Go back to the previous draft; 409 when there is none."""
        body = await read_body(request, RollbackRequest, empty_ok=True)
        reply = await control.swap("codraft_rollback_draft", reason=body.reason)
        return reply["draft"]

    @r.post("/v1/policy", **_documented(PolicyReply, 403, 404, 409, 500, body=PolicyLoadRequest))
    async def post_policy(request: Request) -> dict:
        """Load new target (policy) weights {version, path}."""
        body = await read_body(request, PolicyLoadRequest)
        path = checked_path(control, body.path)
        reply = await control.swap("codraft_load_policy", path=path, version=body.version)
        if reply.get("reset_prefix_cache"):
            await control.reset_prefix_cache(body.version)
        return reply["policy"]

    @r.get("/v1/tap", **_documented(TapReply))
    async def get_tap() -> dict:
        """The tap settings and its counters."""
        info, stats = await asyncio.gather(control.info(), control.refresh_stats())
        return {**(info.get("tap") or {}), "stats": stats.get("tap") or {}}

    @r.get("/v1/stats", **_documented(StatsReply))
    async def get_stats() -> dict:
        """The engine's counters now (acceptance per draft version, tap, swaps): what a caller
        measuring a delta reads, since /metrics may be up to a refresh period old."""
        return await control.refresh_stats()

    @r.put("/v1/tap", **_documented(TapReply, body=TapUpdateRequest))
    async def put_tap(request: Request) -> dict:
        """Change any of {enabled, mode, sample_rate, endpoint}; the others stay."""
        body = await read_body(request, TapUpdateRequest)
        reply = await control.rpc("codraft_set_tap", **body.model_dump(exclude_none=True))
        return reply["tap"]

    return r


def _allow_all_methods(router: Any) -> None:
    """Tell each control route every method of its path (for its 405s)."""
    methods: dict[str, set[str]] = {}
    for route in router.routes:
        if isinstance(route, ControlRoute):
            methods.setdefault(route.path, set()).update(route.methods or ())
    for route in router.routes:
        if isinstance(route, ControlRoute):
            route.allowed = tuple(sorted(methods[route.path]))


def probe_router(control: EngineControl, paths: Iterable[str] = ("/health", "/ready")) -> APIRouter:
    """/health and /ready (those named in `paths`); no authentication."""
    r = APIRouter(tags=["probes"], route_class=ControlRoute)
    wanted = set(paths)

    async def health() -> JSONResponse:
        """200 while the engine is alive, 503 otherwise."""
        try:
            await asyncio.wait_for(control.engine.check_health(), control.settings.probe_timeout_s)
        except Exception as e:
            return JSONResponse({"status": "dead", "detail": str(e)[:500]}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def ready() -> JSONResponse:
        """200 when the engine answers, a draft is loaded and the target's weights are defined;
        503 otherwise (and while the server shuts down), with the reason in `detail`."""
        if control.draining:
            return JSONResponse({"ready": False, "detail": "shutting down"}, status_code=503)
        stale = control.stale_info()  # the refresher's last reply: no engine RPC per probe
        if stale is not None:
            return JSONResponse({"ready": False, "detail": stale}, status_code=503)
        if control.policy_broken is not None:
            return JSONResponse(
                {"ready": False, "detail": control.policy_broken, "policy_broken": True},
                status_code=503,
            )
        version, policy_version = control.versions()
        if version is None:
            return JSONResponse({"ready": False, "detail": "no draft loaded"}, status_code=503)
        return JSONResponse(
            {
                "ready": True,
                "draft_version": version,
                "policy_version": policy_version,
            }
        )

    for path, fn in (("/health", health), ("/ready", ready)):
        if path in wanted:
            r.add_api_route(
                path, fn, methods=["GET"], response_model=None,
                responses={503: {"description": "not alive, or not ready"}},
            )  # fmt: skip
    return r


def document_security(app: FastAPI, token: str | None, extra_paths: Iterable[str] = ()) -> None:
    """With a token configured, the OpenAPI schema names the bearer scheme on every control
    route and on `extra_paths` (so that clients and API fuzzers send it, and can check it is
    enforced)."""
    if token is None:
        return
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "controlToken": {"type": "http", "scheme": "bearer"}
            }
            for path in (*CONTROL_PATHS, *extra_paths):
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation["security"] = [{"controlToken": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ------------------------------------------------------------------------- body limit
class BodyLimit:
    """413 for a request to `paths` whose body exceeds `max_bytes`, declared or streamed: the
    declared length is checked before the body is read, a streamed body as it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int, paths: Iterable[str] = CONTROL_PATHS):
        self.app = app
        self.max_bytes = max_bytes
        self.paths = frozenset(paths)

    def _error(self, size: str) -> ControlError:
        return ControlError(
            413, f"request body is {size} bytes; control requests are limited to {self.max_bytes}"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if scope["type"] != "http" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        error = None
        if declared is not None and not declared.isdigit():
            error = ControlError(400, f"invalid Content-Length {declared[:40]!r}")
        elif declared is not None and int(declared) > self.max_bytes:
            error = self._error(declared.decode())
        if error is not None:
            response = await control_error_response(None, error)  # type: ignore[arg-type]
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._error(f"over {self.max_bytes}")
            return message

        await self.app(scope, limited_receive, send)


# ------------------------------------------------------------------------- wiring
def add_outer_middleware(app: FastAPI, cls: type, **kwargs: Any) -> None:
    """Wrap `app` in ASGI middleware `cls`. vLLM's app has built its middleware stack already
    (its SageMaker bootstrap does), so Starlette's add_middleware would refuse: wrap the built
    stack instead, which also keeps vLLM's middleware instances as they are."""
    if app.middleware_stack is None:
        app.add_middleware(cls, **kwargs)
    else:
        app.middleware_stack = cls(app.middleware_stack, **kwargs)


def install_control(
    app: FastAPI,
    control: EngineControl,
    token: str | None,
    *,
    control_routes: bool = True,
    probes: Iterable[str] = ("/health", "/ready"),
) -> None:
    """Add the codraft control routes (when `control_routes`), the probes named in `probes` and
    the body limit to `app`. Call before the app serves."""
    if control_routes:
        app.include_router(control_router(control, bearer_auth(token)))
        _allow_all_methods(app.router)  # on the app's copies of the routes
        add_outer_middleware(app, BodyLimit, max_bytes=control.settings.max_body_bytes)
    app.include_router(probe_router(control, probes))
