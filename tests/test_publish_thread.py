"""The learner's background publisher (codraft.learner.online.publish_thread): one publish at a
time, the newest waiting checkpoint wins, outcomes come back through drain(), close() finishes the
last publish. The publish function here is a stand-in with a gate (the real one talks to a server:
tests/test_online_e2e.py runs the daemon against codraft serve)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from codraft.learner.online.publish_thread import PublishJob, PublishThread
from codraft.learner.online.publisher import PublishOutcome


class GatedPublish:
    """Records each publish and holds it until released."""

    def __init__(self) -> None:
        self.calls: list[Path] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def __call__(self, draft_dir: Path) -> PublishOutcome:
        self.calls.append(draft_dir)
        self.started.release()
        assert self.release.acquire(timeout=10), "the test never released the publish"
        if draft_dir.name == "boom":
            raise RuntimeError("planted failure")
        return PublishOutcome(True, 200, server_version=int(draft_dir.name[1:]))


def _job(v: int) -> PublishJob:
    return PublishJob(Path(f"v{v}"), v)


def _drain_until(pt: PublishThread, n: int) -> list[PublishJob]:
    got: list[PublishJob] = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += pt.drain()
        time.sleep(0.01)
    return got


def test_submit_returns_at_once_and_the_newest_waiting_job_wins():
    pub = GatedPublish()
    pt = PublishThread(pub)
    pt.submit(_job(1))
    assert pub.started.acquire(timeout=5)  # v1 is running, held at the gate
    t0 = time.monotonic()
    pt.submit(_job(2))  # waits behind v1
    pt.submit(_job(3))  # replaces v2
    assert time.monotonic() - t0 < 0.5 and pt.busy()
    pub.release.release()  # v1 finishes; v3 starts
    assert pub.started.acquire(timeout=5)
    pub.release.release()
    done = _drain_until(pt, 2)
    assert [j.version for j in done] == [1, 3]
    assert all(j.outcome is not None and j.outcome.ok for j in done)
    assert pub.calls == [Path("v1"), Path("v3")] and pt.superseded == 1
    assert pt.close(5) and not pt.busy()


def test_close_finishes_the_running_and_the_waiting_publish():
    pub = GatedPublish()
    pt = PublishThread(pub)
    pt.submit(_job(1))
    assert pub.started.acquire(timeout=5)
    pt.submit(_job(2))
    pub.release.release()
    pub.release.release()
    assert pt.close(5)
    assert [j.version for j in pt.drain()] == [1, 2]


def test_an_exception_becomes_a_failed_outcome_and_the_thread_goes_on():
    pub = GatedPublish()
    pt = PublishThread(pub)
    pt.submit(PublishJob(Path("boom"), 7))
    pub.release.release()
    (failed,) = _drain_until(pt, 1)
    assert failed.outcome is not None and not failed.outcome.ok
    assert "planted failure" in failed.outcome.message
    pt.submit(_job(8))
    pub.release.release()
    (ok,) = _drain_until(pt, 1)
    assert ok.outcome is not None and ok.outcome.ok
    assert pt.close(5)
