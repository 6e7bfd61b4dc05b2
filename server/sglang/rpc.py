"""codraft's calls into SGLang's scheduler process: a ZeroMQ socket of codraft's own.

SGLang's own RPC (`Engine.collective_rpc`) runs a scheduler method between batches but brings
back only success and an error message, so codraft's replies (draft info, stats, a swap's
timing) could not travel on it. The scheduler-side `RpcServer` binds a REP socket on an ipc://
endpoint in a private folder and is polled, without blocking, once per scheduler loop (the
plugin hooks `Scheduler.process_input_requests`): a call runs between two batches, as a vLLM
collective RPC does. Frames are msgpack maps (never pickle), limited in size by ZeroMQ.

`RpcClient` is the serving process's side and has the shape `codraft.server.api.EngineControl`
expects of an engine (`collective_rpc(method, timeout=, kwargs=)` returning one reply per
rank), so the control API, its swap lock and its errors are the vLLM engine's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20  # a call or a reply: a few KiB in practice


class RpcServer:
    """Answers calls on `endpoint` with `handle(method, kwargs) -> dict` (never raises)."""

    def __init__(self, endpoint: str, handle: Callable[[str, dict], dict]) -> None:
        self.handle = handle
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = endpoint

    def poll(self, max_calls: int = 8) -> int:
        """Answer the calls waiting now (at most `max_calls`); returns how many."""
        done = 0
        while done < max_calls:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.sock.send(msgpack.packb(self._answer(frame), default=str))
            done += 1
        return done

    def _answer(self, frame: bytes) -> dict:
        try:
            call = msgpack.unpackb(frame, raw=False)
            method, kwargs = call["method"], call.get("kwargs") or {}
            if not isinstance(method, str) or not isinstance(kwargs, dict):
                raise TypeError("a call is {method: str, kwargs: map}")
        except Exception as e:
            return {"ok": False, "status": 400, "error": f"malformed codraft call: {e}"}
        try:
            return self.handle(method, kwargs)
        except Exception as e:  # the handler answers its own errors; this is a bug
            log.exception("codraft: %s failed", method)
            return {"ok": False, "status": 500, "error": f"{method} failed: {e}"}

    def close(self) -> None:
        self.sock.close(0)


class RpcClient:
    """Calls into the scheduler (one at a time: a REP socket answers in order)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.asyncio.Context.instance()
        self.lock = asyncio.Lock()
        self.sock: zmq.asyncio.Socket | None = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.endpoint)
        return self.sock

    async def call(self, method: str, timeout: float = 30.0, **kwargs: Any) -> dict:
        async with self.lock:
            sock = self._socket()
            try:
                await sock.send(msgpack.packb({"method": method, "kwargs": kwargs}))
                if not await sock.poll(int(timeout * 1000), zmq.POLLIN):
                    raise TimeoutError(f"the scheduler did not answer {method} in {timeout} s")
                reply = msgpack.unpackb(await sock.recv(), raw=False)
            except BaseException:
                # a REQ socket that missed its reply cannot send again: start a new one
                self.sock = None
                sock.close(0)
                raise
        if not isinstance(reply, dict):
            raise TypeError(f"{method} answered {reply!r}; expected a map")
        return reply

    async def collective_rpc(
        self, method: str, timeout: float | None = None, kwargs: dict | None = None
    ) -> list[dict]:
        """EngineControl's interface: one reply per rank (codraft's SGLang engine has one)."""
        return [await self.call(method, timeout or 30.0, **(kwargs or {}))]

    async def check_health(self) -> None:
        """Raises unless the scheduler answers (the engine's loop runs)."""
        reply = await self.call("codraft_info", timeout=5.0)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error") or "codraft_info failed")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
