"""The tap publisher: `codraft.tap.v1` messages to the learner over a ZeroMQ PUSH socket.

`put(msg)` is what an engine step calls. It never blocks: the message goes into a bounded queue
and a background thread, which owns the socket, encodes it (`codraft.tap.message.encode`) and
sends its frames zero-copy (`copy=False`, memoryviews over the tensors) with `zmq.NOBLOCK`. When
the queue is full, or the socket's send high-water mark is reached (no learner, or a slow one:
`zmq.Again`), the message is dropped and counted, in messages and bytes. Byte counts are the
exact frame lengths for messages that reached the socket and, for messages dropped at the queue
(never encoded), the data frames plus the magic frame (the small header is not counted).

For its first CONNECT_GRACE_S after connecting, a message that finds no peer ready waits
(in the publisher's thread, never the engine's) until one is, within that grace: a learner that
is listening is not missed while the connection is still being made.

With keys (`codraft.tap.auth.TapKeys`: this server's secret certificate and the learner's public
one) the socket is a CURVE client: encrypted, and talking only to the learner holding that key.
Keys are required when an endpoint leaves the host (an error naming the flag otherwise, before
anything connects) and read in the publisher's thread, in the process that opens the socket.

`close()` stops the thread, gives the socket at most `linger_ms` to flush, and counts whatever
was still queued as dropped. Which requests are captured at all (`sampled`) is decided on the
engine side, deterministically per request id.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from codraft.tap.auth import TapKeys, curve_client
from codraft.tap.message import MAGIC, TapMessage, encode

log = logging.getLogger(__name__)
_STOP = object()
CONNECT_GRACE_S = 2.0


def sampled(request_id: str, rate: float) -> bool:
    """Whether a request is captured at sample rate `rate`: a hash of its id against the rate,
    so the decision is the same on every rank and every time it is asked."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < rate


