"""The sample buffer between the tap stream and the trainer, with a stated retention policy.

Policy (all bounds apply at once; the oldest samples go first):
- size: at most `max_samples` documents, `max_tokens` tokens and `max_bytes` bytes (the
  samples' tensors: token ids, loss mask, taps, final hidden state; held-out samples count
  too, and training samples go first);
- age: samples older than `max_age_s` seconds are dropped;
- policy window: only samples whose policy version is within `policy_window` of the newest seen
  are kept, so data of a superseded RL policy ages out as soon as the new policy's arrives;
- held-out: a `holdout_fraction` of requests never trains; it is the evaluation set on which
  each candidate draft is compared with the serving one (its own bounded list, same age and
  policy rules). Which requests are held out is an HMAC-SHA256 of the request id under a key
  only this learner knows (`holdout_key`, random per buffer unless given), so a sender, who
  chooses request ids, cannot choose what the publish gate scores; the same request always
  lands on the same side under one key.
Training batches draw documents uniformly at random from the buffer (with replacement across
steps), so recent data is seen several times while it stays.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from codraft.learner.data.packing import Sample


@dataclass
class BufferPolicy:
    max_samples: int = 4096
    max_tokens: int = 2_000_000
    max_bytes: int = 2 << 30  # the buffered samples' tensors, held-out ones included
    max_age_s: float = 1800.0
    policy_window: int = 0  # keep policy versions >= newest - window
    holdout_fraction: float = 0.1
    max_holdout: int = 64
    # the held-out split's HMAC key; None: 32 random bytes per buffer (a learner's secret)
    holdout_key: bytes | None = None


@dataclass
class _Entry:
    sample: Sample
    policy_version: int
    received: float
    nbytes: int = 0


@dataclass
class BufferStats:
    added: int = 0
    held_out: int = 0
    evicted: Counter = field(default_factory=Counter)  # reason -> count


def is_holdout(request_id: str, fraction: float, key: bytes) -> bool:
    """Whether a request is held out: HMAC-SHA256(key, request id) against `fraction`, so the
    same request always lands on the same side under one key, and without the key no sender
    can tell (or choose) which side a request id lands on."""
    if fraction <= 0:
        return False
    digest = hmac.new(key, request_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") / 2.0**64 < fraction


def sample_nbytes(sample: Sample) -> int:
    """Bytes a sample's tensors hold (what `BufferPolicy.max_bytes` bounds)."""
    return sum(
        t.numel() * t.element_size()
        for t in (sample.token_ids, sample.loss_mask, sample.taps, sample.last_hidden,
                  sample.teacher_logits)
        if t is not None
    )  # fmt: skip


class SampleBuffer:
    """Thread-safe: the ingest thread adds, the trainer draws."""

    def __init__(self, policy: BufferPolicy | None = None, seed: int = 0) -> None:
        self.policy = policy or BufferPolicy()
        self._train: deque[_Entry] = deque()
        self._holdout: deque[_Entry] = deque()
        self._tokens = 0
        self._bytes = 0  # training and held-out samples together
        self._newest_policy = 0
        key = self.policy.holdout_key
        self._holdout_key = os.urandom(32) if key is None else bytes(key)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.stats = BufferStats()

    @property
    def newest_policy(self) -> int:
        """The newest policy version among the samples received so far."""
        with self._lock:
            return self._newest_policy

    def add(self, sample: Sample, policy_version: int = 0, now: float | None = None) -> None:
        now = time.time() if now is None else now
        entry = _Entry(sample, int(policy_version), now, sample_nbytes(sample))
        with self._lock:
            self._newest_policy = max(self._newest_policy, entry.policy_version)
            self._bytes += entry.nbytes
            if self.is_holdout(sample.request_id):
                self._holdout.append(entry)
                self.stats.held_out += 1
                while len(self._holdout) > self.policy.max_holdout:
                    self._bytes -= self._holdout.popleft().nbytes
            else:
                self._train.append(entry)
                self._tokens += len(sample)
                self.stats.added += 1
            self._evict(now)

    def _evict(self, now: float) -> None:
        p = self.policy
        oldest_policy = self._newest_policy - p.policy_window

        def stale(e: _Entry) -> str | None:
            if e.policy_version < oldest_policy:
                return "policy"
            if now - e.received > p.max_age_s:
                return "age"
            return None

        for queue, counted in ((self._train, True), (self._holdout, False)):
            kept = deque()
            for e in queue:
                why = stale(e)
                if why is None:
                    kept.append(e)
                    continue
                self._bytes -= e.nbytes
                if counted:
                    self._tokens -= len(e.sample)
                    self.stats.evicted[why] += 1
            queue.clear()
            queue.extend(kept)
        while self._train and (len(self._train) > p.max_samples or self._tokens > p.max_tokens):
            e = self._train.popleft()
            self._tokens -= len(e.sample)
            self._bytes -= e.nbytes
            self.stats.evicted["size"] += 1
        while self._bytes > p.max_bytes and (self._train or self._holdout):
            if self._train:
                e = self._train.popleft()
                self._tokens -= len(e.sample)
                self.stats.evicted["bytes"] += 1
            else:
                e = self._holdout.popleft()
            self._bytes -= e.nbytes

    def is_holdout(self, request_id: str) -> bool:
        """Whether this buffer holds `request_id` out of training (its own key)."""
        return is_holdout(request_id, self.policy.holdout_fraction, self._holdout_key)

    def clear(self, reason: str) -> None:
        """Drop every sample, training ones counted as evicted for `reason`."""
        with self._lock:
            self.stats.evicted[reason] += len(self._train)
            self._train.clear()
            self._holdout.clear()
            self._tokens = self._bytes = 0

    def __len__(self) -> int:
        return len(self._train)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def nbytes(self) -> int:
        """Bytes the buffered samples' tensors hold (training and held-out)."""
        return self._bytes

    def draw(self, token_budget: int, now: float | None = None) -> list[Sample]:
        """Random documents up to `token_budget` tokens (at least one when not empty)."""
        with self._lock:
            self._evict(time.time() if now is None else now)
            if not self._train:
                return []
            order = list(range(len(self._train)))
            self._rng.shuffle(order)
            out, used = [], 0
            for i in order:
                s = self._train[i].sample
                if out and used + len(s) > token_budget:
                    continue
                out.append(s)
                used += len(s)
                if used >= token_budget:
                    break
            return out

    def holdout(self) -> list[Sample]:
        with self._lock:
            return [e.sample for e in self._holdout]

    def all_samples(self) -> list[Sample]:
        with self._lock:
            return [e.sample for e in self._train]
