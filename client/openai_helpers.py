"""Generation through the official `openai` package, and the draft version of each answer.

The server's /v1/completions and /v1/chat/completions are vLLM's; codraft adds the headers
`X-Codraft-Draft-Version` and `X-Codraft-Policy-Version` to every response ("unknown" when the
server cannot tell). openai's parsed objects drop headers, so ask for the raw response:

    oai = openai_client("http://127.0.0.1:8000")
    raw = oai.chat.completions.with_raw_response.create(model=..., messages=[...])
    completion, version = raw.parse(), draft_version(raw)

or in one call: `completion, version = chat_with_version(oai, model=..., messages=[...])`.
A streamed response's headers name the draft serving when the request arrived.
"""

from __future__ import annotations

from typing import Any, Protocol

import openai
from openai.types import Completion
from openai.types.chat import ChatCompletion

from codraft.client.settings import resolve_base_url

DRAFT_VERSION_HEADER = "x-codraft-draft-version"
POLICY_VERSION_HEADER = "x-codraft-policy-version"


class HasHeaders(Protocol):
    @property
    def headers(self) -> Any: ...  # a case-insensitive mapping (httpx.Headers)


def openai_client(
    base_url: str | None = None, api_key: str = "EMPTY", **kwargs: Any
) -> openai.OpenAI:
    """`openai.OpenAI` pointed at the server's /v1 (`base_url` as for CodraftClient; vLLM
    ignores the key unless it was started with --api-key). kwargs go to openai.OpenAI."""
    return openai.OpenAI(base_url=resolve_base_url(base_url) + "/v1", api_key=api_key, **kwargs)


def async_openai_client(
    base_url: str | None = None, api_key: str = "EMPTY", **kwargs: Any
) -> openai.AsyncOpenAI:
    """`openai.AsyncOpenAI` pointed at the server's /v1."""
    return openai.AsyncOpenAI(
        base_url=resolve_base_url(base_url) + "/v1", api_key=api_key, **kwargs
    )


def _version(response: HasHeaders, header: str) -> int | None:
    value = response.headers.get(header)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:  # "unknown"
        return None


def draft_version(response: HasHeaders) -> int | None:
    """The draft version named by a raw response (openai's `with_raw_response` result, or an
    httpx.Response); None when the header is missing or "unknown"."""
    return _version(response, DRAFT_VERSION_HEADER)


def policy_version(response: HasHeaders) -> int | None:
    """The policy (target weights) version named by a raw response, or None."""
    return _version(response, POLICY_VERSION_HEADER)


def _not_streamed(create: dict[str, Any]) -> None:
    if create.get("stream"):
        raise ValueError(
            "stream=True: call `.with_raw_response.create(..., stream=True)` yourself; "
            "draft_version(raw) reads the header and raw.parse() gives the stream"
        )


def chat_with_version(client: openai.OpenAI, **create: Any) -> tuple[ChatCompletion, int | None]:
    """`client.chat.completions.create(**create)` (not streamed) and the draft version."""
    _not_streamed(create)
    raw = client.chat.completions.with_raw_response.create(**create)
    return raw.parse(), draft_version(raw)


def complete_with_version(client: openai.OpenAI, **create: Any) -> tuple[Completion, int | None]:
    """`client.completions.create(**create)` (not streamed) and the draft version."""
    _not_streamed(create)
    raw = client.completions.with_raw_response.create(**create)
    return raw.parse(), draft_version(raw)
