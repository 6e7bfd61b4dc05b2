"""vLLM's `--api-key` on every route of the OpenAI port, not only on vLLM's guarded prefixes.

vLLM's own check guards the paths under /v1, /v2, /inference and /cohere; /invocations,
/tokenize, /detokenize, /pooling, /score, /classify, /rerank, /version and the rest answer
anyone. `ApiKeyGuard` is ASGI middleware, the outermost layer of the OpenAI port, that asks for
`Authorization: Bearer <key>` on every HTTP and WebSocket request but:

- `/health`, `/ready` and `/metrics`: probes and Prometheus scrapers carry no credentials, and
  all three read local state only (the engine's liveness, the cached versions and counters:
  no request reaches the engine, so scraping at any rate costs it nothing); /metrics reveals
  counters and versions, nothing that changes the server (vLLM's metrics mount below it,
  /metrics/..., needs the key);
- CORS preflights (OPTIONS with Access-Control-Request-Method): browsers send them without
  credentials; vLLM's CORS middleware answers them without reaching a route;
- the codraft control routes when they share this port: they carry the control token instead
  (`codraft.server.auth`), in the same header.

The keys come from `--api-key` (several allowed, as vLLM allows) or, without it,
$VLLM_API_KEY, exactly as vLLM reads them; without a key the guard is not installed. Keys are
compared in constant time (`codraft.server.auth.token_matches`); a refusal is 401 in OpenAI's
error format with a `WWW-Authenticate: Bearer` challenge, and never echoes what was sent.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from codraft.server.auth import key_digest, token_matches
from codraft.server.refusal import openai_refusal

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
API_KEY_ENV = "VLLM_API_KEY"
MISSING = (
    "this server requires an API key: send the header 'Authorization: Bearer <key>' with the "
    "key it was started with (--api-key or $VLLM_API_KEY)"
)
WRONG = (
    "invalid API key: expected 'Authorization: Bearer <key>' with the key the server was "
    "started with (--api-key or $VLLM_API_KEY)"
)


def api_keys(args: Any, environ: dict[str, str] | None = None) -> list[str]:
    """The API keys vLLM would require: `args.api_key` (a list, or one string), else
    $VLLM_API_KEY; empty strings dropped (as vLLM drops them)."""
    given = getattr(args, "api_key", None)
    if isinstance(given, str):
        given = [given]
    env = os.environ if environ is None else environ
    return [k for k in (given or [env.get(API_KEY_ENV)]) if k]


class ApiKeyGuard:
    """401 for every request without one of `keys`, except on `open_paths` and CORS
    preflights."""

    def __init__(
        self, app: ASGIApp, keys: Iterable[str], open_paths: Iterable[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.digests = [key_digest(k) for k in keys]
        if not self.digests:
            raise ValueError("ApiKeyGuard needs at least one API key")
        self.open_paths = frozenset(open_paths)

    def _allowed(self, header: str | None) -> bool:
        ok = False
        for digest in self.digests:  # every key compared: the timing names none of them
            ok |= token_matches(header, digest)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        headers = {k.lower(): v for k, v in scope.get("headers") or []}
        preflight = scope.get("method") == "OPTIONS" and b"access-control-request-method" in headers
        if path in self.open_paths or preflight:
            await self.app(scope, receive, send)
            return
        raw = headers.get(b"authorization")
        header = raw.decode("latin-1") if raw is not None else None
        if self._allowed(header):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # closing before accept answers the handshake 403
            await send({"type": "websocket.close", "code": 1008})
            return
        challenge = 'Bearer realm="openai"' + ("" if header is None else ', error="invalid_token"')
        detail = MISSING if header is None else WRONG
        refusal = openai_refusal(
            detail, 401, "AuthenticationError", headers={"WWW-Authenticate": challenge}
        )
        await refusal(scope, receive, send)
