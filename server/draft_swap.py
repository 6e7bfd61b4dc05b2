"""Draft swaps in two phases: prepare off the engine loop, commit between two engine steps.

vLLM v1 runs every `collective_rpc` inside the engine core's busy loop (`EngineCoreProc.
_handle_client_request` calls the utility synchronously between two `step()`s; on TP > 1 the
workers run it in their own loop, in order with `execute_model`). So whatever an RPC does, the
engine does not step meanwhile, and an RPC can only start at a step boundary. Hence:

- `prepare(path, version, sha256)` (RPC `codraft_prepare_draft`) checks the arguments, refuses
  a version that is not newer (409) or a missing path (404), notes the checkpoint files'
  identity (device, inode, size, mtime), starts a background thread and returns a ticket at
  once. The thread reads and checks the checkpoint while a second thread hashes it
  (`codraft.server.weights.open_draft`, `codraft.server.draft_read`: the bytes hashed are the bytes
  installed), builds the drafter's kernel-format weights from them
  (`codraft.server.draft_kernels.stage_kernels`) and then waits for the sha256; the engine keeps
  stepping (file reads, hashlib and torch kernels release the GIL). `version` None takes the
  checkpoint's own (codraft.json).
- `commit(ticket)` (RPC `codraft_commit_draft`) answers `ready: False` while the thread runs
  (the caller asks again); if a checkpoint file changed since the prepare, it prepares the
  path again and answers `ready: False` with the new ticket; then the thread's error
  (404/409/422/500: nothing changed), 409 for a ticket that is not the latest prepared one,
  and otherwise installs the staged weights (`install`: copy_ into the live storage + kernel
  attributes, ~ms) and makes the new draft current, the old one previous (kept for rollback).
- `swap(path, version, sha256)` (RPC `codraft_swap_draft`, what `POST /v1/draft` sends) commits
  the staged draft when it is this checkpoint (same path, a version and sha256 that agree, files
  unchanged since the prepare): a draft prepared ahead (`POST /v1/draft/prepare`) costs the
  swap one RPC. Otherwise it prepares the path (superseding the staged draft) and answers as
  `commit` does while that runs.
- `load(...)` (RPC `codraft_load_draft`) does both inside one RPC, as before.
- `staged()` (RPC `codraft_staged_draft`): the staged draft's state (404 when none).

At most one draft is staged: a newer prepare supersedes it (its ticket then gets 409), a commit
uses it up. Preparations run one at a time on a single worker thread, newest first: a prepare
that is superseded before the worker reaches it is never read, and one being prepared stops at
its next check (before the read, after the read and check, between the tensors of the staging,
before the checksum wait) and drops what it read. The
read buffer goes back to a pool of one for the next prepare. If the drafter's layout does not
allow staging (`StageError`), the slot keeps its checkpoint tensors and the commit falls back to
vLLM's in-place reload (`write_draft_weights`), as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from codraft.draft.checkpoint import CONFIG_NAME, META_NAME, WEIGHTS_NAME
from codraft.server.draft_kernels import StageError, install, snapshot_live, stage_kernels
from codraft.server.draft_read import BufferPool
from codraft.server.hooks import drafter_model, target_model
from codraft.server.weights import (
    DraftSlot,
    SwapError,
    check_load_args,
    check_newer,
    check_request,
    open_draft,
    utc_now,
    write_draft_weights,
)

log = logging.getLogger(__name__)
FileId = tuple[tuple[int, int, int, int] | None, ...]


def file_identity(path: str) -> FileId:
    """(device, inode, size, mtime) of each checkpoint file, None for a missing one."""
    out = []
    for name in (CONFIG_NAME, WEIGHTS_NAME, META_NAME):
        try:
            st = os.stat(os.path.join(path, name))
        except OSError:
            out.append(None)
            continue
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass
class Staging:
    """One prepared (or preparing) draft, named by its ticket."""

    ticket: str
    path: str
    version: int | None  # None: the checkpoint's own
    sha256: str | None
    identity: FileId
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    slot: DraftSlot | None = None
    error: SwapError | None = None
    timing: dict[str, float] = field(default_factory=dict)
    want: dict[str, Any] = field(default_factory=dict)  # version/sha256 a swap() asks for

    def state(self) -> str:
        if not self.done.is_set():
            return "preparing"
        return "failed" if self.error is not None else "ready"


def _cancel(st: Staging) -> None:
    st.error = SwapError(409, "superseded by a newer prepare before it was read")
    st.done.set()


class _Cancellable(dict):
    """Checkpoint tensors whose `items()` asks `cancelled` before handing on each one (the
    staging reads them through it): a superseded preparation stops between two tensors."""

    def __init__(self, weights: dict[str, torch.Tensor], cancelled: Callable[[], bool]) -> None:
        super().__init__(weights)
        self.cancelled = cancelled

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        for name, tensor in super().items():
            if self.cancelled():
                raise SwapError(409, "superseded by a newer prepare while it was staged")
            yield name, tensor


class DraftSwapper:
    """The serving draft, the one kept for rollback, and the one being prepared."""

    def __init__(self, runner: Any, vllm_config: Any, fingerprint: str | None, initial: DraftSlot):
        self.runner = runner
        self.vllm_config = vllm_config
        self.fingerprint = fingerprint
        self.current = initial
        self.previous: DraftSlot | None = None
        # The highest version ever installed: a rollback makes an older draft current again,
        # and a version number must still name one draft only (responses and per-version
        # metrics carry it), so a new draft has to be newer than this, not than the current.
        self.highest = initial.version
        self.staging: Staging | None = None
        self.pool = BufferPool()
        # the one preparing thread and the preparation it takes next (the newest only)
        self._queue = threading.Condition()
        self._next: Staging | None = None
        self._worker: threading.Thread | None = None
        self._stage_into(initial, snapshot=True)

    # ------------------------------------------------------------------ prepare
    def _new_staging(self, path: Any, version: Any, sha256: Any) -> Staging:
        path, version, sha256 = check_load_args(path, version, sha256)
        if version is not None:
            check_newer(version, self.highest, self.current.version)
        if not os.path.exists(path):
            raise SwapError(404, f"draft checkpoint not found: {path} does not exist")
        staging = Staging(uuid.uuid4().hex, path, version, sha256, file_identity(path))
        self.staging = staging  # supersedes an earlier one
        return staging

    def prepare(self, path: Any, version: Any = None, sha256: Any = None) -> dict[str, Any]:
        st = self._new_staging(path, version, sha256)
        with self._queue:
            dropped, self._next = self._next, st
            if dropped is not None:  # superseded before the worker reached it: never read
                _cancel(dropped)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._work, name="codraft-prepare", daemon=True
                )
                self._worker.start()
            self._queue.notify()
        return {"ok": True, "ticket": st.ticket, "version": st.version, "ready": False}

    def _work(self) -> None:
        """The preparing thread: the newest queued preparation, one at a time."""
        while True:
            with self._queue:
                while self._next is None:
                    self._queue.wait()
                st, self._next = self._next, None
            self._prepare_body(st)

    def _superseded(self, st: Staging) -> bool:
        return self.staging is not st

    def _check_current(self, st: Staging) -> None:
        if self._superseded(st):
            raise SwapError(409, "superseded by a newer prepare")

    def _prepare_body(self, st: Staging) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            self._check_current(st)  # before a byte is read
            opened = open_draft(
                st.path, st.version, st.sha256, self.current, self.fingerprint, self.pool
            )
            slot, checked = opened.slot, opened.checked
            try:
                t1 = time.perf_counter()
                self._check_current(st)
                if st.version is None:
                    check_newer(slot.version, self.highest, self.current.version)
                self._stage_into(slot, cancelled=lambda: self._superseded(st))
                t2 = time.perf_counter()
                self._check_current(st)
                opened.verify()  # the sha256, computed meanwhile
            except BaseException:
                checked.release()  # the slot is dropped: the buffer can be reused
                raise
            kernels = slot.kernels
            if kernels is None or any(
                checked.owns(t) for k in kernels.layers for t in k.tensors.values()
            ):
                checked.pool = None  # tensors still use the buffer: never reuse it
            checked.release()
            t3, c3 = time.perf_counter(), time.thread_time()
            st.timing = {
                "queued_ms": 1e3 * (t0 - st.started),
                "read_check_ms": 1e3 * (t1 - t0),
                "stage_ms": 1e3 * (t2 - t1),
                "prepare_ms": 1e3 * (t3 - t0),
                "prepare_cpu_ms": 1e3 * (c3 - c0),
                **{k: v for k, v in checked.timing.items() if k.endswith("_ms")},
                **(kernels.timing if kernels is not None else {}),
            }
            st.slot = slot
        except SwapError as e:
            st.error = e
        except Exception as e:
            log.exception("codraft: preparing draft %s failed", st.path)
            st.error = SwapError(500, f"preparing the draft failed: {type(e).__name__}: {e}")
        finally:
            st.done.set()

    def _stage_into(
        self,
        slot: DraftSlot,
        snapshot: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Give `slot` its kernel state (its checkpoint tensors are then dropped); on a drafter
        that does not allow staging, keep the tensors for vLLM's reload path. `cancelled` is
        asked before each tensor is staged (409 once it says so)."""
        drafter, target = drafter_model(self.runner), target_model(self.runner)
        try:
            if snapshot:
                slot.kernels = snapshot_live(drafter, target)
            else:
                weights = (
                    slot.weights if cancelled is None else _Cancellable(slot.weights, cancelled)
                )
                slot.kernels = stage_kernels(drafter, target, weights)
            slot.weights = {}
            if torch.cuda.is_available():
                # staged on this thread's stream; the engine reads them on its own stream,
                # which does not wait for this one: the copies must be done before commit
                torch.cuda.current_stream().synchronize()
        except (StageError, ImportError, AttributeError) as e:  # layout or vLLM internals
            log.warning("codraft: draft weights cannot be staged (%s): reload_weights is used", e)
            slot.kernels = None

    def staged(self) -> dict[str, Any]:
        """The staged draft: ticket, path, version, state (preparing/ready/failed), and its
        error or timing."""
        st = self.staging
        if st is None:
            raise SwapError(
                404,
                "no draft is staged: POST /v1/draft/prepare stages one (a commit uses it up)",
            )
        out: dict[str, Any] = {
            "ticket": st.ticket,
            "path": st.path,
            "version": st.slot.version if st.slot is not None else st.version,
            "state": st.state(),
            "elapsed_ms": 1e3 * (time.perf_counter() - st.started),
            "files_changed": file_identity(st.path) != st.identity,
        }
        if st.error is not None:
            out.update(status=st.error.status, error=str(st.error))
        if st.slot is not None:
            out.update(sha256=st.slot.sha256, timing_ms=st.timing)
        return {"ok": True, "staged": out}

    # ------------------------------------------------------------------ commit
    def swap(self, path: Any, version: Any, sha256: Any = None) -> dict[str, Any]:
        """Commit the staged draft if it is this checkpoint, else prepare it (see module doc)."""
        path, version, sha256 = check_load_args(path, version, sha256)
        st = self.staging
        if (
            st is not None
            and st.path == path
            and st.version in (None, version)
            and (st.sha256 is None or sha256 is None or st.sha256 == sha256)
            and file_identity(path) == st.identity
        ):
            st.want = {"version": version, "sha256": sha256}
            return {**self.commit(st.ticket), "prepared_ahead": True}
        return {**self.prepare(path, version, sha256), "prepared_ahead": False}

    def commit(self, ticket: Any) -> dict[str, Any]:
        st = self.staging
        if st is None or st.ticket != ticket:
            raise SwapError(
                409,
                f"ticket {ticket!r} is not the latest prepared draft (it was committed, failed "
                "or was superseded by a newer prepare): prepare again",
            )
        if not st.done.is_set():
            return {
                "ok": True,
                "ready": False,
                "ticket": ticket,
                "elapsed_ms": 1e3 * (time.perf_counter() - st.started),
            }
        if file_identity(st.path) != st.identity:  # rewritten since: what is there now
            log.info("codraft: %s changed since it was prepared; preparing it again", st.path)
            again = self.prepare(st.path, st.version, st.sha256)
            self.staging.want = st.want  # type: ignore[union-attr]
            return {**again, "restarted": True}
        self.staging = None
        if st.error is not None:
            raise st.error
        assert st.slot is not None
        # what a swap() asked for, against a draft prepared without it
        check_request(
            Path(st.path), st.slot.version, st.slot.sha256, st.want.get("version"),
            st.want.get("sha256"),
        )  # fmt: skip
        # a swap may have happened since the prepare
        check_newer(st.slot.version, self.highest, self.current.version)
        t0 = time.perf_counter()
        self.switch_to(st.slot)
        timing = {**st.timing, "install_ms": 1e3 * (time.perf_counter() - t0)}
        return {"ok": True, "ready": True, "timing_ms": timing}

    def load(self, path: Any, version: Any, sha256: Any = None) -> dict[str, Any]:
        """Prepare and commit inside one call (the engine waits for all of it)."""
        if version is None:
            raise SwapError(422, "version must be a non-negative integer, got None")
        st = self._new_staging(path, version, sha256)
        self._prepare_body(st)
        return self.commit(st.ticket)

    # ------------------------------------------------------------------ install
    def switch_to(self, slot: DraftSlot) -> None:
        """Install `slot`; the current draft becomes the previous one."""
        self._write(slot, restore=self.current)
        self.previous, self.current = self.current, slot
        self.highest = max(self.highest, slot.version)

    def adopt(self, slot: DraftSlot, previous: DraftSlot) -> None:
        """Make `slot` current without writing it (its weights are already live: a weight
        transfer wrote them), `previous` the one a rollback installs."""
        self.previous, self.current = previous, slot
        self.highest = max(self.highest, slot.version)

    def _write(self, slot: DraftSlot, restore: DraftSlot) -> None:
        try:
            self._write_one(slot)
        except Exception as e:
            log.exception("codraft: writing draft weights failed; restoring the serving draft")
            try:
                self._write_one(restore)
            except Exception as e2:
                raise SwapError(
                    500, f"writing draft weights failed ({e}) and restoring failed too ({e2})"
                ) from None
            raise SwapError(500, f"writing draft weights failed ({e}); old draft kept") from None

    def _write_one(self, slot: DraftSlot) -> None:
        if slot.kernels is not None:
            install(slot.kernels)
        else:
            write_draft_weights(self.runner, self.vllm_config, slot.weights)

    # ------------------------------------------------------------------ rollback
    def rollback(self) -> DraftSlot:
        """Install the previous draft again (one level is kept); returns the rolled-back one."""
        if self.previous is None:
            raise SwapError(
                409,
                f"no previous draft to roll back to (serving v{self.current.version}; one "
                "level is kept, and a rollback uses it up)",
            )
        prev, rolled = self.previous, self.current
        self._write(prev, restore=rolled)
        self.current, self.previous = replace(prev, loaded_at=utc_now()), None
        return rolled
