"""One draft preparer at a time (codraft.server.draft_swap): a prepare superseded before the
worker reaches it is never read, and one being staged stops between two tensors.

Real checkpoints on disk, read and checked by the real `open_draft`; the drafter is a stand-in
(`stage_kernels` and the model lookups are replaced), since the order of the reads, not the
kernels, is what is checked here. The staging of a swap into a live engine is in
test_server_api.py and test_server_engine.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import codraft.server.draft_swap as draft_swap
from codraft.draft.init import write_new_draft
from codraft.server.draft_swap import DraftSwapper
from codraft.server.weights import read_initial_draft


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        v: write_new_draft(root / f"v{v}", tiny_llama_dir, version=v, draft_vocab_size=64)
        for v in range(5)
    }


class Recorder:
    """Stands in for the drafter's staging and records which checkpoints were read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[str] = []
        self.gates: dict[str, threading.Event] = {}  # path -> released when set
        self.staged: list[int] = []  # tensors handed on, per staging
        self.during_stage: Any = None  # called after the first tensor of a staging
        real_open = draft_swap.open_draft

        def open_draft(path: str, *args: Any, **kwargs: Any) -> Any:
            self.reads.append(Path(path).name)
            gate = self.gates.get(Path(path).name)
            if gate is not None:
                assert gate.wait(60), "the test never released this read"
            return real_open(path, *args, **kwargs)

        def stage_kernels(drafter: Any, target: Any, weights: dict) -> Any:
            self.staged.append(0)
            for _ in weights.items():  # how the drafter's load_weights takes them
                self.staged[-1] += 1
                if self.during_stage is not None:
                    self.during_stage()
            return SimpleNamespace(layers=[], timing={}, derived=[])

        monkeypatch.setattr(draft_swap, "open_draft", open_draft)
        monkeypatch.setattr(draft_swap, "stage_kernels", stage_kernels)
        monkeypatch.setattr(draft_swap, "snapshot_live", lambda d, t: None)
        monkeypatch.setattr(draft_swap, "drafter_model", lambda runner: None)
        monkeypatch.setattr(draft_swap, "target_model", lambda runner: None)


def _swapper(drafts: dict[int, Path]) -> DraftSwapper:
    return DraftSwapper(None, None, None, read_initial_draft(str(drafts[0])))


def _wait(swapper: DraftSwapper, ticket: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = swapper.staging
        if st is not None and st.ticket == ticket and st.done.is_set():
            return swapper.staged()["staged"]
        time.sleep(0.01)
    raise TimeoutError(f"ticket {ticket} not prepared within 60 s")


def test_a_prepare_superseded_before_its_read_is_never_read(
    drafts: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(monkeypatch)
    swapper = _swapper(drafts)
    rec.gates["v1"] = threading.Event()
    first = swapper.prepare(str(drafts[1]), 1)  # the worker takes it and waits in its read
    deadline = time.monotonic() + 30
    while rec.reads != ["v1"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rec.reads == ["v1"]
    skipped = [swapper.prepare(str(drafts[v]), v) for v in (2, 3)]  # queued behind v1
    last = swapper.prepare(str(drafts[4]), 4)
    rec.gates["v1"].set()
    staged = _wait(swapper, last["ticket"])
    assert staged["state"] == "ready" and staged["version"] == 4, staged
    assert rec.reads == ["v1", "v4"], f"superseded drafts were read: {rec.reads}"
    for reply in (first, *skipped):
        with pytest.raises(draft_swap.SwapError) as err:
            swapper.commit(reply["ticket"])
        assert err.value.status == 409
    assert swapper.commit(last["ticket"])["ready"]
    assert swapper.current.version == 4


def test_a_prepare_superseded_while_staged_stops_between_tensors(
    drafts: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(monkeypatch)
    swapper = _swapper(drafts)
    newer: dict[str, Any] = {}
    stopped: list[Any] = []

    def supersede() -> None:  # a newer prepare arrives once the first tensor is staged
        rec.during_stage = None
        stopped.append(swapper.staging)
        newer.update(swapper.prepare(str(drafts[2]), 2))

    rec.during_stage = supersede
    first = swapper.prepare(str(drafts[1]), 1)
    deadline = time.monotonic() + 60
    while "ticket" not in newer and time.monotonic() < deadline:
        time.sleep(0.01)
    staged = _wait(swapper, newer["ticket"])
    assert staged["state"] == "ready" and staged["version"] == 2, staged
    assert rec.reads == ["v1", "v2"]
    n_tensors = len(read_initial_draft(str(drafts[2])).weights)
    assert n_tensors > 2
    # the first staging handed on one tensor and stopped; the second one staged them all
    assert rec.staged == [1, n_tensors], rec.staged
    (st,) = stopped
    assert st.ticket == first["ticket"] and st.error is not None
    assert st.error.status == 409 and "while it was staged" in str(st.error)
    with pytest.raises(draft_swap.SwapError, match="not the latest prepared"):
        swapper.commit(first["ticket"])


def test_a_thread_per_prepare_reads_superseded_drafts(
    drafts: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: what prepare did before (a thread per prepare, supersession checked only
    once the draft was read). The reads the first test forbids then happen."""
    rec = Recorder(monkeypatch)
    swapper = _swapper(drafts)

    def old_prepare(path: Any, version: Any = None, sha256: Any = None) -> dict[str, Any]:
        st = swapper._new_staging(path, version, sha256)
        threading.Thread(target=swapper._prepare_body, args=(st,), daemon=True).start()
        return {"ok": True, "ticket": st.ticket, "version": st.version, "ready": False}

    monkeypatch.setattr(swapper, "prepare", old_prepare)
    monkeypatch.setattr(swapper, "_check_current", lambda st: None)
    for v in (1, 2, 3):
        rec.gates[f"v{v}"] = threading.Event()
    replies = [swapper.prepare(str(drafts[v]), v) for v in (1, 2, 3)]
    deadline = time.monotonic() + 30
    while len(rec.reads) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for gate in rec.gates.values():
        gate.set()
    _wait(swapper, replies[-1]["ticket"])
    assert sorted(rec.reads) == ["v1", "v2", "v3"]  # v1 and v2 read though superseded
