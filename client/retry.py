"""When the client tries a request again: exponential backoff, idempotent methods only.

A call is retried when it got no HTTP answer (connection refused or reset, timeout) or a 5xx in
`statuses`, and only if its method is in `methods` (GET by default): a POST that timed out may
have loaded a draft already, so sending it again is the caller's decision, never the client's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries in all for a retryable call; 1 means never retry
    backoff_s: float = 0.25  # wait before the 2nd try; each later wait is `multiplier` x longer
    multiplier: float = 2.0
    max_backoff_s: float = 5.0
    jitter: float = 0.1  # each wait is scaled by a random factor in [1 - jitter, 1 + jitter]
    statuses: frozenset[int] = frozenset({500, 502, 503, 504})
    methods: frozenset[str] = field(default_factory=lambda: frozenset({"GET"}))

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(
                f"RetryPolicy.attempts must be >= 1 (1 = no retries), got {self.attempts}"
            )
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError(
                "RetryPolicy needs backoff_s >= 0, max_backoff_s >= 0 and multiplier >= 1; got "
                f"{self.backoff_s}, {self.max_backoff_s}, {self.multiplier}"
            )
        if not 0 <= self.jitter < 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff_s, self.backoff_s * self.multiplier ** (attempt - 1))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)

    def next_wait(self, method: str, attempt: int, *, failed: bool) -> float | None:
        """Seconds until the next try of `method` after attempt `attempt`, or None: stop here
        (it did not fail, the method is not retried, or the attempts are used up)."""
        if not failed or method.upper() not in self.methods or attempt >= self.attempts:
            return None
        return self.wait(attempt)


NO_RETRY = RetryPolicy(attempts=1)
