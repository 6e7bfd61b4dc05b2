"""The tap process (codraft.server.tap_process) when things go wrong: it dies, or the engine's
process does. What it sends when all is well is checked with the same cases as the in-thread
assembly in tests/test_capture_steps.py, and through real engines in test_server_engine.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch
from test_capture_steps import Harness, NewRequest, _sp

from codraft.server.capture import CaptureStats, TapTarget
from codraft.server.tap_process import RemotePublisher, TapProcess


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_dead_tap_process_leaves_the_engine_side_serving() -> None:
    h = Harness(assembly="process")
    tap = h.cap.assembler
    new = [NewRequest("a", [1, 2], _sp(max_tokens=3), "full")]
    h.cap.on_step(h.record([("a", 0, [1, 2], 0)], new=new), [[3]])
    assert h.cap.flush()
    tap.proc.kill()
    tap.proc.wait(10)
    t0 = time.monotonic()
    for _ in range(5):  # steps go on: nothing raises, nothing blocks
        h.cap.on_step(h.record([("a", 2, [3], 0)]), [[4]])
    assert not h.cap.flush(timeout=5.0)
    assert time.monotonic() - t0 < 8.0
    deadline = time.monotonic() + 5
    while tap.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tap.alive
    h.pub.close()  # answers at once, without the process
    h.cap.close()
    h.sock.close(linger=0)
    h.zctx.term()


def test_the_tap_process_ends_with_the_engine_process() -> None:
    """SIGKILL to the process that started it: its pipe closes and it exits."""
    code = textwrap.dedent(
        """
        import os, sys, torch
        from codraft.server.capture import CaptureStats, TapTarget
        from codraft.server.tap_process import RemotePublisher, TapProcess
        tap = TapProcess(TapTarget((1,), 4, "fp", torch.float32, 100), None, lambda: 0, 64,
                         CaptureStats())
        RemotePublisher(tap, "tcp://127.0.0.1:1", queue_size=4, hwm=4, linger_ms=0)
        print(tap.proc.pid, flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the tap process outlived the process that started it"
    finally:
        parent.kill()


def test_a_bad_endpoint_is_a_clear_error() -> None:
    tap = TapProcess(TapTarget((1,), 4, "fp", torch.float32, 100), None, lambda: 0, 64,
                     CaptureStats())  # fmt: skip
    try:
        try:
            RemotePublisher(tap, "nonsense://x", queue_size=4, hwm=4, linger_ms=0)
        except ValueError as e:
            assert "nonsense://x" in str(e)
        else:
            raise AssertionError("a malformed endpoint was accepted")
    finally:
        tap.close()


def test_endpoint_forms_checked_without_connecting() -> None:
    import pytest

    from codraft.server.publisher import check_connectable

    check_connectable("tcp://127.0.0.1:5557,tcp://learner-1.learner:5557")
    check_connectable("ipc:///tmp/tap.sock")
    for bad in ("tcp://host", "tcp://:5557", "tcp://h:99999", "tcp://h:x", "udp://h:1"):
        with pytest.raises(ValueError, match="not of the form"):
            check_connectable(bad)


def test_a_burst_at_start_is_paced_not_dropped() -> None:
    """Messages assembled before the connection is up, into a queue far smaller than the burst:
    the tap process starts with the first operation, reads its backlog at once, and must wait
    for the socket (TapPublisher.put's wait) rather than drop at its queue while a learner is
    listening. With the tap process's wait at 0 some are dropped (checked by hand)."""
    h = Harness(assembly="process", queue_size=2, handshake=False)
    n = 60
    new = [NewRequest(f"r{i}", [1, 2, 3], _sp(max_tokens=1), "full") for i in range(n)]
    rows = [(f"r{i}", 0, [1, 2, 3], 0) for i in range(n)]
    h.cap.on_step(h.record(rows, new=new), [[4]] * n)
    got = h.done()  # asserts nothing was dropped, and receives every message sent
    assert sorted(got) == sorted(f"r{i}" for i in range(n)), sorted(got)


def test_rows_past_the_queue_bound_are_dropped_and_counted() -> None:
    """The queue to the tap process is bounded in the bytes of the rows it holds: a step whose
    rows find it full is not queued, its requests go out incomplete (never wrong), and the step
    is counted; the next step within the bound goes through."""
    from codraft.server.tap_process import where_assembled

    h = Harness(assembly="process")
    tap = h.cap.assembler
    tap.max_queue_bytes = 0  # every step's rows find the queue full
    new = [NewRequest("a", [1, 2], _sp(max_tokens=1), "full")]
    h.cap.on_step(h.record([("a", 0, [1, 2], 0)], new=new), [[3]])
    tap.max_queue_bytes = 1 << 30
    new = [NewRequest("b", [1, 2], _sp(max_tokens=1), "full")]
    h.cap.on_step(h.record([("b", 0, [1, 2], 0)], new=new), [[3]])
    got = h.done()
    assert sorted(got) == ["b"], sorted(got)
    assert tap.steps_dropped == 1 and tap.queued_bytes == 0
    assert h.cap.stats.requests_incomplete == 1, h.cap.stats
    assert where_assembled(tap)["steps_dropped_queue_full"] == 1
