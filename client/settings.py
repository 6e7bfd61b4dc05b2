"""Where the client finds the server and its token: arguments first, then the environment."""

from __future__ import annotations

import os
from pathlib import Path

from codraft.client.errors import InvalidRequest

DEFAULT_SERVER = "http://127.0.0.1:8000"
SERVER_ENV = "CODRAFT_SERVER"
TOKEN_ENV = "CODRAFT_CONTROL_TOKEN"


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


def resolve_token(token: str | None = None) -> str | None:
    """`token`, else $CODRAFT_CONTROL_TOKEN; surrounding whitespace dropped; empty means none."""
    value = token if token is not None else os.environ.get(TOKEN_ENV)
    value = (value or "").strip()
    return value or None


def read_token_file(path: str | os.PathLike) -> str:
    """The token in file `path` (whitespace stripped); InvalidRequest if unreadable or empty."""
    try:
        value = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read the token file {path}: {e}") from None
    if not value:
        raise InvalidRequest(f"the token file {path} is empty; expected the control token")
    return value
