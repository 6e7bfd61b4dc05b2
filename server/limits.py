"""Bounds on the HTTP servers' connections: a header-read timeout and a connection cap.

uvicorn closes a keep-alive connection that stays idle between requests
(`timeout_keep_alive`), but it has no limit on how long a request's headers may take: a client
that opens a connection and sends nothing, or a partial request line and then nothing
(slowloris), holds the socket forever, and one that sends a keep-alive connection a few bytes
every few seconds defeats the keep-alive timer too. `header_timeout_protocol` wraps uvicorn's
HTTP protocol class (httptools or h11, whichever uvicorn picks) with a timer: from the moment
the connection opens, and again whenever a response completes, the next request's headers must
be complete within `header_timeout_s`, and may not exceed `max_header_bytes` (431 then); the
connection is closed otherwise. A request whose headers arrived is not timed (its body and its
response may take as long as generation takes).

`limit_concurrency` is uvicorn's own cap: past that many open connections (or running
requests) on one server, new requests are answered 503 at once. Each uvicorn server keeps its
own count, so the OpenAI port and the control port are capped separately: sockets held open on
the OpenAI port never take the control port's /health, /ready and /metrics down with them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("codraft.serve")

HEADER_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
    b"connection: close\r\ncontent-length: 33\r\n\r\nrequest headers exceed the limit\n"
)


def header_timeout_protocol(
    header_timeout_s: float, max_header_bytes: int, base: type | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` (default: the one uvicorn picks, httptools when
    installed) whose connections must deliver each request's headers within
    `header_timeout_s` seconds and `max_header_bytes` bytes."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")

    class HeaderTimeout(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _awaiting: Any = None  # the request cycle current when the timer was armed
        _header_bytes = 0

        def _arm(self) -> None:
            self._disarm()
            self._awaiting, self._header_bytes = self.cycle, 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            transport = self.transport
            if transport.is_closing() or transport.get_protocol() is not self:
                return
            if self.cycle is self._awaiting:  # no request's headers since the timer started
                log.debug("closing a connection: no complete request headers in %s s",
                          header_timeout_s)  # fmt: skip
                transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self._header_timer is not None
            super().data_received(data)
            if not waiting:
                return
            if self.cycle is not self._awaiting or self.transport.get_protocol() is not self:
                self._disarm()  # headers complete (or the connection became a WebSocket)
                return
            self._header_bytes += len(data)
            if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                self._disarm()
                self.transport.write(HEADER_TOO_LARGE)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle = self.cycle is None or self.cycle.response_complete  # no pipelined request
            if idle and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderTimeout.__name__ = HeaderTimeout.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeout


def uvicorn_limits(
    max_connections: int, header_timeout_s: float, max_header_bytes: int
) -> dict[str, Any]:
    """uvicorn.Config keywords for one server: its protocol class and its connection cap."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    return {
        "http": header_timeout_protocol(header_timeout_s, max_header_bytes),
        "limit_concurrency": max_connections,
    }
