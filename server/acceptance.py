"""Acceptance of each draft version, overall and over a sliding window, and the rollback rule.

A *verification* is one request's draft proposals checked by the target in one engine step
(vLLM's "draft"). Each step adds, per draft version, the number of verifications, draft tokens
proposed and draft tokens accepted. The window of a version is its most recent steps that hold
at least `window` verifications; its rate is accepted tokens / draft tokens over that window.

Automatic rollback: when the current draft has a full window and its rate falls below
`fraction` x the previous draft's rate over that draft's last full window (frozen at the swap),
the current draft is rolled back. A previous draft without a full window gives no reference, so
it never triggers a rollback.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Counts:
    drafts: int = 0  # verifications
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted

    @property
    def rate(self) -> float:
        """Accepted tokens per draft token."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verification (1 + accepted drafts per verification)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": self.acceptance_length,
        }


class Acceptance:
    """Per-version totals and sliding windows (see module doc)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.totals: dict[int, Counts] = {}
        self._recent: dict[int, deque[tuple[int, int, int]]] = {}
        self._recent_drafts: dict[int, int] = {}

    def record(self, version: int, drafts: int, draft_tokens: int, accepted: int) -> None:
        if drafts <= 0:
            return
        self.totals.setdefault(version, Counts()).add(drafts, draft_tokens, accepted)
        recent = self._recent.setdefault(version, deque())
        recent.append((drafts, draft_tokens, accepted))
        held = self._recent_drafts.get(version, 0) + drafts
        # Drop the oldest steps while the rest still hold a full window.
        while len(recent) > 1 and held - recent[0][0] >= self.window:
            held -= recent.popleft()[0]
        self._recent_drafts[version] = held

    def window_counts(self, version: int) -> Counts | None:
        """Counts over the version's last full window; None before it has `window` drafts."""
        recent = self._recent.get(version)
        if not recent:
            return None
        c = Counts()
        for s in recent:
            c.add(*s)
        return c if c.drafts >= self.window else None

    def window_rate(self, version: int) -> float | None:
        c = self.window_counts(version)
        return None if c is None else c.rate

    def reset_window(self, version: int) -> None:
        """Forget a version's window (it starts over when it serves again)."""
        self._recent.pop(version, None)
        self._recent_drafts.pop(version, None)

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        return {str(v): c.to_dict() for v, c in sorted(self.totals.items())}


def should_roll_back(current_rate: float | None, reference: float | None, fraction: float) -> bool:
    """The rollback rule: both rates known and current < fraction x reference."""
    if current_rate is None or reference is None:
        return False
    return current_rate < fraction * reference
