"""Where the client finds the server and its token: arguments first, then the environment."""

from __future__ import annotations

import os

from codraft.client.errors import InvalidRequest
from codraft.control_token import TOKEN_ENV, resolve_control_token

DEFAULT_SERVER = "http://127.0.0.1:8000"
SERVER_ENV = "CODRAFT_SERVER"
__all__ = ["DEFAULT_SERVER", "SERVER_ENV", "TOKEN_ENV", "resolve_base_url", "resolve_token"]


def resolve_base_url(base_url: str | None = None) -> str:
    """`base_url`, else $CODRAFT_SERVER, else http://127.0.0.1:8000; "host:port" gets http://,
    and a trailing "/" or "/v1" (the OpenAI base URL) is dropped: routes are absolute."""
    url = (base_url or os.environ.get(SERVER_ENV) or DEFAULT_SERVER).strip()
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"server URL must be http:// or https://, like {DEFAULT_SERVER}; got {url!r}"
        )
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def resolve_token(
    token: str | None = None, token_file: str | os.PathLike | None = None
) -> str | None:
    """`token`, else the contents of `token_file`, else $CODRAFT_CONTROL_TOKEN; None when none
    is set (`codraft.control_token`, the server's and the learner's rules too). InvalidRequest
    when both are given, the file is unreadable or empty, or the token is not a usable one."""
    try:
        return resolve_control_token(token, token_file)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
