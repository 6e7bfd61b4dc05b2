"""The tap's assembly and sending, in a process of its own.

The engine's process runs vLLM's engine loop, which is host-bound at large batches, and every
thread in that process shares one interpreter lock: each time another thread takes the lock
back (after a copy, a checksum, a socket call) the engine thread waits for it. Measured with
`scripts/bench_capture_host.py`, the capture thread in the engine's process made a host-bound
loop's step 1.8x as long while it assembled 8 MB a step, though it held the lock for a fraction
of that (docs/benchmarks.md). So with `EngineConfig.tap_assembly = "process"` (the default) the
engine's process keeps only what must be there:

* bookkeeping in step order (codraft.server.capture.Capture), unchanged;
* the feed thread (`TapProcess`): per step, the device-to-host copy into pinned buffers
  (codraft.server.row_copy), one copy of the step's final rows into a reused host buffer, and
  one write of them, with a small msgpack header, into a pipe to the tap process. Its lock
  hand-overs are a few per step instead of a few per request and message. With
  `EngineConfig.tap_device_ring` the header says instead where the rows lie in a device ring
  (codraft.server.device_ring) and the tap process copies them off the device itself.

The tap process (`python -m codraft.server.tap_process`, started by `TapProcess`) runs the
same Assembler (codraft.server.capture: rows by position, chunks, the token-id check against
each request's sequence, messages) and the ZeroMQ publisher (codraft.server.publisher), and
sends back its counts (`stats`) every 0.1 s and on flush. It mirrors each captured request:
its prompt, its outputs (sent with each operation that needs them: only what is new), its
policy version and mode.

Wire between the two (two pipes, never a network): frames of a 4-byte little-endian header
length, a msgpack map, an 8-byte payload length and the payload (raw rows, or nothing); the
ring's CUDA IPC handles travel once, in the first frame, and its memfd is inherited. No
pickle. The tap process exits when its input pipe closes (the engine's process ended, or
closed the tap); if it dies, the feed thread logs it once, and the engine serves on with the tap
silent (counted in `tap_process_alive`).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO

import msgpack
import numpy as np
import torch

from codraft.server.capture import (
    _DROP_ALL,
    Assembler,
    CaptureStats,
    ReqState,
    StepRows,
    StopRule,
    TapTarget,
    _Broken,
    _Finish,
    _Rows,
    step_rows,
)
from codraft.server.device_ring import DeviceRing, RingReader
from codraft.server.publisher import PublisherStats, TapPublisher, check_connectable
from codraft.server.row_copy import StagedRows
from codraft.tap.auth import TapKeys
from codraft.tap.message import DTYPES

log = logging.getLogger(__name__)

_BITS = {2: np.int16, 4: np.int32}
PIPE_BYTES = 1 << 20  # the pipe's kernel buffer (Linux F_SETPIPE_SZ), where allowed
STATS_EVERY_S = 0.1
# How long the tap process waits for room in its publisher's queue before it drops a message
# (TapPublisher.put): its input backs up into the pipe meanwhile, never into the engine's step.
EMIT_WAIT_S = 5.0
# Bytes of a step's host rows that may wait for the feed thread (a tap process that does not
# keep up, or a stalled pipe): past it a step's rows are not queued, its requests are sent
# incomplete instead (counted in `steps_dropped`). Rows in the device ring are bounded there.
MAX_QUEUE_BYTES = 1 << 30
_STOP = object()


# ---------------------------------------------------------------------------- framing
def write_frame(fd: int, header: dict, payload: list[memoryview] | None = None) -> None:
    body = msgpack.packb(header, use_bin_type=True)
    size = sum(p.nbytes for p in payload or ())
    _write_all(fd, struct.pack("<I", len(body)) + body + struct.pack("<Q", size))
    for p in payload or ():
        _write_all(fd, p)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)  # gives up the interpreter lock while the kernel copies
        view = view[n:]


def read_frame(f: BinaryIO) -> tuple[dict, int] | None:
    """(header, payload length) or None at the end of the stream; the payload is then read by
    the caller (`read_into`)."""
    head = f.read(4)
    if len(head) < 4:
        return None
    body = _read_exact(f, struct.unpack("<I", head)[0])
    header = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return header, struct.unpack("<Q", _read_exact(f, 8))[0]


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"the tap pipe closed {n - len(data)} bytes short of a frame")
    return data


def read_into(f: BinaryIO, arrays: list[np.ndarray]) -> None:
    for a in arrays:
        view = memoryview(a).cast("B")
        while view:
            n = f.readinto(view)
            if not n:
                raise EOFError("the tap pipe closed inside a payload")
            view = view[n:]


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, 1031, PIPE_BYTES)  # F_SETPIPE_SZ
    except OSError:
        pass  # a smaller pipe only means more writes


# ---------------------------------------------------------------------------- engine side
class TapProcess:
    """The assembler of codraft.server.capture.Capture when assembly runs in the tap process:
    the same `put(op)`, `depth()`, `flush()`, `close()`; plus the publisher's controls
    (`RemotePublisher`). Counts the tap process reports land in `stats` (shared with Capture)."""

    def __init__(
        self,
        target: TapTarget,
        emit: Any,  # unused: the tap process publishes (kept for Assembler's signature)
        draft_version: Callable[[], int],
        max_tokens: int,
        stats: CaptureStats,
        ring: DeviceRing | None = None,
        max_queue_bytes: int = MAX_QUEUE_BYTES,
    ) -> None:
        """`ring`: the buffer on the engine's device the rows reach the tap process through
        (EngineConfig.tap_device_ring); None, or not shareable: through the pipe.
        `max_queue_bytes`: the bound on rows waiting for the feed thread (MAX_QUEUE_BYTES)."""
        self.target = target
        self.ring = ring
        self.draft_version = draft_version
        self.stats = stats
        self.alive = True
        self._closing = False
        self.publisher_totals = PublisherStats()  # of the tap process's current publisher
        self.publisher_gen = 0  # which publisher those counts are of (one per open)
        self._gens = 0
        self.publisher_depth = 0
        # unbounded in operations (each request's few are needed for the messages to be right),
        # bounded in the bytes of the rows they carry (`max_queue_bytes`)
        self._queue: queue.Queue = queue.Queue()
        self.max_queue_bytes = max_queue_bytes
        self.queued_bytes = 0
        self._row_bytes: dict[int, int] = {}  # id of a queued _Rows -> its bytes
        self.steps_dropped = 0  # steps whose rows found the queue full
        self._bytes_lock = threading.Lock()
        self._replies: dict[int, Any] = {}
        self._replied = threading.Condition()
        self._seq = 0
        self._keys: dict[int, tuple[ReqState, int, int]] = {}  # id -> (state, key, outputs sent)
        self._next_key = 0
        self._host: tuple[np.ndarray, ...] | None = None  # reused buffers of final rows
        self._max_tokens = max_tokens
        self._start = threading.Lock()
        self.proc: subprocess.Popen | None = None  # started at first use (a tap turned on)

    def _started(self) -> None:
        with self._start:
            if self.proc is not None:
                return
            to_child_r, self._out = os.pipe()
            from_child, to_parent_w = os.pipe()
            _grow_pipe(self._out)
            init = {"op": "init", "max_tokens": self._max_tokens, **_target_wire(self.target)}
            fds = [to_child_r, to_parent_w]
            wire = self.ring.export() if self.ring is not None else None
            if wire is not None:
                init.update(ring=wire, ring_fd=self.ring.fd)
                fds.append(self.ring.fd)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "codraft.server.tap_process",
                 str(to_child_r), str(to_parent_w)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )  # fmt: skip
            os.close(to_child_r)
            os.close(to_parent_w)
            self._in = os.fdopen(from_child, "rb")
            write_frame(self._out, init)
            self._feed = threading.Thread(target=self._run_feed, name="codraft-tap-feed",
                                          daemon=True)  # fmt: skip
            self._reader = threading.Thread(target=self._run_reader, name="codraft-tap-in",
                                            daemon=True)  # fmt: skip
            self._feed.start()
            self._reader.start()

    # ------------------------------------------------------------------ Assembler's API
    def put(self, op: Any) -> None:
        if self.proc is None and op is _DROP_ALL:
            return  # nothing was ever captured: no process to start for it
        self._started()
        if isinstance(op, _Rows):
            nbytes = _rows_nbytes(op)
            with self._bytes_lock:
                full = self.queued_bytes + nbytes > self.max_queue_bytes
                if not full:
                    self.queued_bytes += nbytes
                    self._row_bytes[id(op)] = nbytes
                else:
                    self.steps_dropped += 1
            if full:
                self._queue_full(op)
                return
        self._queue.put(op)

    def _queue_full(self, op: _Rows) -> None:
        """A step's rows that found the queue full: its requests go out incomplete, never
        wrong (the tap process drops them, counted in requests_incomplete)."""
        if self.steps_dropped == 1 or self.steps_dropped % 1000 == 0:
            log.warning(
                "codraft tap: %d step(s) of rows dropped, the queue to the tap process holds "
                "%d bytes (bound %d): the tap process does not keep up",
                self.steps_dropped, self.queued_bytes, self.max_queue_bytes,
            )  # fmt: skip
        seen: set[int] = set()
        for item in op.items:
            state = item[0]
            if id(state) not in seen:
                seen.add(id(state))
                self._queue.put(_Broken(state, "the queue to the tap process was full"))

    def depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 10.0) -> bool:
        """Every operation put so far assembled and handed to the publisher, which has sent
        or dropped it; False on timeout or when the tap process is gone."""
        if self.proc is None:
            return True  # nothing was ever put
        return self.request({"op": "flush"}, timeout) is not None

    def close(self, timeout: float = 5.0) -> None:
        if self.proc is None:
            return
        self.flush(timeout)
        self._closing = True
        self._queue.put(_STOP)
        self._feed.join(timeout)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._reader.join(1.0)

    # ------------------------------------------------------------------ requests
    def send(self, header: dict) -> None:
        """A control operation, in order with the rest, without waiting for it."""
        self._started()
        self._queue.put(header)

    def next_publisher(self) -> int:
        with self._replied:
            self._gens += 1
            return self._gens

    def request(self, header: dict, timeout: float = 10.0) -> dict | None:
        """Send a control operation in order with the rest; its reply, or None."""
        self._started()
        with self._replied:
            self._seq += 1
            seq = self._seq
        self._queue.put({**header, "seq": seq})
        deadline = time.monotonic() + timeout
        with self._replied:
            while seq not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return None
                self._replied.wait(min(left, 0.5))
            return self._replies.pop(seq)

    # ------------------------------------------------------------------ feed thread
    def _run_feed(self) -> None:
        while True:
            op = self._queue.get()
            if op is _STOP:
                os.close(self._out)
                return
            if isinstance(op, _Rows):
                with self._bytes_lock:
                    self.queued_bytes -= self._row_bytes.pop(id(op), 0)
            if not self.alive:
                continue
            try:
                self._send(op)
            except (BrokenPipeError, OSError) as e:
                self._died(f"the tap process's pipe failed ({e})")
            except Exception:
                log.exception("codraft tap: an operation could not be sent (dropped)")

    def _key(self, state: ReqState) -> int:
        entry = self._keys.get(id(state))
        if entry is None:
            self._next_key += 1
            entry = (state, self._next_key, 0)
            self._keys[id(state)] = entry
            write_frame(self._out, {
                "op": "new", "key": entry[1], "req_id": state.req_id,
                "prompt": state.prompt_ids, "policy": state.policy_version, "mode": state.mode,
            })  # fmt: skip
        return entry[1]

    def _outputs(self, state: ReqState) -> tuple[int, list[int]]:
        """The state's key and its outputs not yet sent."""
        key = self._key(state)
        _, _, sent = self._keys[id(state)]
        new = state.outputs[sent:]
        self._keys[id(state)] = (state, key, sent + len(new))
        return key, new

    def _send(self, op: Any) -> None:
        if isinstance(op, dict):
            write_frame(self._out, op)
        elif isinstance(op, _Rows):
            self._send_rows(op)
        elif isinstance(op, _Broken):
            write_frame(self._out, {"op": "broken", "key": self._key(op.state), "why": op.why})
        elif isinstance(op, _Finish):
            key, new = self._outputs(op.state)
            self._keys.pop(id(op.state), None)
            write_frame(
                self._out,
                {
                    "op": "finish",
                    "key": key,
                    "out": new,
                    "policy": op.policy_version,
                    "draft": self.draft_version(),
                },
            )
        elif op is _DROP_ALL:
            self._keys.clear()
            write_frame(self._out, {"op": "drop"})

    def _send_rows(self, op: _Rows) -> None:
        rows = op.rows
        if rows.slot is not None:  # on the device, in the ring: send where, not what
            self._send_slot(op)
            return
        rows.to_host()
        m = sum(n for _, _, n in op.items)
        width, hidden = rows.taps.shape[-1], rows.last.shape[-1]
        bits = _BITS[rows.taps.element_size()]
        if self._host is None or self._host[0].shape[0] < m or self._host[1].shape[1] != width:
            cap = max(m, 1024)
            self._host = (np.empty(cap, np.int32), np.empty((cap, width), bits),
                          np.empty((cap, hidden), bits))  # fmt: skip
        got = step_rows(op, out=self._host)
        items, outs = [], []
        for state, a, n, p, ok in got.items:
            key, new = self._outputs(state)
            items.append((key, a, n, p, ok, state.done))  # done: ended in this step or before
            if new:
                outs.append((key, new))
        header = {"op": "rows", "m": m, "width": width, "hidden": hidden, "items": items,
                  "out": outs, "draft": self.draft_version()}  # fmt: skip
        write_frame(self._out, header, [memoryview(x) for x in (got.ids, got.taps, got.last)])

    def _send_slot(self, op: _Rows) -> None:
        rows = op.rows
        items, outs = [], []
        for state, offset, n in op.items:
            key, new = self._outputs(state)
            items.append((key, offset, n, state.done))
            if new:
                outs.append((key, new))
        width, hidden = rows.taps.shape[-1], rows.last.shape[-1]
        header = {"op": "rows", "slot": rows.slot.wire(), "m": rows.taps.shape[0],
                  "width": width, "hidden": hidden, "items": items, "out": outs,
                  "draft": self.draft_version()}  # fmt: skip
        self.ring.sent(rows.slot)  # before the tap process can have copied it
        write_frame(self._out, header)

    @property
    def rows_via(self) -> str:
        """How a step's rows reach the tap process: "device ring" or "pipe"."""
        return "device ring" if self.ring is not None and self.ring.usable else "pipe"

    def _died(self, why: str) -> None:
        if self.ring is not None:  # its slots will never be copied: gather fresh tensors
            self.ring.disable("the tap process ended", quiet=self._closing)
        if self.alive:
            self.alive = False
            if not self._closing:
                log.error("codraft tap: %s; the engine serves on, the tap is silent", why)
            with self._replied:
                self._replied.notify_all()

    # ------------------------------------------------------------------ reader thread
    def _run_reader(self) -> None:
        try:
            while True:
                frame = read_frame(self._in)
                if frame is None:
                    break
                header, _ = frame
                if "ring_failed" in header and self.ring is not None:
                    self.ring.disable(header["ring_failed"])
                elif header.get("ring_opened") and self.ring is not None:
                    self.ring.opened = True
                self._take_stats(header.get("stats"))
                seq = header.get("seq")
                if seq is not None:
                    with self._replied:
                        self._replies[seq] = header
                        self._replied.notify_all()
        except Exception as e:
            if not self._closing:
                log.error("codraft tap: reading the tap process failed: %s", e)
        self._died(f"the tap process ended (exit status {self.proc.poll()})")

    def _take_stats(self, s: dict | None) -> None:
        if not s:
            return
        for name in ("requests_captured", "requests_incomplete", "requests_inconsistent",
                     "messages_built"):  # fmt: skip
            setattr(self.stats, name, int(s["capture"][name]))
        self.publisher_totals = PublisherStats(**s["publisher"])
        self.publisher_gen = int(s["gen"])
        self.publisher_depth = int(s["queue_depth"])


