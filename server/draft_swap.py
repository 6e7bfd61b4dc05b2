"""Draft swaps in two phases: prepare off the engine loop, commit between two engine steps.

vLLM v1 runs every `collective_rpc` inside the engine core's busy loop (`EngineCoreProc.
_handle_client_request` calls the utility synchronously between two `step()`s; on TP > 1 the
workers run it in their own loop, in order with `execute_model`). So whatever an RPC does, the
engine does not step meanwhile, and an RPC can only start at a step boundary. Hence:

- `prepare(path, version, sha256)` (RPC `codraft_prepare_draft`) checks the arguments, refuses
  a version that is not newer (409) or a missing path (404), starts a background thread and
  returns a ticket at once. The thread reads, hashes and checks the checkpoint
  (`server.swap.prepare_draft`: the bytes hashed are the bytes installed) and builds the
  drafter's kernel-format weights from them (`server.draft_kernels.stage_kernels`) while the
  engine keeps stepping; hashlib, file reads and torch kernels release the GIL.
- `commit(ticket)` (RPC `codraft_commit_draft`) answers `ready: False` while the thread runs
  (the caller asks again), the thread's error (404/422/500: nothing changed) when it failed,
  409 for a ticket that is not the latest prepared one, and otherwise installs the staged
  weights (`install`: copy_ into the live storage + kernel attributes, ~ms) and makes the new
  draft current, the old one previous (kept for rollback with its own kernel state).
- `load(...)` (RPC `codraft_load_draft`) does both inside one RPC, as before.

Only the latest prepare is kept: a newer one supersedes it (its ticket then gets 409). If the
drafter's layout does not allow staging (`StageError`), the slot keeps its checkpoint tensors
and the commit falls back to vLLM's in-place reload (`write_draft_weights`), as before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from server.draft_kernels import StageError, install, snapshot_live, stage_kernels
from server.swap import DraftSlot, SwapError, prepare_draft, utc_now, write_draft_weights

log = logging.getLogger(__name__)


@dataclass
class Staging:
    """One prepared (or preparing) draft, named by its ticket."""

    ticket: str
    path: str
    version: int
    sha256: str | None
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    slot: DraftSlot | None = None
    error: SwapError | None = None
    timing: dict[str, float] = field(default_factory=dict)


def check_load_args(path: Any, version: Any, sha256: Any) -> tuple[str, int, str | None]:
    if not isinstance(path, str) or not path:
        raise SwapError(422, f"path must be a non-empty string, got {path!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SwapError(422, f"version must be a non-negative integer, got {version!r}")
    if sha256 is not None and not (isinstance(sha256, str) and len(sha256) == 64):
        raise SwapError(422, f"sha256 must be 64 hex digits or null, got {sha256!r}")
    return path, version, sha256


class DraftSwapper:
    """The serving draft, the one kept for rollback, and the one being prepared."""

    def __init__(self, runner: Any, vllm_config: Any, fingerprint: str | None, initial: DraftSlot):
        self.runner = runner
        self.vllm_config = vllm_config
        self.fingerprint = fingerprint
        self.current = initial
        self.previous: DraftSlot | None = None
        self.staging: Staging | None = None
        self._stage_into(initial, snapshot=True)

    # ------------------------------------------------------------------ prepare
    def _check_newer(self, version: int) -> None:
        if version <= self.current.version:
            raise SwapError(
                409,
                f"draft version {version} is not newer than the serving version "
                f"{self.current.version}",
            )

    def _new_staging(self, path: Any, version: Any, sha256: Any) -> Staging:
        path, version, sha256 = check_load_args(path, version, sha256)
        self._check_newer(version)
        if not os.path.exists(path):
            raise SwapError(404, f"draft checkpoint not found: {path} does not exist")
        staging = Staging(uuid.uuid4().hex, path, version, sha256)
        self.staging = staging  # supersedes an earlier one
        return staging

    def prepare(self, path: Any, version: Any, sha256: Any = None) -> dict[str, Any]:
        st = self._new_staging(path, version, sha256)
        threading.Thread(
            target=self._prepare_body, args=(st,), name="codraft-prepare", daemon=True
        ).start()
        return {"ok": True, "ticket": st.ticket, "version": st.version, "ready": False}

    def _prepare_body(self, st: Staging) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            slot = prepare_draft(st.path, st.version, st.sha256, self.current, self.fingerprint)
            t1 = time.perf_counter()
            self._stage_into(slot)
            t2, c2 = time.perf_counter(), time.thread_time()
            st.timing = {
                "queued_ms": 1e3 * (t0 - st.started),
                "read_check_ms": 1e3 * (t1 - t0),
                "stage_ms": 1e3 * (t2 - t1),
                "prepare_ms": 1e3 * (t2 - t0),
                "prepare_cpu_ms": 1e3 * (c2 - c0),
            }
            st.slot = slot
        except SwapError as e:
            st.error = e
        except Exception as e:
            log.exception("codraft: preparing draft v%d failed", st.version)
            st.error = SwapError(500, f"preparing the draft failed: {type(e).__name__}: {e}")
        finally:
            st.done.set()

    def _stage_into(self, slot: DraftSlot, snapshot: bool = False) -> None:
        """Give `slot` its kernel state (its checkpoint tensors are then dropped); on a drafter
        that does not allow staging, keep the tensors for vLLM's reload path."""
        drafter, target = self.runner.drafter.model, self.runner.model
        try:
            if snapshot:
                slot.kernels = snapshot_live(drafter, target)
            else:
                slot.kernels = stage_kernels(drafter, target, slot.weights)
            slot.weights = {}
        except (StageError, ImportError, AttributeError) as e:  # layout or vLLM internals
            log.warning("codraft: draft weights cannot be staged (%s): reload_weights is used", e)
            slot.kernels = None

    # ------------------------------------------------------------------ commit
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
        self.staging = None
        if st.error is not None:
            raise st.error
        assert st.slot is not None
        self._check_newer(st.slot.version)  # a swap may have happened since the prepare
        t0 = time.perf_counter()
        self.switch_to(st.slot)
        timing = {**st.timing, "install_ms": 1e3 * (time.perf_counter() - t0)}
        return {"ok": True, "ready": True, "timing_ms": timing}

    def load(self, path: Any, version: Any, sha256: Any = None) -> dict[str, Any]:
        """Prepare and commit inside one call (the engine waits for all of it)."""
        st = self._new_staging(path, version, sha256)
        self._prepare_body(st)
        return self.commit(st.ticket)

    # ------------------------------------------------------------------ install
    def switch_to(self, slot: DraftSlot) -> None:
        """Install `slot`; the current draft becomes the previous one."""
        self._write(slot, restore=self.current)
        self.previous, self.current = self.current, slot

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
