"""Acceptance of each draft version, and the automatic-rollback rule.

A *verification* is one request's draft proposals checked by the target in one engine step
(vLLM's "draft"). Each is attributed to the draft version that proposed it and counted when its
step's tokens are handed over (`record` for the per-version totals, `observe` for the rule).

**The rollback rule compares like with like.** Acceptance climbs along a generation (an answer's
first tokens are the hardest to guess, its tail often repeats), so two drafts must be compared
at the same places in their requests, not over whatever traffic each happened to see. Every
verification is filed in a *stratum*: the number of tokens its request had generated before it,
in powers of two (0, 1, 2-3, 4-7, ...). When a draft is swapped in, the previous draft's strata,
counted since it began serving, are frozen as the reference (`begin`). The new draft's
verifications are then weighed against what the reference accepted in the same strata:

    expected = sum over strata s of  new.draft_tokens[s] x reference.rate[s]
    ratio    = new.accepted / expected

over the strata where the reference holds at least window / 16 verifications. Once the new
draft has `window` such verifications from at least `min_requests` requests and its ratio is
below `fraction` by `SPREADS` standard errors, it is rolled back (`verdict`, `AutoRollback`).
Requests are the sampled units (a request's tokens are alike), so the error comes from the
ratio's spread over requests; a draft that accepts nothing has ratio 0 and no spread, and goes
at its first full window.

Every verification counts when it happens, whether its request has finished or not and whichever
draft proposed the request's earlier tokens. A rule that waited for whole requests saw, right
after a swap, the short requests that finish first, and held them against the longer ones the
previous draft had finished: the demo's co-trained drafts were rolled back on that bias while
the per-version totals showed them equal or better.

A new target policy moves every draft's acceptance: `restart` starts the serving draft's strata
afresh and drops the reference, so a draft is never judged against acceptance measured under
another policy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

SPREADS = 2.0  # standard errors the ratio must sit below the fraction by
STRATA = 16  # positions 0, 1, 2-3, ..., 2**14 and beyond share the last


def stratum(position: int) -> int:
    """The stratum of a verification made after `position` generated tokens."""
    return min(position.bit_length(), STRATA - 1)


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


@dataclass
class Strata:
    """One draft's verifications by stratum since it began serving (under one policy), and
    its comparison with the reference frozen then: per request, what it accepted (O) and what
    the reference would have accepted on the same draft tokens (E), in running sums from which
    the ratio's spread over requests follows."""

    version: int
    rates: list[float | None] | None = None  # the reference's rate per stratum (None: too few)
    reference_version: int | None = None
    cells: list[Counts] = field(default_factory=lambda: [Counts() for _ in range(STRATA)])
    compared: int = 0  # verifications in strata the reference covers
    compared_requests: int = 0
    observed: int = 0  # sum of O
    expected: float = 0.0  # sum of E
    _oo: float = 0.0  # sums over requests of O^2, O*E, E^2
    _oe: float = 0.0
    _ee: float = 0.0
    _open: dict[str, list[float]] = field(default_factory=dict)  # running requests' [O, E]

    def compare(self, req_id: str, accepted: int, expected: float) -> None:
        t = self._open.get(req_id)
        if t is None:
            t = self._open[req_id] = [0.0, 0.0]
            self.compared_requests += 1
        o, e = t
        self._oo -= o * o
        self._oe -= o * e
        self._ee -= e * e
        o, e = o + accepted, e + expected
        self._oo += o * o
        self._oe += o * e
        self._ee += e * e
        t[0], t[1] = o, e
        self.compared += 1
        self.observed += accepted
        self.expected += expected

    def done(self, req_id: str) -> None:
        """The request will not be verified again: its sums stay, its entry goes."""
        self._open.pop(req_id, None)


@dataclass(frozen=True)
class Verdict:
    """The new draft against the reference over the strata the reference covers."""

    version: int
    reference_version: int
    verifications: int  # the new draft's, in the compared strata
    requests: int  # requests those verifications came from
    accepted: int
    expected: float  # what the reference would have accepted on the same draft tokens
    spread: float  # the ratio's standard error, from its spread over requests

    @property
    def ratio(self) -> float:
        return self.accepted / self.expected if self.expected > 0 else 1.0

    def collapsed(self, fraction: float) -> bool:
        """Below `fraction` even at the top of the ratio's error bar."""
        return self.expected > 0 and self.ratio + SPREADS * self.spread < fraction

    def reason(self, fraction: float) -> str:
        return (
            f"auto: draft v{self.version} accepted {self.accepted} draft tokens over "
            f"{self.verifications} verifications in {self.requests} requests where "
            f"v{self.reference_version}, at the same positions of its requests, accepted "
            f"{self.expected:.1f} (ratio {self.ratio:.3f} +- {self.spread:.3f}, below {fraction})"
        )


