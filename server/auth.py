"""Bearer-token check for the codraft control routes.

A FastAPI dependency: `Depends(bearer_auth(token))` on the control router. The token is compared
in constant time (both sides hashed to 32 bytes first, so not even the length leaks). Failures
are 401 with a `WWW-Authenticate: Bearer` challenge and never echo what was sent. With no token
configured the dependency lets every request through; `codraft serve` only allows that when the
control routes listen on a loopback address.

The OpenAI routes never see this dependency (vLLM's --api-key guards them:
`codraft.server.api_key`). /health, /ready and /metrics of the control port stay open (probes and
Prometheus scrapers normally carry no credentials; they reveal versions and counters only, read
from a cache: no request reaches the engine).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

REALM = "codraft"


class ControlError(Exception):
    """A control request failed: answered as HTTP `status` with `{"detail": message}`.

    Raised by the auth dependency, body parsing and failed engine RPCs; the control routes
    answer it themselves with `control_error_response` (codraft.server.api.ControlRoute), so vLLM's
    HTTPException handler never reshapes it into OpenAI's error format.
    """

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


async def control_error_response(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ControlError)
    return JSONResponse({"detail": exc.message}, status_code=exc.status, headers=exc.headers)


def key_digest(value: str) -> bytes:
    """The 32 bytes a token or key is compared as (`token_matches`)."""
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


_digest = key_digest


def _unauthorized(detail: str, error: str | None) -> ControlError:
    challenge = f'Bearer realm="{REALM}"' + (f', error="{error}"' if error else "")
    return ControlError(401, detail, headers={"WWW-Authenticate": challenge})


def token_matches(header: str | None, expected_digest: bytes) -> bool:
    """True when `header` is 'Bearer <token>' with the expected token (constant time)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    # Compare even for a wrong scheme, so the timing does not depend on it.
    same = hmac.compare_digest(_digest(value.strip()), expected_digest)
    return same and scheme.lower() == "bearer"


def bearer_auth(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that requires `Authorization: Bearer <token>` (or nothing if token is None)."""
    if token is None:

        async def open_access(request: Request) -> None:
            return None

        return open_access
    expected = _digest(token)

    async def require_token(request: Request) -> None:
        header = request.headers.get("authorization")
        if not header:
            raise _unauthorized(
                "missing control token: send the header 'Authorization: Bearer <token>'", None
            )
        if not token_matches(header, expected):
            raise _unauthorized(
                "invalid control token: expected 'Authorization: Bearer <token>' with the token "
                "the server was started with",
                "invalid_token",
            )

    return require_token
