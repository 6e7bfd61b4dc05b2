"""`codraft record`: receive a server's tap stream and write it to tap files.

A ZeroMQ PULL socket binds `--tap` (the server's tap endpoint PUSHes to it), every message is
validated with `codraft.tap.message.decode` and written as received with
`codraft.tap.recording.TapWriter` (files `taps-<seq>.taps` that `read_taps` / `TapDataset` and
the learner read offline). A recording holds one target: the first valid message fixes the
fingerprint, hidden size and tap layers expected of the rest. Rejected messages are counted by
reason and logged (the first few of each reason in full); they never stop the recorder.

It stops after --max-messages written messages, after --max-seconds, or on SIGINT/SIGTERM, and
always closes the current file (fsync + rename), so what it wrote is complete. Binding to
`tcp://127.0.0.1:*` picks a free port; the endpoint actually bound is printed first.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("codraft.record")

LOG_FIRST_REJECTS = 5  # per reason; later ones are only counted


@dataclass
class RecordConfig:
    tap: str = "tcp://127.0.0.1:5557"  # endpoint to bind (PULL)
    out: str = "runs/taps"
    max_messages: int | None = None
    max_seconds: float | None = None
    max_file_mb: int = 256
    prefix: str = "taps"
    rcv_hwm: int = 64  # messages ZeroMQ may queue before the sender's side drops


@dataclass
class RecordStats:
    endpoint: str = ""
    written: int = 0
    bytes_written: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by: str = ""


def _expectation(msg: Any) -> Any:
    from codraft.tap.message import TapExpectation

    h = msg.header
    return TapExpectation(
        fingerprint=h.fingerprint or None,
        hidden_size=h.hidden_size,
        tap_layers=tuple(h.tap_layers) if h.mode == "full" else None,
    )


class Recorder:
    """PULL socket + validation + TapWriter. `run()` returns when a stop condition is met."""

    def __init__(self, cfg: RecordConfig) -> None:
        import zmq

        from codraft.tap.message import DEFAULT_LIMITS
        from codraft.tap.recording import TapWriter

        self.cfg = cfg
        self.limits = DEFAULT_LIMITS
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, cfg.rcv_hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ refuses bigger messages before they reach Python memory.
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes + (1 << 20))
        self.sock.bind(cfg.tap)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.writer = TapWriter(cfg.out, prefix=cfg.prefix, max_file_bytes=cfg.max_file_mb << 20)
        self.stats = RecordStats(endpoint=self.endpoint)
        self.expect: Any = None
        self._stop: str = ""

    def request_stop(self, why: str) -> None:
        self._stop = self._stop or why

    def _handle(self, frames: list[Any]) -> None:
        from codraft.tap.message import TapRejected, decode

        try:
            msg = decode(frames, limits=self.limits, expect=self.expect)
        except TapRejected as e:
            n = self.stats.rejected.get(e.reason, 0) + 1
            self.stats.rejected[e.reason] = n
            if n <= LOG_FIRST_REJECTS:
                log.warning("rejected a tap message (%s #%d): %s", e.reason, n, e.detail)
            return
        if self.expect is None:
            self.expect = _expectation(msg)
        self.writer.write_frames(frames)
        self.stats.written += 1
        self.stats.bytes_written += sum(len(f) for f in frames)

    def run(self) -> RecordStats:
        import zmq

        cfg = self.cfg
        t0 = last_flush = time.monotonic()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        try:
            while not self._stop:
                if cfg.max_messages is not None and self.stats.written >= cfg.max_messages:
                    self.request_stop("max_messages")
                    break
                now = time.monotonic()
                if cfg.max_seconds is not None and now - t0 >= cfg.max_seconds:
                    self.request_stop("max_seconds")
                    break
                if now - last_flush >= 1.0:
                    self.writer.flush()
                    last_flush = now
                if not poller.poll(200):
                    continue
                parts = self.sock.recv_multipart(copy=False)
                self._handle([p.buffer for p in parts])
        finally:
            self.writer.close()
            self.sock.close(linger=0)
        self.stats.seconds = time.monotonic() - t0
        self.stats.stopped_by = self._stop or "error"
        self.stats.files = [str(p) for p in self.writer.files]
        return self.stats


def main(cfg: RecordConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        rec = Recorder(cfg)
    except Exception as e:  # zmq.ZMQError (bad or taken endpoint), OSError (out dir)
        print(f"codraft record: cannot bind {cfg.tap!r} or write {cfg.out!r}: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: rec.request_stop(signal.Signals(signum).name))
    print(f"codraft record: listening on {rec.endpoint}, writing to {Path(cfg.out)}", flush=True)
    stats = rec.run()
    print(json.dumps(asdict(stats)), flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RecordConfig()
    p.add_argument("--tap", default=d.tap, help="ZeroMQ endpoint to bind (PULL)")
    p.add_argument("--out", default=d.out, help="output folder for *.taps files")
    p.add_argument("--max-messages", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--max-file-mb", type=int, default=d.max_file_mb, help="rotate files at size")
    p.add_argument("--prefix", default=d.prefix, help="file name prefix")


def config_from_args(args: argparse.Namespace) -> RecordConfig:
    return RecordConfig(
        tap=args.tap,
        out=args.out,
        max_messages=args.max_messages,
        max_seconds=args.max_seconds,
        max_file_mb=args.max_file_mb,
        prefix=args.prefix,
    )