def _rows_nbytes(op: _Rows) -> int:
    """Host bytes a step's rows hold while queued (0 on the device, in the ring or not: the
    ring and RowCopier.max_bytes bound those)."""
    rows = op.rows
    if rows.slot is not None or rows.taps.device.type != "cpu":
        return 0
    return sum(t.numel() * t.element_size() for t in (rows.ids, rows.taps, rows.last))


def publish_from(assembler: Any, tap: Any) -> None:
    """When `assembler` is a tap process, the engine's tap switch (codraft.server.tap_switch)
    opens its publisher there: the messages are built and sent by that process."""
    if isinstance(assembler, TapProcess):
        tap.make = functools.partial(RemotePublisher, assembler)


def where_assembled(assembler: Any) -> dict[str, Any]:
    """`/stats`' `tap.assembly` ("process", "process (ended)" or "thread": where tap messages
    are assembled) and `tap.rows_via` ("device ring" or "pipe" to the tap process, "host copy"
    when assembled in the engine's process) for an engine's assembler; with a tap process,
    `tap.steps_dropped_queue_full` (steps whose rows found its queue full)."""
    if not isinstance(assembler, TapProcess):
        return {"assembly": "thread", "rows_via": "host copy"}
    alive = "process" if assembler.alive else "process (ended)"
    return {
        "assembly": alive,
        "rows_via": assembler.rows_via,
        "steps_dropped_queue_full": assembler.steps_dropped,
    }


