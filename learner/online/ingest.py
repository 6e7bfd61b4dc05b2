"""Ingest: a ZeroMQ PULL socket that validates every tap message and buffers the good ones.

The learner binds; servers connect their PUSH sockets (several learner ranks each bind their own
port and the servers' PUSH sockets spread messages over them round-robin). Off the loopback
interface the socket is a CURVE server that admits only the servers whose public keys it was
given (`codraft.tap.auth`); a peer that fails the handshake delivers nothing and is counted under
"auth".

Every field a message carries is checked against what this learner trains on: by
`codraft.tap.decode` against the expectation (schema, fingerprint, mode, tap layers, dtype,
hidden size, vocab, shapes, crc, size limits), then here against the versions the server
announced (`VersionBounds`: a policy or draft version ahead of the server's, beyond a small
slack, is refused as "policy_ahead" / "draft_ahead", so no sender can push the buffer's
policy window past the real data). Mode, tap layers and dtype that the expectation leaves open
are pinned to the first message accepted, so every buffered sample packs with every other
(`pin`); `repin` moves the pin to the layers of the draft being trained and empties the buffer
of samples taken under another. A rejected message is counted by reason and logged
(rate-limited), never fatal: nothing a peer sends raises out of `handle` (an unexpected error is
counted under "internal"). A server that sends another tap schema has every message counted
under "schema" (schema 1, whose last hidden state is taken before the final norm, with the log
saying so). ZeroMQ's own MAXMSGSIZE drops oversized frames before they are allocated.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import zmq
from zmq.utils.monitor import recv_monitor_message

from codraft.learner.data.packing import Sample
from codraft.learner.online.buffer import SampleBuffer
from codraft.tap import DEFAULT_LIMITS, TapExpectation, TapLimits, TapRejected, decode
from codraft.tap.auth import CurveServer, TapKeys

log = logging.getLogger("codraft.learn.ingest")

# Reasons counted here, besides `codraft.tap.REASONS` (decode's).
INGEST_REASONS = (
    "policy_ahead",  # policy version beyond the server's announced one + slack
    "draft_ahead",  # draft version beyond the server's (or this learner's published) + slack
    "no_loss_tokens",  # a loss mask of zeros only: nothing to learn from
    "transport",  # a socket error (e.g. a frame over MAXMSGSIZE)
    "auth",  # a peer failed the CURVE handshake or was not admitted (no message delivered)
    "internal",  # an unexpected error while taking a message in (a learner bug; logged)
)
_AUTH_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


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


@dataclass
class VersionBounds:
    """The newest policy and draft versions the server announced (None: no bound at all, a
    learner that reads no server), and how far ahead of them a message may be: the server may
    move on between two reads of its versions."""

    policy: int | None = None
    draft: int | None = None
    slack: int = 1
    # set on every refusal: whoever reads the server's versions may read them again sooner
    ahead: threading.Event = field(default_factory=threading.Event, repr=False)

    def check(self, policy_version: int, draft_version: int) -> None:
        if self.policy is not None and policy_version > self.policy + self.slack:
            self.ahead.set()
            raise TapRejected(
                "policy_ahead",
                f"policy version {policy_version}, but the server announces {self.policy} "
                f"(+{self.slack} allowed): a message from ahead of the server's policy",
            )
        if self.draft is not None and draft_version > self.draft + self.slack:
            self.ahead.set()
            raise TapRejected(
                "draft_ahead",
                f"draft version {draft_version}, but the server serves {self.draft} "
                f"(+{self.slack} allowed)",
            )


class TapIngest:
    def __init__(
        self,
        endpoint: str,
        buffer: SampleBuffer,
        expect: TapExpectation | None = None,
        limits: TapLimits = DEFAULT_LIMITS,
        rcvhwm: int = 256,
        *,
        keys: TapKeys | None = None,
        bounds: VersionBounds | None = None,
        pin: bool = True,
    ) -> None:
        """`keys`: the learner's tap keys (codraft.tap.auth; required when `endpoint` leaves the
        host, ValueError before anything is bound otherwise); `bounds`: the server's announced
        versions (None: unbounded); `pin`: fill the expectation's open mode, tap layers and
        dtype from the first message accepted."""
        keys = keys or TapKeys()
        curve = keys.required(endpoint, "the learner binds the tap on")
        self.endpoint = endpoint
        self.buffer = buffer
        self.expect = expect
        self.limits = limits
        self.bounds = bounds or VersionBounds()
        self.pin = pin
        self.curve = curve
        self.stats = IngestStats()
        self._lock = threading.Lock()  # one message's checks and its add, against `repin`
        self._auth: CurveServer | None = None
        # a CURVE socket gets a context of its own: the ZAP handler serves a whole context
        self._own_ctx = curve
        self._ctx = zmq.Context() if curve else zmq.Context.instance()
        try:
            if curve:
                self._auth = CurveServer(self._ctx, keys)
            self._sock = self._ctx.socket(zmq.PULL)
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self._auth is not None:
                self._auth.apply(self._sock)
            self._monitor = self._sock.get_monitor_socket(_AUTH_EVENTS) if curve else None
            self._sock.bind(endpoint)
        except Exception:
            self._close_transport()
            raise
        self.bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="codraft-ingest", daemon=True)
        self._last_log = 0.0

    def start(self) -> TapIngest:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._close_transport()

    def _close_transport(self) -> None:
        sock = getattr(self, "_sock", None)
        monitor = getattr(self, "_monitor", None)
        if sock is not None and monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    # ------------------------------------------------------------------ messages
    def handle(self, frames: list) -> bool:
        """Validate one multipart message and buffer it; False (counted) when rejected.
        Raises nothing, whatever the frames hold."""
        try:
            with self._lock:
                return self._take(frames)
        except Exception:  # a learner bug, never the peer's way to stop ingest
            self.stats.rejected["internal"] += 1
            log.exception("taking a tap message in failed (counted under 'internal')")
            return False

    def _take(self, frames: list) -> bool:
        self.stats.bytes += sum(len(f) for f in frames)
        self.stats.last_message_at = time.time()
        try:
            msg = decode(frames, limits=self.limits, expect=self.expect)
            self.bounds.check(msg.header.policy_version, msg.header.draft_version)
        except TapRejected as e:
            self._refused(e.reason, str(e))
            return False
        sample = Sample.from_tap(msg)
        if not int(sample.loss_mask.sum()):
            self._refused("no_loss_tokens", "a loss mask without a token to learn on")
            return False
        if self.pin:
            self._pin(msg.header)
        self.buffer.add(sample, msg.header.policy_version)
        self.stats.accepted += 1
        self.stats.accepted_tokens += len(sample)
        return True

    def _refused(self, reason: str, why: str) -> None:
        self.stats.rejected[reason] += 1
        now = time.monotonic()
        if now - self._last_log > 5.0:
            self._last_log = now
            log.warning(
                "rejected a tap message (%s): %s [rejected so far: %s]",
                reason, why, dict(self.stats.rejected),
            )  # fmt: skip

    def _pin(self, h: object) -> None:
        e = self.expect or TapExpectation()
        pinned: dict[str, object] = {}
        if e.mode is None:
            pinned["mode"] = h.mode
        if h.mode == "full":
            if e.tap_layers is None:
                pinned["tap_layers"] = tuple(h.tap_layers)
            if e.dtype is None:
                pinned["dtype"] = h.dtype
        if pinned:
            self.expect = replace(e, **pinned)
            log.info("tap pinned to the first message accepted: %s", pinned)

    def repin(self, tap_layers: tuple[int, ...]) -> bool:
        """The draft being trained reads `tap_layers`: refuse every other from now on, and
        when the buffer was filled under other layers, empty it (True then)."""
        tap_layers = tuple(int(t) for t in tap_layers)
        with self._lock:
            e = self.expect or TapExpectation()
            before = e.tap_layers
            self.expect = replace(e, tap_layers=tap_layers)
            if before is None or before == tap_layers:
                return False
            self.buffer.clear("tap_layers")
        log.error(
            "the draft reads tap layers %s but the buffer held messages of %s: emptied it; "
            "messages of other tap layers are refused (server and learner must agree)",
            list(tap_layers), list(before),
        )  # fmt: skip
        return True

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(200))
            if self._monitor is not None and self._monitor in ready:
                self._auth_events()
            if self._sock not in ready:
                continue
            try:
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:  # e.g. a frame over MAXMSGSIZE drops the peer's message
                self.stats.rejected["transport"] += 1
                log.warning("tap socket error: %s", e)
                continue
            self.handle([f.buffer for f in frames])

    def _auth_events(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if event["event"] & _AUTH_EVENTS:
                self._refused("auth", f"a peer failed the tap's CURVE handshake ({event})")
