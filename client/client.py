"""`CodraftClient` (sync) and `AsyncCodraftClient`: one method per control route.

    with CodraftClient("http://127.0.0.1:8000", token="...") as c:
        c.wait_ready(timeout=300)
        print(c.draft().version)
        c.publish_draft(5, "/ckpt/draft-v5", sha256="...")  # prepare ahead, then swap

Both share everything but the sending (see `codraft.client.calls`): the same requests, retries (GET
only, on no answer or 5xx; `RetryPolicy`), errors (`codraft.client.errors`) and typed answers
(`codraft.client.models`). The token comes from `token` or $CODRAFT_CONTROL_TOKEN and goes out as
`Authorization: Bearer <token>` on every request.

A server whose control port serves TLS (`codraft serve --ssl-keyfile K --ssl-certfile C`) is
reached at an https:// URL; `verify` says whom to trust: True (the default) the system's CA
bundle, or the file $SSL_CERT_FILE (or folder $SSL_CERT_DIR) names, as httpx reads them; a
path: that CA file (or folder of CA certificates), e.g. the server's own self-signed
certificate; an ssl.SSLContext as it is; False: no check (tests only: anyone on the path can
read the token).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import ssl
import time
from typing import Any, TypeVar

import httpx

from codraft.client import calls
from codraft.client.calls import Call
from codraft.client.errors import CodraftConnectionError, CodraftHTTPError, NotFound, NotReady
from codraft.client.models import (
    DraftInfo,
    DraftStaged,
    Health,
    PolicyInfo,
    Ready,
    Stats,
    TapInfo,
)
from codraft.client.retry import NO_RETRY, RetryPolicy
from codraft.client.settings import resolve_base_url, resolve_token

T = TypeVar("T")
USER_AGENT = "codraft-client/0.1"


Verify = str | bool | ssl.SSLContext


def tls_verify(verify: Verify) -> ssl.SSLContext | bool:
    """What httpx is given for `verify`: True/False/a context as they are, a CA file or folder
    as a context trusting it."""
    if isinstance(verify, bool | ssl.SSLContext):
        return verify
    path = os.fspath(verify)
    try:
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"verify={path!r}: expected a PEM file (or folder) of CA certificates that signed "
            f"the server's certificate; reading it failed: {e}"
        ) from None


class _Config:
    """What both clients hold: the server, the token, timeouts and the retry policy."""

    def __init__(
        self,
        base_url: str | None,
        token: str | None,
        timeout: float,
        load_timeout: float,
        retry: RetryPolicy | None,
        verify: Verify = True,
    ) -> None:
        self.base_url = resolve_base_url(base_url)
        self.token = resolve_token(token)
        self.timeout = timeout
        self.load_timeout = max(load_timeout, timeout)
        self.retry = retry if retry is not None else RetryPolicy()
        self.verify = tls_verify(verify)

    def _http_kwargs(self) -> dict[str, Any]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        return {
            "base_url": self.base_url,
            "headers": headers,
            "timeout": self.timeout,
            "verify": self.verify,
        }

    def _send_args(self, call: Call[Any]) -> dict[str, Any]:
        return {
            "method": call.method,
            "url": call.path,
            "json": call.json,
            "timeout": self.load_timeout if call.slow else self.timeout,
        }

    def _url(self, call: Call[Any]) -> str:
        return self.base_url + call.path

    def __repr__(self) -> str:
        auth = "token" if self.token else "no token"
        return f"{type(self).__name__}({self.base_url!r}, {auth})"


class _ReadyWait:
    """The bookkeeping of wait_ready, shared by both clients."""

    def __init__(self, url: str, timeout: float, interval: float) -> None:
        self.url, self.timeout, self.interval = url, timeout, interval
        self.deadline = time.monotonic() + timeout
        self.last = "no answer yet"

    def seen(self, answer: Ready | Exception) -> Ready | None:
        """`answer` if ready; raises for an error that waiting cannot fix (4xx)."""
        if isinstance(answer, Ready):
            if answer.ready:
                return answer
            self.last = answer.detail or "not ready"
        elif isinstance(answer, CodraftHTTPError) and answer.status < 500:
            raise answer
        elif isinstance(answer, CodraftConnectionError):
            self.last = f"no answer ({type(answer.cause).__name__})"
        else:
            self.last = str(answer)
        return None

    def pause(self) -> float:
        """Seconds to sleep before asking again; raises NotReady when the time is up."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise NotReady(self.url, self.timeout, self.last)
        return min(self.interval, left)