class Acceptance:
    """Per-version totals and the strata of the rollback rule (see module doc)."""

    def __init__(self, window: int, min_requests: int = 1, max_open: int = 65536) -> None:
        self.window = window
        self.min_requests = min_requests
        # reference verifications a stratum needs to enter the comparison
        self.stratum_min = max(1, window // 16)
        self.max_open = max_open  # running requests tracked (a request never closed ages out)
        self.totals: dict[int, Counts] = {}
        self._strata: dict[int, Strata] = {}
        # running requests: [tokens generated so far, the Strata last counted it]
        self._open: dict[str, list] = {}

    def record(self, version: int, drafts: int, draft_tokens: int, accepted: int) -> None:
        """One step's verifications proposed by `version` (the per-version totals)."""
        if drafts <= 0:
            return
        self.totals.setdefault(version, Counts()).add(drafts, draft_tokens, accepted)

    def observe(self, req_id: str, version: int, draft_tokens: int, accepted: int) -> None:
        """One verification of a running request, its drafts proposed by `version`."""
        t = self._open.get(req_id)
        if t is None:
            t = self._open[req_id] = [0, None]
            if len(self._open) > self.max_open:  # the oldest first (insertion order)
                self.close(next(iter(self._open)))
        strata = self._strata.get(version)
        if strata is None:
            strata = self._strata[version] = Strata(version)
        if t[1] is not strata:
            if t[1] is not None:
                t[1].done(req_id)
            t[1] = strata
        s = stratum(t[0])
        strata.cells[s].add(1, draft_tokens, accepted)
        if strata.rates is not None and (rate := strata.rates[s]) is not None:
            strata.compare(req_id, accepted, draft_tokens * rate)
        t[0] += 1 + accepted

    def close(self, req_id: str) -> None:
        """The request finished."""
        t = self._open.pop(req_id, None)
        if t is not None and t[1] is not None:
            t[1].done(req_id)

    def begin(self, version: int, previous: int | None) -> None:
        """`version` starts serving: its strata start over, judged against `previous`'s as
        counted so far (None: no reference)."""
        ref = self._strata.get(previous) if previous is not None else None
        self._strata = {previous: ref} if ref is not None else {}
        if ref is None:
            self._strata[version] = Strata(version)
            return
        rates = [c.rate if c.drafts >= self.stratum_min else None for c in ref.cells]
        self._strata[version] = Strata(version, rates, ref.version)

    def restart(self, version: int) -> None:
        """A rollback to `version`, or a new policy under it: its strata start over and there
        is no reference (nothing to roll back to, or nothing measured under this policy)."""
        self._strata = {version: Strata(version)}

    def verdict(self, version: int) -> Verdict | None:
        """`version` against its reference, once it has `window` compared verifications from
        `min_requests` requests; None before (or without a reference)."""
        new = self._strata.get(version)
        if (
            new is None
            or new.reference_version is None
            or new.compared < self.window
            or new.compared_requests < self.min_requests
            or new.expected <= 0
        ):
            return None
        ratio = new.observed / new.expected
        # the ratio's variance with requests as the sampled units (their tokens move together)
        var = (new._oo - 2 * ratio * new._oe + ratio * ratio * new._ee) / new.expected**2
        return Verdict(
            version, new.reference_version, new.compared, new.compared_requests, new.observed,
            new.expected, math.sqrt(max(var, 0.0)),
        )  # fmt: skip

    def snapshot(self) -> dict[str, dict[str, float | int]]:
        return {str(v): c.to_dict() for v, c in sorted(self.totals.items())}


def should_roll_back(verdict: Verdict | None, fraction: float) -> bool:
    """The rollback rule: a verdict whose ratio is below `fraction` at the top of its error
    bar."""
    return verdict is not None and verdict.collapsed(fraction)


ROLLBACKS_KEPT = 32  # the rollback history an engine reports (GET /v1/draft)


class AutoRollback:
    """Both engines' automatic-rollback check and rollback history (a mixin): reads `cfg`
    (EngineConfig), `acceptance`, `current` and `previous` (draft slots); sets
    `pending_rollback` to the reason, which the engine acts on between steps."""

    pending_rollback: str | None = None
    rollback_history: list[dict]

    def _check_rollback(self) -> None:
        if not self.cfg.auto_rollback or self.previous is None or self.pending_rollback:
            return
        verdict = self.acceptance.verdict(self.current.version)
        if should_roll_back(verdict, self.cfg.rollback_fraction):
            assert verdict is not None
            self.pending_rollback = verdict.reason(self.cfg.rollback_fraction)

    def _note_rollback(self, rolled: int, to: int, reason: str, auto: bool, at: str) -> None:
        history = self.rollback_history
        history.append(
            {"from_version": rolled, "to_version": to, "reason": str(reason)[:500],
             "auto": auto, "at": at}
        )  # fmt: skip
        del history[:-ROLLBACKS_KEPT]


class FinishedVersions:
    """The draft version serving when each request finished, for the last `limit` request
    ids (a response's X-Codraft-Draft-Version).

    `owner` names the engine request a finished one belongs to (vLLM's internal id, unique;
    the children of an n > 1 request share their parent's): the parts of one request keep the
    highest version any of them finished with, while an id that a later request reuses (a
    client's request id sent twice) takes that request's version, lower or not (after a
    rollback it is lower)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._versions: OrderedDict[str, tuple[str | None, int]] = OrderedDict()

    def note(self, keys: Iterable[str], version: int, owner: str | None = None) -> None:
        for key in keys:
            held = self._versions.get(key)
            if held is not None and held[0] == owner:
                version_here = max(version, held[1])
            else:
                version_here = version
            self._versions[key] = (owner, version_here)
            self._versions.move_to_end(key)
        while len(self._versions) > self.limit:
            self._versions.popitem(last=False)

    def get(self, key: str) -> int | None:
        held = self._versions.get(key)
        return None if held is None else held[1]
