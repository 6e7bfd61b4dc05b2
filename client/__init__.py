"""Python client of the codraft control API (docs/architecture.md, Contracts), and CLI subcommands.

    from codraft.client import CodraftClient
    with CodraftClient("http://127.0.0.1:8000") as c:   # token: argument or $CODRAFT_CONTROL_TOKEN
        c.wait_ready()
        c.publish_draft(5, "/ckpt/draft-v5")  # or load_draft: the same swap in one call

Generation goes through the official `openai` package: see `codraft.client.openai_helpers` (imported
on its own, so this package does not need openai).
"""

from codraft.client.client import AsyncCodraftClient, CodraftClient
from codraft.client.errors import (
    CodraftConnectionError,
    CodraftError,
    CodraftHTTPError,
    ContractError,
    InvalidRequest,
    NotFound,
    NotNewer,
    NotReady,
    Unauthorized,
    UnexpectedResponse,
)
from codraft.client.models import (
    Acceptance,
    DraftInfo,
    DraftStaged,
    Health,
    PolicyInfo,
    Ready,
    Stats,
    TapInfo,
    TapStats,
)
from codraft.client.retry import NO_RETRY, RetryPolicy

__all__ = [
    "Acceptance",
    "AsyncCodraftClient",
    "CodraftClient",
    "CodraftConnectionError",
    "CodraftError",
    "CodraftHTTPError",
    "ContractError",
    "DraftInfo",
    "DraftStaged",
    "Health",
    "InvalidRequest",
    "NO_RETRY",
    "NotFound",
    "NotNewer",
    "NotReady",
    "PolicyInfo",
    "Ready",
    "RetryPolicy",
    "Stats",
    "TapInfo",
    "TapStats",
    "Unauthorized",
    "UnexpectedResponse",
]
