"""The control routes as data: what to send and how to read the answer, for both clients.

Each route is a function returning a `Call` (method, path, JSON body, the statuses that are
answers, a parser). `CodraftClient` and `AsyncCodraftClient` only differ in how they send it;
everything else (validation, retries, error mapping, parsing) is here and in `retry.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from codraft.client.errors import InvalidRequest, UnexpectedResponse, http_error
from codraft.client.models import (
    DraftInfo,
    DraftLoad,
    DraftPrepare,
    DraftStaged,
    Health,
    PolicyInfo,
    PolicyLoad,
    Ready,
    Stats,
    TapInfo,
    TapUpdate,
)
from codraft.client.prom import parse_metrics
from codraft.client.retry import RetryPolicy

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    json: dict[str, Any] | None = None
    answers: frozenset[int] = frozenset({200})  # statuses `parse` reads (others raise)
    slow: bool = False  # a load: the server may take minutes (checks, swap lock)


# ------------------------------------------------------------------------------ routes
def get_draft() -> Call[DraftInfo]:
    return Call("GET", "/v1/draft", _model(DraftInfo))


def load_draft(version: int, path: str, sha256: str | None = None) -> Call[DraftInfo]:
    body = _body(DraftLoad, version=version, path=path, sha256=sha256)
    return Call("POST", "/v1/draft", _model(DraftInfo), json=body, slow=True)


def prepare_draft(
    path: str, version: int | None = None, sha256: str | None = None
) -> Call[DraftStaged]:
    body = _body(DraftPrepare, path=path, version=version, sha256=sha256)
    return Call(
        "POST", "/v1/draft/prepare", _model(DraftStaged), json=body, answers=frozenset({202})
    )


def staged_draft() -> Call[DraftStaged]:
    return Call("GET", "/v1/draft/prepare", _model(DraftStaged))


def rollback_draft(reason: str = "manual") -> Call[DraftInfo]:
    if not isinstance(reason, str) or len(reason) > 200:
        raise InvalidRequest(f"reason must be a string of at most 200 characters, got {reason!r}")
    return Call("POST", "/v1/draft/rollback", _model(DraftInfo), json={"reason": reason}, slow=True)


def load_policy(version: int, path: str) -> Call[PolicyInfo]:
    body = _body(PolicyLoad, version=version, path=path)
    return Call("POST", "/v1/policy", _model(PolicyInfo), json=body, slow=True)


def get_tap() -> Call[TapInfo]:
    return Call("GET", "/v1/tap", _model(TapInfo))


def set_tap(
    enabled: bool | None = None,
    mode: str | None = None,
    sample_rate: float | None = None,
    endpoint: str | None = None,
) -> Call[TapInfo]:
    body = _body(TapUpdate, enabled=enabled, mode=mode, sample_rate=sample_rate, endpoint=endpoint)
    return Call("PUT", "/v1/tap", _model(TapInfo), json=body)


def stats() -> Call[Stats]:
    return Call("GET", "/v1/stats", _model(Stats))


def health() -> Call[Health]:
    """200 alive / 503 dead are both answers."""
    return Call("GET", "/health", _model(Health), answers=frozenset({200, 503}))


def ready() -> Call[Ready]:
    """200 ready / 503 not (yet) are both answers."""
    return Call("GET", "/ready", _model(Ready), answers=frozenset({200, 503}))


def metrics() -> Call[dict[str, float]]:
    return Call("GET", "/metrics", lambda r: parse_metrics(r.text))


# ------------------------------------------------------------------------------ answers
def next_wait(
    call: Call[Any], policy: RetryPolicy, attempt: int, response: httpx.Response | None
) -> float | None:
    """Seconds before trying `call` again, or None when this attempt's outcome is final.
    `response` None means the attempt got no HTTP answer."""
    failed = response is None or (
        response.status_code in policy.statuses and response.status_code not in call.answers
    )
    return policy.next_wait(call.method, attempt, failed=failed)


def finish(call: Call[T], url: str, response: httpx.Response) -> T:
    """The parsed answer, or the CodraftHTTPError subclass for the status."""
    if response.status_code not in call.answers:
        raise http_error(call.method, url, response.status_code, detail(response))
    try:
        return call.parse(response)
    except (ValueError, ValidationError) as e:  # JSONDecodeError is a ValueError
        raise UnexpectedResponse(
            f"{call.method} {url} -> {response.status_code}, but the body is not what the codraft "
            f"control API sends ({type(e).__name__}: {str(e)[:300]}); body starts "
            f"{response.text[:120]!r}. Is the URL the codraft server (its control port)?"
        ) from e


def detail(response: httpx.Response) -> str:
    """The server's message: {"detail": ...} of the control API (or FastAPI), else the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:1000] or response.reason_phrase
    if isinstance(data, dict) and "detail" in data:
        d = data["detail"]
        if isinstance(d, list):  # FastAPI's own validation errors
            return "; ".join(str(e.get("msg", e)) if isinstance(e, dict) else str(e) for e in d)
        return str(d)
    if isinstance(data, dict) and isinstance(data.get("error"), dict):  # OpenAI-style errors
        return str(data["error"].get("message", data["error"]))
    return str(data)[:1000]


# ------------------------------------------------------------------------------ helpers
def _model(cls: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        data = response.json()
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        return cls.model_validate(data)

    return parse


def _body(cls: type[BaseModel], **fields: Any) -> dict[str, Any]:
    try:
        model = cls(**fields)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r:.80})"
            for err in e.errors()
        )
        raise InvalidRequest(f"not sent, invalid {cls.__name__}: {problems}") from None
    return model.model_dump(exclude_none=True)
