"""The answer an ASGI guard in front of vLLM's app gives when it refuses a request: OpenAI's error
body (what vLLM's own errors look like), or the control API's `{"detail": ...}`, as a
starlette response that the guard calls as an ASGI app."""

from __future__ import annotations

from starlette.responses import JSONResponse


def openai_refusal(
    message: str,
    status: int,
    kind: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    error = {"message": message, "type": kind, "param": param, "code": status}
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def control_refusal(message: str, status: int) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)