class RemotePublisher:
    """The tap process's publisher, as codraft.server.worker_ext sees a TapPublisher. Opening
    does not wait for the tap process (it may still be starting, and the RPC that opens it has
    seconds): the endpoint is checked here, and the process opens it in turn."""

    def __init__(
        self,
        tap: TapProcess,
        endpoint: str,
        *,
        queue_size: int,
        hwm: int,
        linger_ms: int,
        keys: TapKeys | None = None,
    ) -> None:
        """`keys`: the tap's key paths; the tap process reads the keys (only the paths go down
        the pipe)."""
        check_connectable(endpoint)
        keys = keys or TapKeys(own_flag="--tap-key", peers_flag="--tap-learner-key")
        keys.required(endpoint, "the server's tap connects to")
        self.tap, self.endpoint = tap, endpoint
        self.gen = tap.next_publisher()
        self.closed: PublisherStats | None = None
        tap.send({"op": "open", "endpoint": endpoint, "queue_size": queue_size, "hwm": hwm,
                  "linger_ms": linger_ms, "gen": self.gen, "key": keys.own,
                  "learner_key": keys.peers})  # fmt: skip

    def stats(self) -> dict[str, int]:
        return {**vars(self.totals()), "queue_depth": self.tap.publisher_depth}

    def totals(self) -> PublisherStats:
        if self.closed is not None:
            return PublisherStats(**vars(self.closed))
        if self.tap.publisher_gen != self.gen:  # counts of an earlier publisher, not yet ours
            return PublisherStats()
        return PublisherStats(**vars(self.tap.publisher_totals))

    def flush(self, timeout: float = 10.0) -> bool:
        return self.tap.flush(timeout)

    def close(self) -> None:
        reply = self.tap.request({"op": "close_publisher"}, timeout=30.0)
        self.closed = PublisherStats(**reply["closed"]) if reply is not None else self.totals()