def split_endpoints(spec: str) -> list[str]:
    """'tcp://a:5557,tcp://b:5558' -> each endpoint (learner ranks share the stream)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"no tap endpoint in {spec!r}; expected e.g. tcp://127.0.0.1:5557")
    return parts


def check_connectable(endpoint: str) -> None:
    """Raise ValueError unless every endpoint of `endpoint` has the form a PUSH socket connects
    to: tcp://HOST:PORT (PORT 1-65535), ipc://PATH or inproc://NAME. Nothing is connected: the
    check runs where the publisher itself is not (codraft.server.tap_process)."""
    for e in split_endpoints(endpoint):
        scheme, _, rest = e.partition("://")
        ok = bool(rest) and scheme in ("tcp", "ipc", "inproc")
        if ok and scheme == "tcp":
            host, _, port = rest.rpartition(":")
            ok = bool(host) and port.isdigit() and 1 <= int(port) <= 65535
        if not ok:
            raise ValueError(
                f"cannot connect the tap publisher to {endpoint!r}: {e!r} is not of the form "
                "tcp://HOST:PORT, ipc://PATH or inproc://NAME"
            )


def message_nbytes(msg: TapMessage) -> int:
    """Bytes a message puts on the wire, header excepted (used for messages never encoded)."""
    return len(MAGIC) + sum(msg.header.frame_nbytes())


@dataclass
class PublisherStats:
    messages_sent: int = 0
    messages_dropped: int = 0
    bytes_sent: int = 0
    bytes_dropped: int = 0

    def add(self, other: PublisherStats) -> None:
        self.messages_sent += other.messages_sent
        self.messages_dropped += other.messages_dropped
        self.bytes_sent += other.bytes_sent
        self.bytes_dropped += other.bytes_dropped


class TapPublisher:
    """A PUSH socket connected to `endpoint`, fed through a bounded queue (see module doc)."""

    def __init__(
        self,
        endpoint: str,
        *,
        queue_size: int = 256,
        hwm: int = 64,
        linger_ms: int = 1000,
        context: zmq.Context | None = None,
        keys: TapKeys | None = None,
    ) -> None:
        """ValueError when `endpoint` cannot be connected to, or needs keys it was not given
        (or they cannot be read)."""
        self.endpoint = endpoint
        self.keys = keys or TapKeys(own_flag="--tap-key", peers_flag="--tap-learner-key")
        self.curve = self.keys.required(endpoint, "the server's tap connects to")
        self.linger_ms = linger_ms
        self._hwm = hwm
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._stats = PublisherStats()
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"codraft-tap-publisher[{endpoint}]", daemon=True
        )
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise ValueError(f"cannot connect the tap publisher to {endpoint!r}: {self._error}")

    # ------------------------------------------------------------------ engine side
    def put(self, msg: TapMessage, wait_s: float = 0.0) -> bool:
        """Queue `msg` for sending; False (and counted as dropped) when the queue is full.
        An engine step never waits (`wait_s = 0`); the tap process, which is not the engine,
        waits up to `wait_s` for room, so that a burst it assembles (its backlog after it
        starts, or a step of many requests) is paced by the socket rather than dropped at the
        queue; the socket still drops at its high-water mark (a learner that does not keep up)."""
        if self._closed:
            self._drop(message_nbytes(msg))
            return False
        try:
            if wait_s > 0:
                self._queue.put(msg, timeout=wait_s)
            else:
                self._queue.put_nowait(msg)
            return True
        except queue.Full:
            self._drop(message_nbytes(msg))
            return False

    def stats(self) -> dict[str, int]:
        with self._lock:
            s = PublisherStats(**vars(self._stats))
        return {**vars(s), "queue_depth": self._queue.qsize()}

    def totals(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(**vars(self._stats))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued message is sent or dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread; the socket gets at most linger_ms to flush. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass  # the thread sees _closed on its next poll
        wait = timeout if timeout is not None else self.linger_ms / 1000 + 5.0
        self._thread.join(wait)
        if self._thread.is_alive():
            log.warning("tap publisher for %s did not stop within %.1fs", self.endpoint, wait)

    # ------------------------------------------------------------------ thread
    def _drop(self, nbytes: int) -> None:
        with self._lock:
            self._stats.messages_dropped += 1
            self._stats.bytes_dropped += nbytes

    def _run(self) -> None:
        sock = None
        try:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._hwm)
            sock.setsockopt(zmq.LINGER, self.linger_ms)
            # One PUSH socket connected to every learner rank's PULL endpoint: ZeroMQ spreads
            # messages over the connected peers round-robin. IMMEDIATE keeps messages off peers
            # whose connection is not up yet.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            if self.curve:
                curve_client(sock, self.keys)
            for endpoint in split_endpoints(self.endpoint):
                sock.connect(endpoint)
            self._grace_until = time.monotonic() + CONNECT_GRACE_S
        except Exception as e:  # a malformed endpoint: report it to the constructor
            self._error = e
            if sock is not None:
                sock.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.1)
                except queue.Empty:
                    if self._closed:
                        break
                    continue
                if item is _STOP:
                    break
                try:
                    self._send(sock, item)
                finally:
                    self._queue.task_done()
        finally:
            self._drain()
            sock.close(linger=self.linger_ms)
            if self._own_ctx:
                self._ctx.term()  # returns once the socket has flushed or lingered out

    def _send(self, sock: zmq.Socket, msg: TapMessage) -> None:
        try:
            frames = encode(msg)
        except Exception:
            log.exception("tap message for request %s could not be encoded", msg.header.request_id)
            self._drop(message_nbytes(msg))
            return
        nbytes = sum(len(f) for f in frames)
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            left = self._grace_until - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLOUT):
                self._drop(nbytes)
                return
            try:  # a peer became ready within the grace
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._drop(nbytes)
                return
        with self._lock:
            self._stats.messages_sent += 1
            self._stats.bytes_sent += nbytes

    def _drain(self) -> None:
        """Count what is left in the queue at close as dropped."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._drop(message_nbytes(item))
