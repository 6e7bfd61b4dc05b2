"""Publishing off the training loop: a thread that hands finished checkpoints to the server.

A publish is a prepare, a wait until the server has staged the draft (it reads, hashes, checks
and builds it while serving), and a commit: tens of ms on an idle server, seconds under load,
since every RPC waits for an engine step. The learner keeps training meanwhile:

* `submit(job)` returns at once. One publish runs at a time; a job submitted while one runs
  waits, and a newer submit replaces a waiting one (only the newest checkpoint is worth
  serving; the replaced one stays on disk, and is counted as superseded).
* `drain()` returns the finished jobs with their outcome; the learner applies them in its loop
  (metrics, the draft it compares candidates against, version numbering after a 409).
* `close(timeout)` lets the running and the waiting publish finish, so the last checkpoint a
  learner wrote before stopping still reaches the server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codraft.learner.online.publisher import PublishOutcome

log = logging.getLogger("codraft.learn.publish")


@dataclass
class PublishJob:
    draft_dir: Path
    version: int
    payload: Any = None  # what the learner needs back with the outcome (e.g. the draft's copy)
    outcome: PublishOutcome | None = None


class PublishThread:
    def __init__(self, publish: Callable[[Path], PublishOutcome]) -> None:
        self._publish = publish
        self._cond = threading.Condition()
        self._waiting: PublishJob | None = None
        self._running: PublishJob | None = None
        self._done: list[PublishJob] = []
        self._closing = False
        self.superseded = 0
        self._thread = threading.Thread(target=self._loop, name="codraft-publish", daemon=True)
        self._thread.start()

    def submit(self, job: PublishJob) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the publish thread is closed: submit before close()")
            if self._waiting is not None:
                self.superseded += 1
                log.info(
                    "draft v%d superseded by v%d before it was published",
                    self._waiting.version,
                    job.version,
                )
            self._waiting = job
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return self._waiting is not None or self._running is not None

    def drain(self) -> list[PublishJob]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self, timeout: float = 60.0) -> bool:
        """Finish the running and the waiting publish (at most `timeout` s); True if all did."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("a draft publish was still running after %.0f s at shutdown", timeout)
            return False
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closing:
                    self._cond.wait()
                if self._waiting is None:  # closing, nothing left
                    return
                job, self._waiting = self._waiting, None
                self._running = job
            try:
                job.outcome = self._publish(job.draft_dir)
            except Exception as e:  # a bug, not the server's answer: report it, keep serving
                log.exception("publishing draft v%d failed", job.version)
                job.outcome = PublishOutcome(False, 0, f"{type(e).__name__}: {e}")
            with self._cond:
                self._running = None
                self._done.append(job)
                self._cond.notify_all()
