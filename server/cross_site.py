"""Refuse cross-site requests to the control routes: CSRF and DNS rebinding.

A web page open in a browser on the serving machine can send requests to 127.0.0.1 without
asking anyone: "simple" requests (a form POST, `fetch` with mode no-cors and a text/plain or
form body, no custom header) go out without a CORS preflight. And a page on a name the attacker
rebinds to 127.0.0.1 (DNS rebinding) can read the answers too, sending `Host: evil.example`.
Without a control token that would let any page roll back, load or stage drafts. So
`CrossSiteGuard`, ASGI middleware of the control app, checks every request to `paths`:

- Host: its name must be one of `allowed_hosts` (default: the bound address, `localhost`,
  `127.0.0.1`, `::1`; add names with --control-allowed-hosts; `*` allows any). With a control
  token configured any Host is accepted: a rebound page has no token to send, and Services and
  load balancers reach the server by names of their own. 403 otherwise.
- Origin: when present (browsers send it on every POST and every cross-origin request), it
  must name the same host and port as the Host header; `null` and malformed origins are
  refused. 403 otherwise. Non-browser clients send no Origin.
- Content-Type: state-changing requests (POST, PUT, PATCH, DELETE) with a body must say
  `application/json`, which no simple request can; one without a body must say it too, or
  carry an Authorization header (no simple request carries one either: the weight-sync
  client's bodyless POSTs). 415 otherwise; with a token configured, a request without an
  Authorization header goes on to its 401.

Refusals are `{"detail": ...}` as every control error; nothing past this layer runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from codraft.loopback import is_loopback_host
from codraft.server.refusal import control_refusal

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def host_name(value: str) -> str:
    """The name in a Host header or netloc, without port or IPv6 brackets, lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") > 1:  # a bare IPv6 address
        return value
    return value.partition(":")[0].rstrip(".")


def default_allowed_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The bound address, the loopback names and `extra` (names or addresses)."""
    names = {host_name(bound), *LOOPBACK_NAMES, *(host_name(h) for h in extra if h.strip())}
    if "*" in {h.strip() for h in extra}:
        names.add("*")
    return frozenset(n for n in names if n)


def _origin_netloc(origin: str) -> str | None:
    """'host:port' of an Origin header (default ports filled in), or None when unusable."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return None
    port = port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname.lower()}:{port}"


def _host_netloc(host: str, scheme: str) -> str:
    name = host_name(host)
    rest = host.strip().lower()
    rest = rest.rpartition("]")[2] if rest.startswith("[") else rest
    port = rest.rpartition(":")[2] if ":" in rest and rest.count(":") == 1 else ""
    return f"{name}:{port or (443 if scheme in ('https', 'wss') else 80)}"


class CrossSiteGuard:
    """403 for a foreign Host or Origin, 415 for a state-changing request that is not JSON, on
    requests to `paths`."""

    def __init__(
        self,
        app: ASGIApp,
        paths: Iterable[str],
        allowed_hosts: Iterable[str],
        token_set: bool,
    ) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.allowed = frozenset(host_name(h) if h != "*" else h for h in allowed_hosts)
        self.token_set = token_set
        self.any_host = token_set or "*" in self.allowed

    def problem(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request is refused, None when it may pass."""
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers") or []:
            headers.setdefault(k.lower(), v)
        host = headers.get(b"host", b"").decode("latin-1")
        name = host_name(host)
        if not self.any_host and not (name in self.allowed or is_loopback_host(name)):
            allowed = ", ".join(sorted(self.allowed))
            return 403, (
                f"Host {host[:100]!r} is not a name this server answers control requests for "
                f"(expected one of {allowed}): requests through another name (a browser page "
                "rebinding it) are refused; add the name with --control-allowed-hosts, or "
                "configure a control token"
            )
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            netloc = _origin_netloc(text)
            if netloc is None or netloc != _host_netloc(host, scope.get("scheme", "http")):
                return 403, (
                    f"cross-site request refused: Origin {text[:100]!r} is not this server "
                    f"({host[:100]!r}); control requests come from the codraft client or "
                    "another non-browser client (which sends no Origin), or from a page of "
                    "this server's own origin"
                )
        unauthenticated = self.token_set and b"authorization" not in headers  # 401 follows
        if scope.get("method") in STATE_CHANGING and not unauthenticated:
            kind = headers.get(b"content-type", b"").decode("latin-1")
            media = kind.partition(";")[0].strip().lower()
            has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or (
                b"transfer-encoding" in headers
            )
            if media != "application/json" and (has_body or b"authorization" not in headers):
                return 415, (
                    f"{scope.get('method')} {scope.get('path')} takes a JSON body: expected "
                    f"Content-Type application/json, got {kind[:100]!r} (form and text bodies "
                    "are what cross-site pages can send, so they are refused)"
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")) or "/"
        if scope["type"] != "http" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        refused = self.problem(scope)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message = refused
        await control_refusal(message, status)(scope, receive, send)
