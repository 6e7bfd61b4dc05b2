"""The control token: where it comes from and what it may look like.

Control routes take a bearer token when one is configured. The server (`codraft serve`), the
learner (`codraft learn --server`) and the client (the SDK and its CLI subcommands) all find it
the same way: a token given outright, else the contents of a token file, else
$CODRAFT_CONTROL_TOKEN; none of them set means no token. Surrounding whitespace (a file's final
newline) is dropped; what remains must be non-empty, printable and free of whitespace, since it
travels in an HTTP header.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

TOKEN_ENV = "CODRAFT_CONTROL_TOKEN"
# the option names errors mention: (token, token file); the server's are --control-token(-file)
CLIENT_FLAGS = ("--token", "--token-file")


def check_token_sources(
    token: str | None, token_file: str | os.PathLike | None, flags: tuple[str, str] = CLIENT_FLAGS
) -> None:
    """Refuse a token given both outright and as a file (ValueError)."""
    if token is not None and token_file is not None:
        raise ValueError(f"give {flags[0]} or {flags[1]}, not both")


def resolve_control_token(
    token: str | None = None,
    token_file: str | os.PathLike | None = None,
    *,
    flags: tuple[str, str] = CLIENT_FLAGS,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """The control token from `token`, else file `token_file`, else $CODRAFT_CONTROL_TOKEN (in
    `environ`, default os.environ); None when none is set. ValueError, naming the source (the
    option names in `flags`), when both `token` and `token_file` are given, the file cannot be
    read or is empty, or the token is empty, holds whitespace or is not printable."""
    check_token_sources(token, token_file, flags)
    if token is not None:
        value, source = token, flags[0]
    elif token_file is not None:
        value, source = read_token_file(token_file, flags[1]), f"{flags[1]} {token_file}"
    else:
        value = (os.environ if environ is None else environ).get(TOKEN_ENV)
        if value is None:
            return None
        source = f"${TOKEN_ENV}"
    return check_token(value, source)


def read_token_file(path: str | os.PathLike, flag: str = CLIENT_FLAGS[1]) -> str:
    """The token in file `path`, whitespace stripped; ValueError if unreadable or empty."""
    try:
        value = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read the token file ({e})") from None
    if not value:
        raise ValueError(f"the token file {path} ({flag}) is empty; expected the control token")
    return value


def check_token(value: str, source: str = "the control token") -> str:
    """`value` stripped, if it can serve as a bearer token; ValueError naming `source` if not."""
    token = value.strip()
    if not token:
        raise ValueError(
            f"the control token ({source}) is empty; give a non-empty token or none at all"
        )
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError(
            f"the control token ({source}) must be printable and contain no whitespace"
        )
    return token
