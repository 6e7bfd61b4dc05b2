"""The codraft client (client/) against a real HTTP server on 127.0.0.1.

The server here is uvicorn, in a thread, on a free port, serving the real control routes of
server/api.py (`install_control`: bearer auth, body parsing, status mapping, the probes), the
real /metrics collector of server/metrics.py and the real X-Codraft-*-Version middleware of
server/serve.py, all over `StubEngine`, which answers the worker extension's RPCs
(server/worker_ext.py) from a little state instead of a vLLM engine. So status codes and bodies
are the real server's. The real server with vLLM is tested in tests/test_server_api.py; this
file covers the client's behaviour: the auth header (argument and environment), error mapping
(401/404/409/422/5xx), retries on 5xx and on a refused connection for GET but never for POST,
parity of the async client, the openai helpers (draft version header), and the CLI's exit codes
and output.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from codraft.client import (
    NO_RETRY,
    AsyncCodraftClient,
    CodraftClient,
    CodraftConnectionError,
    CodraftHTTPError,
    ContractError,
    InvalidRequest,
    NotFound,
    NotNewer,
    NotReady,
    RetryPolicy,
    Unauthorized,
    UnexpectedResponse,
)
from codraft.client.commands import build_parser
from codraft.client.prom import _parse_lines, parse_metrics
from codraft.client.status import collect_status, render_rich

TOKEN = "tok-client-0123456789"
FAST = RetryPolicy(attempts=4, backoff_s=0.02, max_backoff_s=0.1)
SHA0 = "0" * 64


# ------------------------------------------------------------------------------ the server
class StubEngine:
    """The engine side of server/api.py: answers `collective_rpc` like the worker extension
    (server/worker_ext.py), from state. `fail[method] = n` makes the next n calls raise (the
    API answers 502); `calls` counts every RPC."""

    def __init__(self, ready: bool = True) -> None:
        self.current: dict[str, Any] | None = None
        self.previous: dict[str, Any] | None = None
        if ready:
            self.current = self._slot(0, "/drafts/v0", SHA0)
        self.policy = {"version": 0, "path": "/target", "loaded_at": "t0"}
        self.tap = {"enabled": False, "mode": "full", "sample_rate": 1.0, "endpoint": None}
        self.fail: dict[str, int] = {}
        self.calls: Counter[str] = Counter()
        self.staged: dict[str, Any] | None = None
        self.serial = 0
        self.preparing_polls = 0  # GET /v1/draft/prepare says "preparing" this many times

    @staticmethod
    def _slot(version: int, path: str, sha: str) -> dict[str, Any]:
        return {
            "version": version,
            "sha256": sha,
            "path": path,
            "loaded_at": f"t{version}",
            "kind": "eagle3",
            "tap_layers": [1, 2, 3],
        }

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None) -> list:
        self.calls[method] += 1
        if self.fail.get(method):
            self.fail[method] -= 1
            raise RuntimeError(f"injected failure of {method}")
        return [getattr(self, method)(**(kwargs or {}))]

    async def check_health(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    # ------------------------------------------------------------------ RPCs
    def _draft(self) -> dict[str, Any]:
        if self.current is None:
            return {"version": None}
        prev = self.previous["version"] if self.previous else None
        return {**self.current, "previous_version": prev}

    def codraft_info(self) -> dict[str, Any]:
        return {"ok": True, "draft": self._draft(), "policy": self.policy, "tap": self.tap}

    def codraft_stats(self) -> dict[str, Any]:
        return {
            "ok": True,
            "tap": {"messages_sent": 7, "messages_dropped": 1, "queue_depth": 0},
            "acceptance": {
                "0": {
                    "drafts": 10,
                    "draft_tokens": 30,
                    "accepted_tokens": 12,
                    "acceptance_length": 2.2,
                }
            },
            "swaps": 0,
            "rollbacks": 0,
            "auto_rollbacks": 0,
            "policy_version": self.policy["version"],
        }

    def codraft_prepare_draft(
        self, path: str, version: int | None = None, sha256: str | None = None
    ) -> dict:
        """First half of a swap (codraft.server.draft_swap): checks that need no reading, a
        ticket."""
        if version is not None and version <= self.current["version"]:
            return _refuse(409, f"draft version {version} is not newer than the serving version "
                           f"{self.current['version']}")  # fmt: skip
        if not os.path.isdir(path):
            return _refuse(404, f"{path} does not exist")
        self.serial += 1
        self.staged = {"ticket": f"t{self.serial}", "path": path, "version": version,
                       "sha256": sha256}  # fmt: skip
        return {"ok": True, "ticket": self.staged["ticket"], "version": version, "ready": False}

    def codraft_staged_draft(self) -> dict[str, Any]:
        """The staged draft; "preparing" for the first `preparing_polls` questions."""
        st = self.staged
        if st is None:
            return _refuse(404, "no draft is staged")
        self.preparing_polls -= 1
        state = "preparing" if self.preparing_polls >= 0 else "ready"
        keys = ("ticket", "path", "version")
        return {"ok": True, "staged": {**{k: st[k] for k in keys}, "state": state}}

    def codraft_swap_draft(self, path: str, version: int, sha256: str | None = None) -> dict:
        """POST /v1/draft: commit the staged draft if it is this one, else prepare it."""
        st = self.staged
        if st is not None and st["path"] == path and st["version"] in (None, version):
            st.update(version=version, sha256=sha256 or st["sha256"])
            return {**self.codraft_commit_draft(st["ticket"]), "prepared_ahead": True}
        return {**self.codraft_prepare_draft(path, version, sha256), "prepared_ahead": False}

    def codraft_commit_draft(self, ticket: str) -> dict[str, Any]:
        """Second half: the reading and checksum (here, not in a thread), then the install."""
        st = self.staged
        if st is None or st["ticket"] != ticket:
            return _refuse(409, f"ticket {ticket!r} is not the latest prepared draft")
        self.staged = None
        version = st["version"]
        if version is None:
            version = json.loads((Path(st["path"]) / "codraft.json").read_text())["version"]
        reply = self.codraft_load_draft(st["path"], version, st["sha256"])
        if reply.get("ok"):
            reply.update(ready=True, timing_ms={"prepare_ms": 0.0, "install_ms": 0.0})
        return reply

    def codraft_load_draft(self, path: str, version: int, sha256: str | None = None) -> dict:
        if version <= self.current["version"]:
            return _refuse(409, f"draft version {version} is not newer than the serving version "
                           f"{self.current['version']}")  # fmt: skip
        if not os.path.isdir(path):
            return _refuse(404, f"{path} does not exist")
        weights = Path(path) / "model.safetensors"
        actual = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None
        if actual is None or (sha256 is not None and sha256 != actual):
            return _refuse(422, f"{weights}: sha256 expected {sha256}, found {actual}")
        self.previous, self.current = self.current, self._slot(version, path, actual)
        return {"ok": True, "draft": self._draft()}

    def codraft_rollback_draft(self, reason: str = "manual") -> dict[str, Any]:
        if self.previous is None:
            return _refuse(409, "no previous draft to roll back to")
        rolled, self.current, self.previous = self.current, self.previous, None
        return {"ok": True, "draft": self._draft(), "rolled_back_from": rolled["version"]}

    def codraft_load_policy(self, path: str, version: int) -> dict[str, Any]:
        if version <= self.policy["version"]:
            return _refuse(409, f"policy version {version} is not newer")
        self.policy = {"version": version, "path": path, "loaded_at": "tp"}
        return {"ok": True, "policy": self.policy, "reset_prefix_cache": True}

    def codraft_set_tap(self, **change: Any) -> dict[str, Any]:
        if change.get("mode") == "off":
            change["enabled"] = False
            change.pop("mode")
        merged = {**self.tap, **change}
        if merged["enabled"] and merged["endpoint"] is None:
            return _refuse(422, "cannot enable the tap without an endpoint: give endpoint too")
        self.tap = merged
        return {"ok": True, "tap": self.tap}

    def codraft_request_versions(self, request_ids: list[str]) -> dict[str, Any]:
        version = self.current["version"] if self.current else None
        return {"ok": True, "versions": dict.fromkeys(request_ids, version), "current": version}


def _refuse(status: int, message: str) -> dict[str, Any]:
    return {"ok": False, "status": status, "error": message}


def build_app(engine: StubEngine, token: str | None) -> FastAPI:
    """server/api.py's routes, server/metrics.py's collector, server/serve.py's version headers,
    and two canned OpenAI routes (vLLM's, in the real server)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from codraft.server.api import (
        ControlSettings,
        EngineControl,
        add_outer_middleware,
        install_control,
    )
    from codraft.server.metrics import MetricsEndpoint
    from codraft.server.serve import VersionHeaders

    control = EngineControl(
        engine,
        ControlSettings(rpc_timeout_s=5, probe_timeout_s=5, refresh_s=0.02, stats_refresh_s=None),
    )

    @contextlib.asynccontextmanager
    async def refreshing(app: FastAPI):  # /ready reads what the refresher caches, as served
        control.start()
        yield
        await control.stop()

    app = FastAPI(lifespan=refreshing)
    install_control(app, control, token)
    metrics = MetricsEndpoint(control)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        await metrics.refresh()  # the real route adds vLLM's registry in front
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        message = {"role": "assistant", "content": "4"}
        return JSONResponse(_openai("chat.completion", body, {"message": message}))

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        return JSONResponse(_openai("text_completion", await request.json(), {"text": " 4"}))

    add_outer_middleware(app, VersionHeaders, control=control)
    return app