class _StagedWait:
    """The wait of publish_draft for its prepare, shared by both clients: done once the staged
    draft is no longer this ticket's preparation (ready, failed, used up or replaced); when
    `timeout` runs out the swap is sent anyway (it waits for the rest on the server)."""

    def __init__(self, ticket: str | None, timeout: float, interval: float) -> None:
        self.ticket, self.interval = ticket, interval
        self.deadline = time.monotonic() + timeout

    def done(self, answer: DraftStaged | None) -> bool:
        """`answer` None: nothing is staged (404)."""
        return answer is None or answer.ticket != self.ticket or answer.state != "preparing"

    def pause(self) -> float | None:
        left = self.deadline - time.monotonic()
        return None if left <= 0 else min(self.interval, left)


class CodraftClient(_Config):
    """Synchronous client of the codraft control API (httpx.Client)."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        load_timeout: float = 600.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        verify: Verify = True,
    ) -> None:
        super().__init__(base_url, token, timeout, load_timeout, retry, verify)
        self._http = httpx.Client(transport=transport, **self._http_kwargs())

    def _run(self, call: Call[T], retry: RetryPolicy | None = None) -> T:
        policy = retry or self.retry
        for attempt in itertools.count(1):
            try:
                response: httpx.Response | None = self._http.request(**self._send_args(call))
                error: httpx.TransportError | None = None
            except httpx.TransportError as e:
                response, error = None, e
            wait = calls.next_wait(call, policy, attempt, response)
            if wait is None:
                if response is None:
                    raise CodraftConnectionError(call.method, self._url(call), error, attempt)
                return calls.finish(call, self._url(call), response)
            time.sleep(wait)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- routes
    def draft(self) -> DraftInfo:
        """GET /v1/draft: the serving draft and its acceptance."""
        return self._run(calls.get_draft())

    def load_draft(self, version: int, path: str, sha256: str | None = None) -> DraftInfo:
        """POST /v1/draft. NotNewer (409), ContractError (422), NotFound (404); never retried."""
        return self._run(calls.load_draft(version, path, sha256))

    def prepare_draft(
        self, path: str, version: int | None = None, sha256: str | None = None
    ) -> DraftStaged:
        """POST /v1/draft/prepare: the server stages the draft in the background (202, at
        once); a later load_draft of the same checkpoint only installs it. NotNewer (409),
        NotFound (404), ContractError (422, malformed); a check failing later shows in
        staged_draft() and in the load_draft."""
        return self._run(calls.prepare_draft(path, version, sha256))

    def staged_draft(self) -> DraftStaged:
        """GET /v1/draft/prepare: the staged draft's state. NotFound (404) when none is."""
        return self._run(calls.staged_draft())

    def publish_draft(
        self, version: int, path: str, sha256: str | None = None, *, poll_s: float = 0.02
    ) -> DraftInfo:
        """prepare_draft, wait (polling every `poll_s`) until it is staged, then load_draft,
        which then only installs it: the swap itself takes one engine RPC. Errors as
        load_draft's."""
        wait = _StagedWait(
            self.prepare_draft(path, version, sha256).ticket, self.load_timeout, poll_s
        )
        while True:
            try:
                answer: DraftStaged | None = self.staged_draft()
            except NotFound:
                answer = None
            if wait.done(answer) or (pause := wait.pause()) is None:
                return self.load_draft(version, path, sha256)
            time.sleep(pause)

    def rollback_draft(self, reason: str = "manual") -> DraftInfo:
        """POST /v1/draft/rollback: the draft serving afterwards. NotNewer (409) if none kept."""
        return self._run(calls.rollback_draft(reason))

    def load_policy(self, version: int, path: str) -> PolicyInfo:
        """POST /v1/policy: new target weights. NotNewer, ContractError, NotFound as drafts."""
        return self._run(calls.load_policy(version, path))

    def tap(self) -> TapInfo:
        """GET /v1/tap: settings and counters."""
        return self._run(calls.get_tap())

    def set_tap(
        self,
        enabled: bool | None = None,
        mode: str | None = None,
        sample_rate: float | None = None,
        endpoint: str | None = None,
    ) -> TapInfo:
        """PUT /v1/tap; None leaves a setting as it is."""
        return self._run(calls.set_tap(enabled, mode, sample_rate, endpoint))

    def stats(self) -> Stats:
        """GET /v1/stats: the engine's counters now (acceptance by draft version, swaps, tap);
        read these, not metrics(), to measure what a batch of requests did."""
        return self._run(calls.stats())

    def health(self) -> Health:
        """GET /health (no token needed); `.ok` False when the engine is dead."""
        return self._run(calls.health())

    def ready(self) -> Ready:
        """GET /ready (no token needed); `.ready` False while starting or shutting down."""
        return self._run(calls.ready())

    def metrics(self) -> dict[str, float]:
        """GET /metrics, parsed: {'name' or 'name{label="v"}': value}."""
        return self._run(calls.metrics())

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> Ready:
        """Poll /ready until the server serves with a draft; NotReady after `timeout` s."""
        wait = _ReadyWait(self.base_url, timeout, interval)
        while True:
            try:
                answer: Ready | Exception = self._run(calls.ready(), NO_RETRY)
            except (CodraftConnectionError, CodraftHTTPError) as e:
                answer = e
            if (done := wait.seen(answer)) is not None:
                return done
            time.sleep(wait.pause())

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CodraftClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncCodraftClient(_Config):
    """Asynchronous client of the codraft control API (httpx.AsyncClient); same methods as
    `CodraftClient`, awaited."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        load_timeout: float = 600.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        verify: Verify = True,
    ) -> None:
        super().__init__(base_url, token, timeout, load_timeout, retry, verify)
        self._http = httpx.AsyncClient(transport=transport, **self._http_kwargs())

    async def _run(self, call: Call[T], retry: RetryPolicy | None = None) -> T:
        policy = retry or self.retry
        for attempt in itertools.count(1):
            try:
                response: httpx.Response | None = await self._http.request(**self._send_args(call))
                error: httpx.TransportError | None = None
            except httpx.TransportError as e:
                response, error = None, e
            wait = calls.next_wait(call, policy, attempt, response)
            if wait is None:
                if response is None:
                    raise CodraftConnectionError(call.method, self._url(call), error, attempt)
                return calls.finish(call, self._url(call), response)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- routes
    async def draft(self) -> DraftInfo:
        return await self._run(calls.get_draft())

    async def load_draft(self, version: int, path: str, sha256: str | None = None) -> DraftInfo:
        return await self._run(calls.load_draft(version, path, sha256))

    async def prepare_draft(
        self, path: str, version: int | None = None, sha256: str | None = None
    ) -> DraftStaged:
        return await self._run(calls.prepare_draft(path, version, sha256))

    async def staged_draft(self) -> DraftStaged:
        return await self._run(calls.staged_draft())

    async def publish_draft(
        self, version: int, path: str, sha256: str | None = None, *, poll_s: float = 0.02
    ) -> DraftInfo:
        wait = _StagedWait(
            (await self.prepare_draft(path, version, sha256)).ticket, self.load_timeout, poll_s
        )
        while True:
            try:
                answer: DraftStaged | None = await self.staged_draft()
            except NotFound:
                answer = None
            if wait.done(answer) or (pause := wait.pause()) is None:
                return await self.load_draft(version, path, sha256)
            await asyncio.sleep(pause)

    async def rollback_draft(self, reason: str = "manual") -> DraftInfo:
        return await self._run(calls.rollback_draft(reason))

    async def load_policy(self, version: int, path: str) -> PolicyInfo:
        return await self._run(calls.load_policy(version, path))

    async def tap(self) -> TapInfo:
        return await self._run(calls.get_tap())

    async def set_tap(
        self,
        enabled: bool | None = None,
        mode: str | None = None,
        sample_rate: float | None = None,
        endpoint: str | None = None,
    ) -> TapInfo:
        return await self._run(calls.set_tap(enabled, mode, sample_rate, endpoint))

    async def stats(self) -> Stats:
        return await self._run(calls.stats())

    async def health(self) -> Health:
        return await self._run(calls.health())

    async def ready(self) -> Ready:
        return await self._run(calls.ready())

    async def metrics(self) -> dict[str, float]:
        return await self._run(calls.metrics())

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> Ready:
        wait = _ReadyWait(self.base_url, timeout, interval)
        while True:
            try:
                answer: Ready | Exception = await self._run(calls.ready(), NO_RETRY)
            except (CodraftConnectionError, CodraftHTTPError) as e:
                answer = e
            if (done := wait.seen(answer)) is not None:
                return done
            await asyncio.sleep(wait.pause())

    # -------------------------------------------------------------- lifetime
    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncCodraftClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
