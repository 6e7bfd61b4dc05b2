"""Acceptance of each draft version, overall and over sliding windows, and the rollback rule.

A *verification* is one request's draft proposals checked by the target in one engine step
(vLLM's "draft"). Each step adds, per draft version, the number of verifications, draft tokens
proposed and draft tokens accepted. The window of a version is its most recent steps that hold
at least `window` verifications; its rate is accepted tokens / draft tokens over that window.

Automatic rollback compares *whole requests*: the requests every draft of which one version
proposed, counted when they finish (`observe`, `close`), over the most recent of them that hold
at least `window` verifications (`request_rate`). When the current draft's rate falls below
`fraction` x the previous draft's (frozen at the swap), the current draft is rolled back; a
previous draft without such a window gives no reference, so it never triggers a rollback.
Whole requests, not the last steps: acceptance climbs along a generation (the first tokens of an
answer are the hardest to guess, its tail often repeats), so the first steps of a new batch
against the last steps of the previous one compare heads with tails. That is what rollout
traffic looks like (a draft is pushed between batches); on an H200 a draft pushed identical
to the one serving was rolled back, most likely so.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
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

    def __init__(self, window: int, max_open: int = 65536) -> None:
        self.window = window
        self.max_open = max_open  # running requests tracked (a request never closed ages out)
        self.totals: dict[int, Counts] = {}
        self._steps = _Windows(window)  # by step
        self._requests = _Windows(window)  # by whole request
        # requests running: [version (None once two versions proposed), drafts, tokens, accepted]
        self._open: dict[str, list] = {}

    def record(self, version: int, drafts: int, draft_tokens: int, accepted: int) -> None:
        if drafts <= 0:
            return
        self.totals.setdefault(version, Counts()).add(drafts, draft_tokens, accepted)
        self._steps.add(version, drafts, draft_tokens, accepted)

    def observe(self, req_id: str, version: int, draft_tokens: int, accepted: int) -> None:
        """One verification of a running request (its drafts proposed by `version`)."""
        t = self._open.get(req_id)
        if t is None:
            self._open[req_id] = [version, 1, draft_tokens, accepted]
            if len(self._open) > self.max_open:  # the oldest first (insertion order)
                del self._open[next(iter(self._open))]
            return
        if t[0] != version:
            t[0] = None
        t[1] += 1
        t[2] += draft_tokens
        t[3] += accepted

    def close(self, req_id: str) -> None:
        """The request finished: a whole request of one version joins that version's window."""
        t = self._open.pop(req_id, None)
        if t is not None and t[0] is not None:
            self._requests.add(t[0], t[1], t[2], t[3])

    def window_counts(self, version: int) -> Counts | None:
        """Counts over the version's last full window of steps; None before it has `window`
        verifications."""
        return self._steps.counts(version)

    def window_rate(self, version: int) -> float | None:
        c = self.window_counts(version)
        return None if c is None else c.rate

    def request_rate(self, version: int) -> float | None:
        """The rate over the version's most recent whole requests holding `window`
        verifications; None before it has them."""
        c = self._requests.counts(version)
        return None if c is None else c.rate

    def reset_window(self, version: int) -> None:
        """Forget a version's windows (they start over when it serves again)."""
        self._steps.reset(version)
        self._requests.reset(version)

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        return {str(v): c.to_dict() for v, c in sorted(self.totals.items())}


def should_roll_back(current_rate: float | None, reference: float | None, fraction: float) -> bool:
    """The rollback rule: both rates known and current < fraction x reference."""
    if current_rate is None or reference is None:
        return False
    return current_rate < fraction * reference


class _Windows:
    """Per version, the most recent entries (steps or requests) holding `window` verifications."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: dict[int, deque[tuple[int, int, int]]] = {}
        self._held: dict[int, int] = {}

    def add(self, version: int, drafts: int, draft_tokens: int, accepted: int) -> None:
        recent = self._recent.setdefault(version, deque())
        recent.append((drafts, draft_tokens, accepted))
        held = self._held.get(version, 0) + drafts
        # Drop the oldest entries while the rest still hold a full window.
        while len(recent) > 1 and held - recent[0][0] >= self.window:
            held -= recent.popleft()[0]
        self._held[version] = held

    def counts(self, version: int) -> Counts | None:
        recent = self._recent.get(version)
        if not recent:
            return None
        c = Counts()
        for s in recent:
            c.add(*s)
        return c if c.drafts >= self.window else None

    def reset(self, version: int) -> None:
        self._recent.pop(version, None)
        self._held.pop(version, None)


class AutoRollback:
    """Both engines' automatic-rollback check (a mixin): reads `cfg` (EngineConfig),
    `acceptance`, `current` and `previous` (draft slots) and `reference_rate`; sets
    `pending_rollback` to the reason, which the engine acts on between steps."""

    pending_rollback: str | None = None

    def _check_rollback(self) -> None:
        if not self.cfg.auto_rollback or self.previous is None or self.pending_rollback:
            return
        rate, reference = self.acceptance.request_rate(self.current.version), self.reference_rate
        if should_roll_back(rate, reference, self.cfg.rollback_fraction):
            self.pending_rollback = (
                f"auto: draft v{self.current.version} accepts {rate:.3f} of its tokens over "
                f"whole requests holding {self.cfg.rollback_window}+ verifications, below "
                f"{self.cfg.rollback_fraction} x v{self.previous.version}'s {reference:.3f}"
            )


class FinishedVersions:
    """The draft version serving when each request finished, for the last `limit` request
    ids (a response's X-Codraft-Draft-Version)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._versions: OrderedDict[str, int] = OrderedDict()

    def note(self, keys: Iterable[str], version: int) -> None:
        for key in keys:
            self._versions[key] = max(version, self._versions.get(key, -1))
            self._versions.move_to_end(key)
        while len(self._versions) > self.limit:
            self._versions.popitem(last=False)

    def get(self, key: str) -> int | None:
        return self._versions.get(key)