def _target_wire(t: TapTarget) -> dict:
    name = {v: k for k, v in DTYPES.items()}[t.dtype]
    return {
        "tap_layers": list(t.tap_layers),
        "hidden_size": t.hidden_size,
        "fingerprint": t.fingerprint,
        "dtype": name,
        "max_model_len": t.max_model_len,
    }


# ---------------------------------------------------------------------------- tap process
class _Child:
    def __init__(self, init: dict, out_fd: int) -> None:
        self.out_fd = out_fd
        self.target = TapTarget(
            tuple(init["tap_layers"]), int(init["hidden_size"]), init["fingerprint"],
            DTYPES[init["dtype"]], int(init["max_model_len"]),
        )  # fmt: skip
        self.stats = CaptureStats()
        self.publisher: TapPublisher | None = None
        self.gen = 0
        self.draft = 0
        self.states: dict[int, ReqState] = {}
        self.asm = Assembler(
            self.target, self._emit, lambda: self.draft, int(init["max_tokens"]), self.stats,
            thread=False,
        )  # fmt: skip
        self._bits = _BITS[torch.empty(0, dtype=self.target.dtype).element_size()]
        self._write = threading.Lock()
        self.done = threading.Event()
        self.ring: RingReader | None = None
        if "ring" in init:
            try:
                self.ring = RingReader(init["ring"], int(init["ring_fd"]))
                self.reply({"ring_opened": True})
            except Exception as e:
                why = f"the tap process could not open the device ring ({type(e).__name__}: {e})"
                log.warning("%s", why)
                self.reply({"ring_failed": why})
        threading.Thread(target=self._report, name="codraft-tap-stats", daemon=True).start()

    def _emit(self, msg: Any) -> None:
        if self.publisher is not None:
            self.publisher.put(msg, wait_s=EMIT_WAIT_S)

    def _stats(self) -> dict:
        pub = self.publisher
        totals = pub.totals() if pub is not None else PublisherStats()
        return {"capture": vars(self.stats), "publisher": vars(totals), "gen": self.gen,
                "queue_depth": pub.stats()["queue_depth"] if pub is not None else 0}  # fmt: skip

    def reply(self, header: dict) -> None:
        with self._write:
            write_frame(self.out_fd, {**header, "stats": self._stats()})

    def _report(self) -> None:
        """The counts, every STATS_EVERY_S (the publisher keeps sending between operations)."""
        while not self.done.wait(STATS_EVERY_S):
            try:
                self.reply({})
            except OSError:
                return

    def _outputs(self, pairs: list) -> None:
        for key, new in pairs:
            st = self.states.get(key)
            if st is not None:
                st.outputs.extend(new)

    def _slot_rows(self, h: dict) -> None:
        """A step's rows in the device ring: copied to the host here, then as from the pipe."""
        self.draft = h["draft"]
        self._outputs(h["out"])
        items = []
        for k, offset, n, done in h["items"]:
            st = self.states.get(k)
            if st is not None:
                st.done = st.done or done  # no chunk of a request that ends here
                items.append((st, offset, n))
        if self.ring is None:  # the engine learns this from ring_failed and stops using it
            for st, _, _ in items:
                self.asm.apply(_Broken(st, "the tap process could not open the device ring"))
            return
        width = h["width"]
        ints, feats = self.ring.take(h["slot"], h["m"], width + h["hidden"], self.target.dtype)
        rows = StagedRows(ints[0].to(torch.int32), ints[1], feats[:, :width], feats[:, width:])
        self.asm.store(step_rows(_Rows(rows, items)))

    def handle(self, h: dict, f: BinaryIO, size: int) -> None:
        op = h["op"]
        if op == "rows" and "slot" in h:
            self._slot_rows(h)
            return
        if op == "rows":
            m, width, hidden = h["m"], h["width"], h["hidden"]
            ids = np.empty(m, np.int32)
            taps, last = np.empty((m, width), self._bits), np.empty((m, hidden), self._bits)
            read_into(f, [ids, taps, last])
            self.draft = h["draft"]
            self._outputs(h["out"])
            items = []
            for k, a, n, p, ok, done in h["items"]:
                st = self.states.get(k)
                if st is not None:
                    st.done = st.done or done  # no chunk of a request that ends here
                    items.append((st, a, n, p, ok))
            self.asm.store(StepRows(ids, taps, last, items))
            return
        if op == "new":
            self.states[h["key"]] = ReqState(
                h["req_id"], list(h["prompt"]), None, int(h["policy"]), h["mode"],
                StopRule(frozenset(), 0, 0),
            )  # fmt: skip
        elif op == "broken" and h["key"] in self.states:
            self.asm.apply(_Broken(self.states[h["key"]], h["why"]))
        elif op == "finish":
            st = self.states.pop(h["key"], None)
            if st is not None:
                st.outputs.extend(h["out"])
                st.done = True
                self.draft = h["draft"]
                self.asm.apply(_Finish(st, int(h["policy"])))
        elif op == "drop":
            self.states.clear()
            self.asm.apply(_DROP_ALL)
        elif op == "open":
            if self.publisher is not None:  # the engine closes first; never leak a socket
                self.publisher.close()
                self.publisher = None
            self.gen = int(h["gen"])
            try:
                keys = TapKeys(h.get("key"), h.get("learner_key"), own_flag="--tap-key",
                               peers_flag="--tap-learner-key")  # fmt: skip
                self.publisher = TapPublisher(
                    h["endpoint"], queue_size=h["queue_size"], hwm=h["hwm"],
                    linger_ms=h["linger_ms"], keys=keys,
                )  # fmt: skip
            except ValueError as e:  # checked by the engine's process first: not expected
                log.error("the tap stays silent: %s", e)
        elif op == "close_publisher":
            closed = PublisherStats()
            if self.publisher is not None:
                self.publisher.close()
                closed = self.publisher.totals()
                self.publisher = None
            self.reply({"seq": h["seq"], "closed": vars(closed)})
        elif op == "flush":
            if self.publisher is not None:
                self.publisher.flush()
            self.reply({"seq": h["seq"]})
        else:
            raise ValueError(f"unknown tap operation {op!r}")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s codraft tap: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C; this ends at EOF
    f = os.fdopen(int(argv[0]), "rb")
    out_fd = int(argv[1])
    first = read_frame(f)
    if first is None or first[0].get("op") != "init":
        log.error("expected an init frame first")
        return 2
    child = _Child(first[0], out_fd)
    try:
        while True:
            frame = read_frame(f)
            if frame is None:
                break
            header, size = frame
            if header.get("op") != "rows" and size:  # only rows carry a payload
                log.error("operation %r carried %d payload bytes (skipped)", header.get("op"), size)
                _read_exact(f, size)
                continue
            try:
                child.handle(header, f, size)
            except (EOFError, OSError):
                raise
            except Exception:
                log.exception("an operation failed (dropped)")
    finally:
        child.done.set()
        if child.publisher is not None:
            child.publisher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