def _openai(kind: str, body: dict, choice: dict) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": kind,
        "created": 0,
        "model": body["model"],
        "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, **choice}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn on 127.0.0.1:`port`, in a daemon thread."""

    def __init__(self, app: FastAPI, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def engine() -> StubEngine:
    return StubEngine()


@pytest.fixture
def server(engine: StubEngine) -> Iterator[ThreadServer]:
    srv = ThreadServer(build_app(engine, TOKEN)).start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODRAFT_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("CODRAFT_SERVER", raising=False)


def write_checkpoint(folder: Path, version: int, *, recorded_sha: str | None = None) -> str:
    """A folder with model.safetensors (opaque bytes: only its hash matters here) and the
    codraft.json sidecar; returns the weights' sha256."""
    from codraft.draft.checkpoint import DraftMeta

    folder.mkdir(parents=True)
    data = os.urandom(4096)
    (folder / "model.safetensors").write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    meta = DraftMeta(version=version, tap_layers=(1, 2, 3), weights_sha256=recorded_sha or sha)
    (folder / "codraft.json").write_text(json.dumps(meta.to_dict()))
    return sha


class Counting(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        return super().handle_request(request)


class AsyncCounting(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        return await super().handle_async_request(request)


# ------------------------------------------------------------------------------ the client
def test_every_route_with_typed_answers(server: ThreadServer, engine: StubEngine, tmp_path):
    sha = write_checkpoint(tmp_path / "v1", 1)
    with CodraftClient(server.url, TOKEN, retry=FAST) as c:
        assert c.wait_ready(timeout=5).draft_version == 0
        assert c.health().ok and c.ready().policy_version == 0
        d = c.draft()
        assert (d.version, d.sha256, d.tap_layers, d.previous_version) == (0, SHA0, [1, 2, 3], None)
        assert d.kind == "eagle3"
        assert d.acceptance.acceptance_length == 2.2 and d.acceptance.rate == 0.4

        d = c.load_draft(1, str(tmp_path / "v1"), sha256=sha)
        assert (d.version, d.sha256, d.previous_version) == (1, sha, 0)
        assert c.draft().version == 1
        assert c.rollback_draft("test").version == 0
        with pytest.raises(NotNewer, match="no previous draft") as e:
            c.rollback_draft()
        assert e.value.status == 409

        assert c.load_policy(3, "/policy/v3").version == 3
        t = c.set_tap(enabled=True, endpoint="tcp://127.0.0.1:5557", sample_rate=0.5)
        assert (t.enabled, t.sample_rate, t.endpoint, t.stats) == (
            True,
            0.5,
            "tcp://127.0.0.1:5557",
            None,
        )
        assert c.set_tap(mode="off").enabled is False
        tap = c.tap()
        assert tap.stats.messages_sent == 7 and tap.endpoint == "tcp://127.0.0.1:5557"

        st = c.stats()  # the counters now, straight from the engine
        assert st.acceptance[0].accepted_tokens == 12 and st.acceptance_lengths() == {0: 2.2}
        m = c.metrics()
        assert m["codraft_draft_version"] == 0 and m["codraft_policy_version"] == 3
        assert m['codraft_draft_info{kind="eagle3"}'] == 1
        assert m['codraft_draft_acceptance_length{version="0"}'] == 2.2
        assert m["codraft_tap_messages_sent_total"] == 7
    assert engine.calls["codraft_swap_draft"] == engine.calls["codraft_commit_draft"] == 1


def test_auth_header_from_argument_or_environment(server, engine, monkeypatch):
    for token, message in ((None, "missing control token"), ("wrong", "invalid control token")):
        with CodraftClient(server.url, token) as c:
            with pytest.raises(Unauthorized, match=message) as e:
                c.draft()
            assert e.value.status == 401 and "--token" in str(e.value)
            assert c.health().ok and c.ready().ready  # probes need no token
    monkeypatch.setenv("CODRAFT_CONTROL_TOKEN", f" {TOKEN}\n")
    monkeypatch.setenv("CODRAFT_SERVER", server.url + "/v1/")  # the OpenAI base URL works too
    with CodraftClient() as c:
        assert c.draft().version == 0
        assert c.base_url == server.url and "token" in repr(c) and TOKEN not in repr(c)


def test_refusals_map_to_exceptions_with_the_server_message(server, engine, tmp_path):
    sha = write_checkpoint(tmp_path / "v5", 5)
    with CodraftClient(server.url, TOKEN, retry=FAST) as c:
        with pytest.raises(NotNewer, match="not newer than the serving version 0"):
            c.load_draft(0, str(tmp_path / "v5"))
        with pytest.raises(NotFound, match="does not exist") as e:
            c.load_draft(5, str(tmp_path / "nowhere"))
        assert e.value.status == 404 and "server's machine" in str(e.value)
        with pytest.raises(ContractError, match="sha256 expected") as e:
            c.load_draft(5, str(tmp_path / "v5"), sha256="f" * 64)
        assert e.value.status == 422 and e.value.message.startswith(str(tmp_path / "v5"))
        with pytest.raises(ContractError, match="without an endpoint"):
            c.set_tap(enabled=True)
        assert c.draft().version == 0  # nothing changed
        sent = engine.calls["codraft_load_draft"]
        for bad in (
            lambda: c.load_draft(-1, "/p"),
            lambda: c.load_draft(1, ""),
            lambda: c.load_draft(1, "/p", sha256="abc"),
            lambda: c.load_policy(True, "/p"),  # type: ignore[arg-type]
            lambda: c.set_tap(sample_rate=1.5),
            lambda: c.set_tap(endpoint="http://x"),
            lambda: c.rollback_draft("x" * 201),
        ):
            with pytest.raises(InvalidRequest, match="(?i)invalid|reason"):
                bad()
        assert engine.calls["codraft_load_draft"] == sent  # never sent
        assert c.load_draft(5, str(tmp_path / "v5"), sha).version == 5


def test_get_retries_on_5xx_post_never(server, engine):
    transport = Counting()
    with CodraftClient(server.url, TOKEN, retry=NO_RETRY) as c:
        engine.fail["codraft_stats"] = 1
        with pytest.raises(CodraftHTTPError):
            c.draft()
        assert engine.calls["codraft_stats"] == 1
    with CodraftClient(server.url, TOKEN, retry=FAST, transport=transport) as c:
        engine.fail["codraft_stats"] = 2  # GET /v1/draft answers 502 twice, then 200
        assert c.draft().version == 0
        assert transport.sent == ["GET /v1/draft"] * 3
        engine.fail["codraft_stats"] = 4  # more than the attempts
        with pytest.raises(CodraftHTTPError, match="injected failure") as e:
            c.draft()
        assert e.value.status == 502 and "server failed" in str(e.value)
        assert transport.sent.count("GET /v1/draft") == 3 + 4

        transport.sent.clear()
        engine.fail["codraft_swap_draft"] = 1
        with pytest.raises(CodraftHTTPError, match="injected failure") as e:
            c.load_draft(1, "/p")
        assert e.value.status == 502 and transport.sent == ["POST /v1/draft"]
        engine.fail["codraft_set_tap"] = 1
        with pytest.raises(CodraftHTTPError):
            c.set_tap(sample_rate=0.1)
        assert transport.sent == ["POST /v1/draft", "PUT /v1/tap"]
        engine.fail.clear()
        engine.current = None  # /ready 503 is an answer, not a failure: no retry
        time.sleep(0.3)  # the refresher (every 20 ms) has seen it
        assert c.ready().ready is False and transport.sent[-1] == "GET /ready"
        assert transport.sent.count("GET /ready") == 1


def test_refused_connection_get_retried_until_up_post_once():
    port = free_port()
    late = ThreadServer(build_app(StubEngine(), TOKEN), port)
    transport = Counting()
    slow = RetryPolicy(attempts=30, backoff_s=0.1, max_backoff_s=0.4)  # up to ~11 s
    with CodraftClient(late.url, TOKEN, retry=slow, transport=transport) as c:
        with pytest.raises(CodraftConnectionError, match="no answer") as e:
            c.load_draft(1, "/p")  # nobody listens: one try only
        assert e.value.attempts == 1 and transport.sent == ["POST /v1/draft"]
        timer = threading.Timer(0.4, late.start)
        timer.start()
        try:
            assert c.draft().version == 0  # refused until the server is up
            assert transport.sent.count("GET /v1/draft") > 1
        finally:
            timer.join()
            late.stop()
    with CodraftClient(late.url, TOKEN, retry=FAST) as c:  # down again
        with pytest.raises(CodraftConnectionError, match="after 4 attempts"):
            c.tap()
        with pytest.raises(NotReady, match="not ready after"):
            c.wait_ready(timeout=0.3, interval=0.05)


def test_wait_ready_waits_for_a_draft(engine: StubEngine, server: ThreadServer):
    engine.current = None
    with CodraftClient(server.url, TOKEN) as c:
        with pytest.raises(NotReady, match="no draft loaded"):
            c.wait_ready(timeout=0.3, interval=0.05)
        threading.Timer(
            0.3, lambda: setattr(engine, "current", engine._slot(2, "/d", SHA0))
        ).start()
        assert c.wait_ready(timeout=30, interval=0.05).draft_version == 2


def test_async_client_matches_the_sync_one(server, engine, tmp_path):
    sha = write_checkpoint(tmp_path / "v1", 1)
    path = str(tmp_path / "v1")

    def script_sync() -> list[Any]:
        with CodraftClient(server.url, TOKEN, retry=FAST) as c:
            out: list[Any] = [c.wait_ready(5), c.health(), c.draft(), c.tap()]
            out += [c.load_draft(1, path, sha), c.rollback_draft(), c.load_policy(1, "/p")]
            out += [c.set_tap(sample_rate=0.25), c.metrics(), c.stats()]
            for bad in (lambda: c.load_draft(0, path), lambda: c.rollback_draft()):
                try:
                    bad()
                except CodraftHTTPError as e:
                    out.append((type(e), e.status, e.message))
            return out

    async def script_async() -> list[Any]:
        async with AsyncCodraftClient(server.url, TOKEN, retry=FAST) as c:
            out: list[Any] = [await c.wait_ready(5), await c.health(), await c.draft()]
            out += [await c.tap(), await c.load_draft(1, path, sha), await c.rollback_draft()]
            out += [await c.load_policy(1, "/p"), await c.set_tap(sample_rate=0.25)]
            out += [await c.metrics(), await c.stats()]
            for bad in (c.load_draft(0, path), c.rollback_draft()):
                try:
                    await bad
                except CodraftHTTPError as e:
                    out.append((type(e), e.status, e.message))
            return out

    def untimed(results: list) -> list:  # a swap's timing_ms differs from run to run
        return [r.model_copy(update={"timing_ms": None}) if hasattr(r, "timing_ms") else r
                for r in results]  # fmt: skip

    first = untimed(script_sync())
    engine.__init__()  # same starting state
    second = untimed(asyncio.run(script_async()))
    assert first == second and len(first) == 12
    assert first[-2][:2] == (NotNewer, 409)

    async def retries() -> tuple[list[str], int]:
        transport = AsyncCounting()
        async with AsyncCodraftClient(server.url, None, retry=FAST) as c:
            with pytest.raises(Unauthorized):
                await c.draft()
        async with AsyncCodraftClient(server.url, TOKEN, retry=FAST, transport=transport) as c:
            engine.fail["codraft_stats"] = 1
            await c.draft()
            engine.fail["codraft_swap_draft"] = 1
            with pytest.raises(CodraftHTTPError) as e:
                await c.load_draft(9, "/p")
            return transport.sent, e.value.status

    sent, status = asyncio.run(retries())
    assert status == 502
    assert sent == ["GET /v1/draft"] * 2 + ["POST /v1/draft"]


def test_publish_draft_stages_ahead_and_the_swap_only_installs(server, engine, tmp_path):
    sha = write_checkpoint(tmp_path / "v1", 1)
    write_checkpoint(tmp_path / "v2", 2)
    v1, v2 = str(tmp_path / "v1"), str(tmp_path / "v2")

    def script_sync(transport: Counting) -> list[Any]:
        with CodraftClient(server.url, TOKEN, retry=FAST, transport=transport) as c:
            staged = c.prepare_draft(v1)  # version from codraft.json
            out: list[Any] = [staged.state, staged.version]
            out.append(c.staged_draft().ticket == staged.ticket)
            engine.preparing_polls = 2
            out.append(c.publish_draft(1, v1, sha))
            for bad in (lambda: c.publish_draft(2, v2, "f" * 64), lambda: c.prepare_draft(v1, 1)):
                try:
                    bad()
                except CodraftHTTPError as e:
                    out.append((type(e), e.status))
            try:
                c.staged_draft()
            except NotFound as e:
                out.append(e.status)
            return out

    async def script_async(transport: AsyncCounting) -> list[Any]:
        async with AsyncCodraftClient(server.url, TOKEN, retry=FAST, transport=transport) as c:
            staged = await c.prepare_draft(v1)
            out: list[Any] = [staged.state, staged.version]
            out.append((await c.staged_draft()).ticket == staged.ticket)
            engine.preparing_polls = 2
            out.append(await c.publish_draft(1, v1, sha))
            for bad in (c.publish_draft(2, v2, "f" * 64), c.prepare_draft(v1, 1)):
                try:
                    await bad
                except CodraftHTTPError as e:
                    out.append((type(e), e.status))
            try:
                await c.staged_draft()
            except NotFound as e:
                out.append(e.status)
            return out

    def untimed(results: list) -> list:
        return [r.model_copy(update={"timing_ms": None}) if hasattr(r, "timing_ms") else r
                for r in results]  # fmt: skip

    transport = Counting()
    first = untimed(script_sync(transport))
    assert first[:3] == ["preparing", None, True]
    assert (first[3].version, first[3].sha256, first[3].previous_version) == (1, sha, 0)
    assert first[4:] == [(ContractError, 422), (NotNewer, 409), 404]
    # the publish: prepare, wait while "preparing", then one swap that only commits
    publish = transport.sent[2:7]
    assert publish == ["POST /v1/draft/prepare"] + ["GET /v1/draft/prepare"] * 3 + [
        "POST /v1/draft"
    ], transport.sent
    assert engine.calls["codraft_swap_draft"] == 2 and engine.calls["codraft_commit_draft"] == 0
    engine.__init__()  # same starting state
    async_transport = AsyncCounting()
    second = untimed(asyncio.run(script_async(async_transport)))
    assert first == second and async_transport.sent == transport.sent


def test_learner_publisher_prepares_then_commits(server, engine, tmp_path):
    from codraft.learner.online.publisher import Publisher

    sha = write_checkpoint(tmp_path / "v4", 4)
    transport = Counting()
    with CodraftClient(server.url, TOKEN, retry=FAST, transport=transport) as c:
        publisher = Publisher(c, attempts=2, backoff_s=0.01)
        outcome = publisher.publish(tmp_path / "v4")
        assert (outcome.ok, outcome.status, outcome.server_version) == (True, 200, 4)
        assert engine.current["sha256"] == sha
        assert transport.sent[:1] == ["POST /v1/draft/prepare"]
        assert transport.sent[-1] == "POST /v1/draft"
        again = publisher.publish(tmp_path / "v4")  # not newer any more: the server's version
        assert (again.ok, again.status, again.server_version) == (False, 409, 4)
        write_checkpoint(tmp_path / "v5", 5, recorded_sha="b" * 64)
        bad = publisher.publish(tmp_path / "v5")
        assert (bad.ok, bad.status) == (False, 422) and "sha256" in bad.message
        assert engine.current["version"] == 4


def test_openai_package_and_the_draft_version_header(server: ThreadServer, engine: StubEngine):
    from codraft.client.openai_helpers import (
        chat_with_version,
        complete_with_version,
        draft_version,
        openai_client,
        policy_version,
    )

    with CodraftClient(server.url) as c:
        c.wait_ready(5)  # the arrival-time versions come from the server's cache, filled here
    oai = openai_client(server.url)
    assert str(oai.base_url).rstrip("/") == server.url + "/v1"
    chat, version = chat_with_version(
        oai, model="m", messages=[{"role": "user", "content": "2+2?"}], max_tokens=1
    )
    assert chat.choices[0].message.content == "4" and version == 0
    raw = oai.with_raw_response.completions.create(model="m", prompt="2+2=", max_tokens=1)
    assert draft_version(raw) == 0 and policy_version(raw) == 0 and raw.parse().choices
    engine.current = engine._slot(7, "/d", SHA0)
    completion, version = complete_with_version(oai, model="m", prompt="2+2=", max_tokens=1)
    assert completion.choices[0].text == " 4" and version == 7
    assert (
        draft_version(httpx.Response(200, headers={"X-Codraft-Draft-Version": "unknown"})) is None
    )
    with pytest.raises(ValueError, match="stream=True"):
        chat_with_version(oai, model="m", messages=[], stream=True)


def test_metrics_parsing_and_retry_policy() -> None:
    text = (
        "# HELP a_total x\n# TYPE a_total counter\na_total 3.0\n"
        '# TYPE b gauge\nb{version="2",k="v w"} 1.5\nc +Inf\n'
    )
    expected = {"a_total": 3.0, 'b{k="v w",version="2"}': 1.5, "c": float("inf")}
    assert parse_metrics(text) == expected and _parse_lines(text) == expected
    p = RetryPolicy(attempts=5, backoff_s=1, multiplier=2, max_backoff_s=3, jitter=0)
    assert [p.wait(i) for i in (1, 2, 3, 4)] == [1, 2, 3, 3]
    assert (
        p.next_wait("GET", 5, failed=True) is None and p.next_wait("GET", 1, failed=False) is None
    )
    assert p.next_wait("POST", 1, failed=True) is None and p.next_wait("get", 1, failed=True) == 1
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


# ------------------------------------------------------------------------------ the CLI
def cli(*argv: str) -> int:
    args = build_parser().parse_args(list(argv))
    return args._commands[args.command](args)


def test_cli_status(server: ThreadServer, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert cli("status", "--server", server.url, "--token", TOKEN) == 0
    out = capsys.readouterr().out
    for line in ("health", "ok"), ("draft", "v0  sha256 000000000000"), ("policy", "v0"):
        assert any(r.split()[:1] == [line[0]] and line[1] in r for r in out.splitlines()), out
    assert "length 2.20 over 10 verifications; 40.0% of 30 draft tokens" in out
    assert "7 messages sent, 1 dropped" in out

    assert cli("status", "--server", server.url, "--json") == 1  # no token: draft/tap refused
    data = json.loads(capsys.readouterr().out)
    assert data["health"]["status"] == "ok" and data["draft"] is None
    assert "401" in data["errors"]["draft"] and data["policy"] == {"version": 0}

    with CodraftClient(server.url, TOKEN) as c:
        buf = io.StringIO()
        render_rich(collect_status(c), buf)
        assert "acceptance" in buf.getvalue() and "tap stream" in buf.getvalue()


def test_cli_draft_policy_tap_and_exit_codes(
    server: ThreadServer, engine: StubEngine, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    auth = ["--server", server.url, "--token-file", str(token_file)]
    sha = write_checkpoint(tmp_path / "v3", 3)

    # version and sha256 from the folder; staged first, then installed
    assert cli("draft", "prepare", "--path", str(tmp_path / "v3"), *auth) == 0
    assert "draft v3 being staged" in capsys.readouterr().out
    assert engine.staged["path"] == os.path.realpath(tmp_path / "v3")
    assert engine.current["version"] == 0
    assert cli("draft", "load", "--path", str(tmp_path / "v3"), *auth) == 0
    assert "draft v3 serving" in capsys.readouterr().out and engine.current["sha256"] == sha
    assert engine.current["path"] == os.path.realpath(tmp_path / "v3")
    assert engine.calls["codraft_prepare_draft"] == 2  # `load` stages too, then commits
    assert engine.calls["codraft_swap_draft"] == 1 and engine.calls["codraft_commit_draft"] == 0
    # the server refuses: exit 1, its message on stderr
    assert cli("draft", "load", "--path", str(tmp_path / "v3"), *auth) == 1
    assert "not newer than the serving version 3" in capsys.readouterr().err
    # refused here: codraft.json disagrees with the weights, or with --version
    write_checkpoint(tmp_path / "bad", 4, recorded_sha="a" * 64)
    loads = engine.calls["codraft_load_draft"]
    assert cli("draft", "load", "--path", str(tmp_path / "bad"), *auth) == 1
    assert "corrupt or still being copied" in capsys.readouterr().err
    assert cli("draft", "load", "--path", str(tmp_path / "v3"), "--version", "9", *auth) == 1
    assert "codraft.json says version 3" in capsys.readouterr().err
    assert cli("draft", "load", "--path", "/srv/elsewhere", *auth) == 2  # not here, no --version
    assert "pass --version" in capsys.readouterr().err
    assert engine.calls["codraft_load_draft"] == loads
    # a path only the server sees: sent as given, sha256 left to the server
    assert cli("draft", "load", "--path", "/srv/v9", "--version", "9", *auth) == 1
    err = capsys.readouterr().err
    assert "not readable here" in err and "404" in err and "does not exist" in err

    assert cli("draft", "rollback", *auth) == 0
    assert "rolled back: draft v0 serving" in capsys.readouterr().out
    assert cli("draft", "rollback", *auth) == 1
    assert "409" in capsys.readouterr().err

    assert cli("policy", "load", "--version", "2", "--path", "/w", *auth) == 0
    assert "policy v2 serving, from /w" in capsys.readouterr().out

    endpoint = "tcp://127.0.0.1:5557"
    assert (
        cli("tap", "set", "--enabled", "--endpoint", endpoint, "--sample-rate", "0.5", *auth) == 0
    )
    assert (
        capsys.readouterr().out.strip()
        == f"tap on, mode full, sample rate 0.5, endpoint {endpoint}"
    )
    assert cli("tap", "set", "--mode", "off", *auth) == 0 and engine.tap["enabled"] is False
    capsys.readouterr()

    # usage: exit 2
    assert cli("tap", "set", *auth) == 2 and "nothing to set" in capsys.readouterr().err
    assert cli("status", "--server", server.url, "--token", "x", "--token-file", "f") == 2
    (tmp_path / "empty").write_text("\n")
    assert cli("status", "--server", server.url, "--token-file", str(tmp_path / "empty")) == 2
    assert "is empty" in capsys.readouterr().err
    for argv in (
        ["tap", "set", "--sample-rate", "2", *auth],
        ["tap", "set", "--enabled", "--disabled", *auth],
        ["draft", "load", "--path", "x", "--sha256", "zz", *auth],
        ["draft", "load", "--version", "-1", "--path", "x", *auth],
        ["draft", *auth],
    ):
        with pytest.raises(SystemExit) as e:
            cli(*argv)
        assert e.value.code == 2, argv
    # a wrong token: exit 1
    assert cli("draft", "rollback", "--server", server.url, "--token", "wrong") == 1
    assert "invalid control token" in capsys.readouterr().err


def test_cli_as_a_process_unreachable_is_3(server: ThreadServer) -> None:
    env = {**os.environ, "CODRAFT_CONTROL_TOKEN": TOKEN, "CODRAFT_SERVER": server.url}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "codraft.client", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = run("status")
    assert ok.returncode == 0, ok.stderr
    assert "draft" in ok.stdout and "v0" in ok.stdout
    down = run("status", "--server", f"127.0.0.1:{free_port()}")
    assert down.returncode == 3
    assert "no answer after 4 attempts" in down.stderr and "codraft serve" in down.stderr
    assert run("draft").returncode == 2


def test_a_server_without_the_control_routes_says_so() -> None:
    """E.g. the OpenAI port of a server started with --control-port; or something else."""
    app = FastAPI()

    @app.get("/v1/tap")
    async def not_codraft() -> PlainTextResponse:
        return PlainTextResponse("<html>hello</html>")

    bare = ThreadServer(app).start()
    try:
        with CodraftClient(bare.url, TOKEN, retry=FAST) as c:
            with pytest.raises(NotFound, match="no such route.*--control-port"):
                c.draft()
            with pytest.raises(NotFound):  # waiting would not help
                c.wait_ready(timeout=30)
            with pytest.raises(UnexpectedResponse, match="not what the codraft control API"):
                c.tap()
        assert cli("status", "--server", bare.url) == 1
    finally:
        bare.stop()
