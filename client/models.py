"""The control API's wire schemas, as the client sees them (docs/architecture.md, Contracts).

Responses are parsed leniently: unknown fields are kept (`model_extra`), missing ones are None,
so a server that adds a field does not break an older client. Requests are strict: what the
client sends is checked before it leaves, with the same limits the server applies.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# Versions are JSON-safe integers: JSON Schema and JavaScript clients hold them exactly.
MAX_VERSION = 2**53 - 1
TapMode = Literal["full", "ids", "off"]


# ------------------------------------------------------------------------------ responses
class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class Acceptance(_Reply):
    """Acceptance of one draft version since it was loaded."""

    drafts: int = 0  # verifications (one request's proposals checked in one engine step)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float | None = None  # mean tokens emitted per verification

    @property
    def rate(self) -> float | None:
        """Accepted draft tokens per proposed draft token."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


class RollbackEvent(_Reply):
    """One rollback of the serving draft, asked for or automatic (then `reason` says why)."""

    from_version: int | None = None
    to_version: int | None = None
    reason: str | None = None
    auto: bool | None = None
    at: str | None = None


class DraftInfo(_Reply):
    """GET /v1/draft, and the answer to a draft load or rollback (those carry no acceptance)."""

    version: int | None = None
    sha256: str | None = None
    path: str | None = None
    loaded_at: str | None = None
    kind: str | None = None  # "eagle3" or "dflash"
    tap_layers: list[int] = Field(default_factory=list)
    previous_version: int | None = None
    previous_path: str | None = None  # the draft a rollback installs
    highest_version: int | None = None  # a new draft's version must exceed it (409 otherwise)
    rollbacks: list[RollbackEvent] = Field(default_factory=list)  # the latest, oldest first
    # True: the engine keeps the vocabulary map (d2t) it started with (SGLang), and a new draft
    # must carry the serving draft's; False: a draft may bring its own (vLLM).
    vocab_map_fixed: bool = False
    acceptance: Acceptance | None = None


class DraftStaged(_Reply):
    """POST|GET /v1/draft/prepare: the draft staged ahead of its swap. `state` is "preparing",
    "ready" or "failed" (then `status` and `error` say why, as POST /v1/draft will)."""

    ticket: str | None = None
    path: str | None = None
    version: int | None = None
    state: str | None = None
    status: int | None = None
    error: str | None = None
    sha256: str | None = None
    files_changed: bool | None = None


class PolicyInfo(_Reply):
    """The answer to a policy load."""

    version: int | None = None
    path: str | None = None
    loaded_at: str | None = None


class TapStats(_Reply):
    messages_sent: int = 0
    messages_dropped: int = 0
    bytes_sent: int = 0
    bytes_dropped: int = 0
    queue_depth: int = 0


class TapInfo(_Reply):
    """GET|PUT /v1/tap (only GET carries `stats`)."""

    enabled: bool | None = None
    mode: str | None = None
    sample_rate: float | None = None
    endpoint: str | None = None
    stats: TapStats | None = None


class Stats(_Reply):
    """GET /v1/stats: the engine's counters at the moment of the request (GET /metrics serves
    the same ones from a cache refreshed every few seconds)."""

    acceptance: dict[int, Acceptance] = Field(default_factory=dict)  # by draft version
    draft_version: int | None = None
    policy_version: int | None = None
    swaps: int | None = None
    rollbacks: int | None = None
    auto_rollbacks: int | None = None
    tap: TapStats | None = None

    def acceptance_lengths(self) -> dict[int, float]:
        """Mean tokens emitted per verification, by draft version (those verified at all)."""
        return {
            v: a.acceptance_length
            for v, a in sorted(self.acceptance.items())
            if a.drafts and a.acceptance_length is not None
        }


class Health(_Reply):
    """GET /health: `status` "ok" while the engine is alive, "dead" (HTTP 503) otherwise."""

    status: str = "unknown"
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Ready(_Reply):
    """GET /ready: ready (HTTP 200) when the engine answers, a draft is loaded and the target's
    weights are defined; else 503 with the reason in `detail` (`policy_broken` True when a
    policy load failed and could not be undone: load a good policy, or restart the server)."""

    ready: bool = False
    draft_version: int | None = None
    policy_version: int | None = None
    detail: str | None = None
    policy_broken: bool = False


# ------------------------------------------------------------------------------ requests
class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_Version = Annotated[StrictInt, Field(ge=0, le=MAX_VERSION)]
_Path = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]


class DraftLoad(_Request):
    """POST /v1/draft. `path` is read by the server, so it must be valid on the server's side."""

    version: _Version
    path: _Path
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None


class DraftPrepare(_Request):
    """POST /v1/draft/prepare; version None: the checkpoint's own (its codraft.json)."""

    path: _Path
    version: _Version | None = None
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None


class PolicyLoad(_Request):
    """POST /v1/policy."""

    version: _Version
    path: _Path


class TapUpdate(_Request):
    """PUT /v1/tap; None leaves a setting as it is."""

    enabled: StrictBool | None = None
    mode: TapMode | None = None
    sample_rate: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc|inproc)://[^\s\x00]+$")] | None = None
