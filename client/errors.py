"""What the client raises. Every error says what was asked, what came back and what to do.

CodraftError
|-- InvalidRequest        the client refused to send it (bad version, path, sample rate...)
|-- CodraftConnectionError no HTTP answer: refused, reset, timed out (after any retries)
|-- NotReady              wait_ready ran out of time (also a TimeoutError)
`-- CodraftHTTPError      the server answered 4xx/5xx; .status, .message (its "detail")
    |-- Unauthorized      401: missing or wrong control token
    |-- NotFound          404: e.g. the checkpoint path does not exist on the server
    |-- NotNewer          409: version not newer than the serving one; nothing to roll back
    `-- ContractError     422: checkpoint fails the contract or checksum; bad request body
"""

from __future__ import annotations


class CodraftError(Exception):
    """Base of every error the codraft client raises."""


class InvalidRequest(CodraftError, ValueError):
    """The request was not sent: an argument is outside what the server accepts."""


class CodraftConnectionError(CodraftError, ConnectionError):
    """No HTTP answer from the server (after the retries the call allows)."""

    def __init__(self, method: str, url: str, cause: BaseException, attempts: int) -> None:
        self.method, self.url, self.cause, self.attempts = method, url, cause, attempts
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        super().__init__(
            f"{method} {url}: no answer{tries} ({type(cause).__name__}: {cause}); is "
            "`codraft serve` running there, and is the URL (host, port, control port) right?"
        )


class UnexpectedResponse(CodraftError):
    """The server answered, but not with what the control API sends: wrong URL or port?"""


class NotReady(CodraftError, TimeoutError):
    """The server did not become ready in time; `.last` is the last answer or error seen."""

    def __init__(self, url: str, timeout: float, last: str) -> None:
        self.url, self.timeout, self.last = url, timeout, last
        super().__init__(
            f"{url}/ready: not ready after {timeout:.1f} s (last: {last}); check the server log"
        )


_HINTS = {
    401: "give the server's control token: token=..., --token, --token-file or "
    "$CODRAFT_CONTROL_TOKEN",
    403: "the path must lie under the server's checkpoint root",
    404: "paths are resolved on the server's machine: check that it exists there",
    409: "a load needs a version above the serving one, a rollback a previous draft; see "
    "GET /v1/draft or `codraft status`",
    413: "the request body is too large for the control API",
}
NO_ROUTE = (
    "this server has no such route: is it `codraft serve`, and when it runs with "
    "--control-port, is the URL that port?"
)


def _hint(status: int, message: str) -> str:
    if status == 404 and message == "Not Found":  # the framework's answer: no such route
        return NO_ROUTE
    if status >= 500:
        return "the server failed; its log says more"
    return _HINTS.get(status, "")


class CodraftHTTPError(CodraftError):
    """The server answered `status` (4xx or 5xx) with `message` (its "detail")."""

    def __init__(self, method: str, url: str, status: int, message: str) -> None:
        self.method, self.url, self.status, self.message = method, url, status, message
        hint = _hint(status, message)
        super().__init__(f"{method} {url} -> {status}: {message}" + (f"; {hint}" if hint else ""))


class Unauthorized(CodraftHTTPError):
    """401: the control token is missing or wrong."""


class NotFound(CodraftHTTPError):
    """404: the route, or the checkpoint/policy path on the server, does not exist."""


class NotNewer(CodraftHTTPError):
    """409: the version is not newer than the serving one (or there is nothing to roll back)."""


class ContractError(CodraftHTTPError):
    """422: the checkpoint fails the contract (shapes, vocab, tap layers, checksum), or the
    request body was refused."""


ERRORS_BY_STATUS: dict[int, type[CodraftHTTPError]] = {
    401: Unauthorized,
    404: NotFound,
    409: NotNewer,
    422: ContractError,
}


def http_error(method: str, url: str, status: int, message: str) -> CodraftHTTPError:
    """The CodraftHTTPError subclass for `status`."""
    return ERRORS_BY_STATUS.get(status, CodraftHTTPError)(method, url, status, message)
