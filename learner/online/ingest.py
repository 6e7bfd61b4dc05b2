"""Ingest: a ZeroMQ PULL socket that validates every tap message and buffers the good ones.

The learner binds; servers connect their PUSH sockets (several learner ranks each bind their own
port and the servers' PUSH sockets spread messages over them round-robin). Every field is
checked by `codraft.tap.decode` against the configured target (schema, fingerprint, tap layers,
hidden size, vocab, shapes, dtype, crc, size limits); a rejected message is counted by reason and
logged (rate-limited), never fatal. A server that sends another tap schema has every message
counted under "schema" (schema 1, whose last hidden state is taken before the final norm, with
the log saying so). ZeroMQ's own MAXMSGSIZE drops oversized frames before they
are allocated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq

from codraft.learner.data.packing import Sample
from codraft.learner.online.buffer import SampleBuffer
from codraft.tap import DEFAULT_LIMITS, TapExpectation, TapLimits, TapRejected, decode

log = logging.getLogger("codraft.learn.ingest")


@dataclass
class IngestStats:
    accepted: int = 0
    accepted_tokens: int = 0
    bytes: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    last_message_at: float = 0.0

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class TapIngest:
    def __init__(
        self,
        endpoint: str,
        buffer: SampleBuffer,
        expect: TapExpectation | None = None,
        limits: TapLimits = DEFAULT_LIMITS,
        rcvhwm: int = 256,
    ) -> None:
        self.endpoint = endpoint
        self.buffer = buffer
        self.expect = expect
        self.limits = limits
        self.stats = IngestStats()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="codraft-ingest", daemon=True)
        self._last_log = 0.0

    def start(self) -> TapIngest:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def handle(self, frames: list) -> bool:
        """Validate one multipart message and buffer it; False (counted) when rejected."""
        self.stats.bytes += sum(len(f) for f in frames)
        self.stats.last_message_at = time.time()
        try:
            msg = decode(frames, limits=self.limits, expect=self.expect)
        except TapRejected as e:
            self.stats.rejected[e.reason] += 1
            now = time.monotonic()
            if now - self._last_log > 5.0:
                self._last_log = now
                log.warning(
                    "rejected a tap message (%s): %s [rejected so far: %s]",
                    e.reason, e, dict(self.stats.rejected),
                )  # fmt: skip
            return False
        sample = Sample.from_tap(msg)
        if not int(sample.loss_mask.sum()):
            self.stats.rejected["no_loss_tokens"] += 1
            return False
        self.buffer.add(sample, msg.header.policy_version)
        self.stats.accepted += 1
        self.stats.accepted_tokens += len(sample)
        return True

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(200)):
                continue
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:  # e.g. a frame over MAXMSGSIZE drops the peer's message
                self.stats.rejected["transport"] += 1
                log.warning("tap socket error: %s", e)
                continue
            self.handle([f.buffer for f in frames])
