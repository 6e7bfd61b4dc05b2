"""The automatic-rollback rule on the demo's traffic: concurrent requests of mixed lengths, whose
acceptance climbs along each generation and differs between short and long answers, with draft
swaps between batches and in the middle of them.

The engine here is a simulation (no vLLM: thousands of swaps must run in seconds); the rule,
its bookkeeping and its defaults are the product's own (`codraft.server.acceptance`,
`EngineConfig`), driven in the order both engines drive them: each step's verifications are
observed and recorded, the rule is checked, finished requests are closed, and a pending
rollback is carried out before the next step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from codraft.server.acceptance import Acceptance, AutoRollback, stratum
from codraft.server.engine_config import EngineConfig

K = 3  # draft tokens a verification


@dataclass
class Request:
    rid: str
    length: int  # tokens it generates
    quality: float  # how predictable it is: long answers repeat themselves more
    done: int = 0


def accept_prob(req: Request, position: int) -> float:
    """A draft token's chance to be accepted after `position` generated tokens: it climbs along
    the generation (an answer's first tokens are the hardest to guess)."""
    return req.quality * min(1.0, 0.35 + position / 48)


class SimEngine(AutoRollback):
    """The engine's side of the rule: the serving and previous draft slots, swaps, rollbacks."""

    def __init__(self, cfg: EngineConfig, acceptance: Acceptance | None = None) -> None:
        self.cfg = cfg
        self.acceptance = acceptance or Acceptance(cfg.rollback_window, cfg.rollback_min_requests)
        self.current = SimpleNamespace(version=0)
        self.previous: SimpleNamespace | None = None
        self.rollbacks: list[str] = []
        self.rollback_history: list[dict] = []

    def swap(self, version: int) -> None:
        self.previous, self.current = self.current, SimpleNamespace(version=version)
        self.acceptance.begin(version, self.previous.version)

    def run_pending(self) -> None:
        if self.pending_rollback is not None and self.previous is not None:
            self.rollbacks.append(self.pending_rollback)
            self.current, self.previous = self.previous, None
            self.acceptance.restart(self.current.version)
        self.pending_rollback = None


@dataclass
class Traffic:
    """Requests through a simulated engine: `concurrency` running at once (a new one starts as
    one finishes), or with `batch` set, batches of that many that all start together, the next
    once the last has finished (rollout traffic)."""

    seed: int = 0
    concurrency: int = 8
    batch: int | None = None
    steps: int = 0
    started: int = 0
    running: list[Request] = field(default_factory=list)
    finished_since_swap: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def new_request(self) -> Request:
        self.started += 1
        if self.rng.random() < 0.6:  # a short answer
            length, quality = self.rng.randint(6, 48), self.rng.uniform(0.25, 0.45)
        else:  # runs to max_tokens, repeating itself
            length, quality = self.rng.randint(120, 160), self.rng.uniform(0.55, 0.8)
        return Request(f"r{self.started}", length, quality)

    def refill(self) -> bool:
        """Start requests; True when a new batch began (a swap point between batches)."""
        if self.batch is None:
            while len(self.running) < self.concurrency:
                self.running.append(self.new_request())
            return False
        if self.running:
            return False
        self.running = [self.new_request() for _ in range(self.batch)]
        return True

    def step(self, engine: SimEngine, quality: dict[int, float]) -> None:
        """One engine step: every running request is verified once, with drafts proposed by the
        serving version, whose tokens are accepted `quality[version]` (default 1) times as
        often as the first draft's."""
        self.steps += 1
        engine.run_pending()
        version = engine.current.version
        q = quality.get(version, 1.0)
        drafts = tokens = accepted = 0
        finished = []
        for req in self.running:
            # the target's tokens do not depend on the draft: the same request, position and
            # draft quality always accept the same number of tokens
            r = random.Random(f"{req.rid}:{req.done}")
            a = 0
            while a < K and r.random() < q * accept_prob(req, req.done):
                a += 1
            engine.acceptance.observe(req.rid, version, K, a)
            drafts, tokens, accepted = drafts + 1, tokens + K, accepted + a
            req.done += 1 + a
            if req.done >= req.length:
                finished.append(req)
        engine.acceptance.record(version, drafts, tokens, accepted)
        engine._check_rollback()
        for req in finished:
            self.running.remove(req)
            engine.acceptance.close(req.rid)
            self.finished_since_swap += 1


def swap_identical_drafts(
    engine: SimEngine, traffic: Traffic, swaps: int, mid_batch_every: int = 40
) -> int:
    """Swap in a new version of the same draft `swaps` times, at random steps in the middle of
    the traffic and, with batches, also between batches. Returns the number of rollbacks."""
    version = 0
    next_swap = mid_batch_every
    while version < swaps:
        new_batch = traffic.refill()
        if (new_batch and traffic.rng.random() < 0.5) or traffic.steps >= next_swap:
            version += 1
            engine.swap(version)
            next_swap = traffic.steps + traffic.rng.randint(
                mid_batch_every // 2, 2 * mid_batch_every
            )
        traffic.step(engine, {})
    return len(engine.rollbacks)


def test_strata_double_in_width() -> None:
    assert [stratum(p) for p in (0, 1, 2, 3, 4, 7, 8, 100, 1 << 40)] == [0, 1, 2, 2, 3, 3, 4, 7, 15]


@pytest.mark.parametrize("batch", [None, 16], ids=["continuous", "batches"])
def test_identical_drafts_swapped_back_and_forth_are_never_rolled_back(batch) -> None:
    engine = SimEngine(EngineConfig())
    traffic = Traffic(seed=1, batch=batch)
    assert swap_identical_drafts(engine, traffic, swaps=300) == 0, engine.rollbacks[:3]


@pytest.mark.parametrize("batch", [None, 16], ids=["continuous", "batches"])
def test_a_draft_that_accepts_nothing_is_rolled_back_within_a_few_requests(batch) -> None:
    cfg = EngineConfig()
    for seed in range(5):
        engine = SimEngine(cfg)
        traffic = Traffic(seed=seed, batch=batch)
        for _ in range(300):  # v0 serves a while
            traffic.refill()
            traffic.step(engine, {})
        engine.swap(1)
        traffic.finished_since_swap = 0
        for _ in range(200):
            traffic.refill()
            traffic.step(engine, {1: 0.0})
            if engine.rollbacks:
                break
        assert engine.rollbacks, f"seed {seed}: the broken draft still serves"
        assert engine.current.version == 0
        # judged on its first window of verifications: fewer requests than two batches finish
        assert traffic.finished_since_swap <= 2 * (batch or traffic.concurrency), seed
        assert "v1 accepted 0 draft tokens" in engine.rollbacks[0]


def test_a_collapse_is_judged_against_acceptance_under_the_serving_policy() -> None:
    """A new policy moves every draft's acceptance: no reference survives it, so a draft is not
    rolled back for a drop that the policy, not the draft, caused."""
    engine = SimEngine(EngineConfig())
    traffic = Traffic(seed=3)
    for _ in range(300):
        traffic.refill()
        traffic.step(engine, {})
    engine.swap(1)
    engine.acceptance.restart(engine.current.version)  # policy v1 arrives
    for _ in range(300):
        traffic.refill()
        traffic.step(engine, {1: 0.0})  # as if the new policy made every draft useless
    assert engine.rollbacks == [] and engine.acceptance.verdict(1) is None


@pytest.mark.parametrize(("quality", "rolled_back"), [(0.3, True), (0.8, False), (1.3, False)])
def test_a_worse_draft_goes_and_a_slightly_worse_or_better_one_stays(quality, rolled_back):
    cfg = EngineConfig()
    for seed in range(3):
        engine = SimEngine(cfg)
        traffic = Traffic(seed=seed)
        for _ in range(300):
            traffic.refill()
            traffic.step(engine, {})
        engine.swap(1)
        for _ in range(1500):
            traffic.refill()
            traffic.step(engine, {1: quality})
        assert bool(engine.rollbacks) is rolled_back, (seed, engine.rollbacks[:1])


# --------------------------------------------------------------------- mutation checks
class FinishFirst(Acceptance):
    """A planted bias: verifications count only once their request has finished, so right
    after a swap the new draft is judged on the short requests that finish first."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: dict[str, list] = {}

    def observe(self, req_id: str, version: int, draft_tokens: int, accepted: int) -> None:
        self.held.setdefault(req_id, []).append((version, draft_tokens, accepted))

    def close(self, req_id: str) -> None:
        for v in self.held.pop(req_id, []):
            super().observe(req_id, *v)
        super().close(req_id)


def test_mutation_without_strata_rolls_back_identical_drafts(monkeypatch) -> None:
    """Planted: every verification in one stratum, so the first steps of a new batch (its heads)
    are held against the previous draft's whole batch."""
    from codraft.server import acceptance

    monkeypatch.setattr(acceptance, "stratum", lambda position: 0)
    engine = SimEngine(EngineConfig())
    assert swap_identical_drafts(engine, Traffic(seed=1, batch=16), swaps=300) > 0


def test_mutation_the_whole_request_rule_rolls_back_identical_drafts(monkeypatch) -> None:
    """Planted: the rule before strata, which counted a request once it had finished (so right
    after a swap the short requests that finish first) over all its positions at once."""
    from codraft.server import acceptance

    monkeypatch.setattr(acceptance, "stratum", lambda position: 0)
    cfg = EngineConfig()
    engine = SimEngine(cfg, FinishFirst(cfg.rollback_window, cfg.rollback_min_requests))
    assert swap_identical_drafts(engine, Traffic(seed=1, batch=16), swaps=300) > 0
