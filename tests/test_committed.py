"""The committed-draft record (codraft.server.committed): which draft a restarted server takes.

The restart itself (SIGKILL mid-swap, the same command again) runs on a real server in
test_server_api.py; here each way a record can be unusable, on real checkpoint folders."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from codraft.draft.checkpoint import read_meta
from codraft.draft.init import write_new_draft
from codraft.server.committed import EARLIER, choose_draft, record_path, write_record


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        v: write_new_draft(root / f"v{v}", tiny_llama_dir, version=v, draft_vocab_size=64)
        for v in (0, 3, 5)
    }


def _record(record: Path, draft: Path, **changes) -> Path:
    meta = read_meta(draft)
    info = {"version": meta.version, "sha256": meta.weights_sha256, "path": str(draft)}
    write_record(record, {**info, "loaded_at": "t", **changes})
    return record


def test_the_newer_committed_draft_wins(drafts, tmp_path: Path, caplog) -> None:
    rec = _record(tmp_path / "r.json", drafts[5])
    with caplog.at_level(logging.WARNING, logger="codraft.serve"):
        assert choose_draft(rec, drafts[0]) == drafts[5].resolve()
    assert "committed before it stopped" in caplog.text
    assert choose_draft(rec, drafts[5]) == drafts[5]  # the same draft: nothing to say


def test_a_newer_draft_on_the_command_line_wins(drafts, tmp_path: Path) -> None:
    assert choose_draft(_record(tmp_path / "r.json", drafts[3]), drafts[5]) == drafts[5]


@pytest.mark.parametrize("broken", ["no record", "torn", "gone", "other sha", "other version"])
def test_an_unusable_record_is_ignored(broken: str, drafts, tmp_path: Path, caplog) -> None:
    rec = tmp_path / "r.json"
    if broken == "torn":
        rec.write_text('{"version": 5, "pa')
    elif broken == "gone":
        _record(rec, drafts[5], path=str(tmp_path / "deleted"))
    elif broken == "other sha":
        _record(rec, drafts[5], sha256="0" * 64)
    elif broken == "other version":
        _record(rec, drafts[5], version=9)
    with caplog.at_level(logging.WARNING, logger="codraft.serve"):
        assert choose_draft(rec, drafts[0]) == drafts[0]
    if broken != "no record":
        assert "ignoring the committed-draft record" in caplog.text


def test_one_record_per_target(tmp_path: Path) -> None:
    a, b = record_path(tmp_path, Path("/models/a")), record_path(tmp_path, Path("/models/b"))
    assert a != b and a.parent == b.parent == tmp_path
    assert record_path(tmp_path, Path("/models/a")) == a


def test_the_record_is_plain_json(drafts, tmp_path: Path) -> None:
    rec = _record(tmp_path / "r.json", drafts[3])
    assert set(json.loads(rec.read_text())) == {"version", "sha256", "path", "loaded_at", "earlier"}


def test_a_restart_falls_back_to_the_newest_commit_that_still_checks_out(
    drafts, tmp_path: Path, caplog
) -> None:
    """The newest commit's folder rewritten under the server (a learner that trained the same
    step again): the commit before it serves, not --draft."""
    rec = tmp_path / "r.json"
    _record(rec, drafts[3])
    copy = tmp_path / "v5"
    shutil.copytree(drafts[5], copy)
    _record(rec, copy)
    assert [e["version"] for e in json.loads(rec.read_text())["earlier"]] == [3]
    meta = json.loads((copy / "codraft.json").read_text())
    (copy / "codraft.json").write_text(json.dumps({**meta, "version": 6}))  # rewritten: v6 now
    with caplog.at_level(logging.WARNING, logger="codraft.serve"):
        assert choose_draft(rec, drafts[0]) == drafts[3].resolve()
    assert "is now v6" in caplog.text and "still checks out" in caplog.text
    # a rollback from v5 to v3 commits v3 last: with v3's folder gone, v5 (rolled back from)
    # is not served again, and nothing earlier is left
    rec2 = tmp_path / "r2.json"
    gone = tmp_path / "v3-gone"
    shutil.copytree(drafts[3], gone)
    _record(rec2, drafts[5])
    _record(rec2, gone)
    shutil.rmtree(gone)
    assert choose_draft(rec2, drafts[0]) == drafts[0]
    for _ in range(12):  # the record keeps a bounded history
        _record(rec, drafts[3])
        _record(rec, copy, version=5)
    assert len(json.loads(rec.read_text())["earlier"]) <= EARLIER


def test_a_restart_keeps_its_drafter_kind(drafts, tiny_llama_dir: Path, tmp_path: Path, caplog):
    """A server started with a DFlash draft never resumes an EAGLE-3 commit (vLLM's method
    follows the draft), and the other way round; a commit of its own kind still wins."""
    dflash = {
        v: write_new_draft(
            tmp_path / f"dflash{v}",
            tiny_llama_dir,
            version=v,
            drafter="dflash",
            tap_layers=(1, 2, 4),
        )  # fmt: skip
        for v in (0, 4)
    }
    rec = _record(tmp_path / "r.json", dflash[4])
    _record(rec, drafts[5])  # the newest commit: EAGLE-3 v5, then DFlash v4
    with caplog.at_level(logging.WARNING, logger="codraft.serve"):
        assert choose_draft(rec, dflash[0]) == dflash[4].resolve()
    assert "is a draft of kind eagle3, the server starts one of kind dflash" in caplog.text
    only_dflash = _record(tmp_path / "r2.json", dflash[4])
    assert choose_draft(only_dflash, drafts[0]) == drafts[0]


# ------------------------------------------------------------------------- the draft store
def test_the_store_keeps_a_draft_its_folder_loses(drafts, tmp_path: Path) -> None:
    """The server's copy outlives the posted folder (a learner's retention deleting it), checks
    out as the same draft, and a record naming it resumes it; a prune keeps what is held."""
    from codraft.draft.checkpoint import check_draft
    from codraft.server.committed import recorded_paths
    from codraft.server.draft_store import DraftStore

    posted = {v: shutil.copytree(p, tmp_path / "learner" / f"ckpt-{v}") for v, p in drafts.items()}
    store = DraftStore(tmp_path / "work" / "drafts-x")
    kept = {v: store.keep(str(p)) for v, p in posted.items()}
    assert store.keep(str(posted[5])) == kept[5]  # the same draft: the same entry
    assert store.keep(kept[5]) == kept[5]  # a folder of the store is its own copy
    assert store.keep(str(tmp_path / "missing")) == str(tmp_path / "missing")  # the engine's 404
    record = _record(record_path(tmp_path / "work", Path("m")), Path(kept[3]))
    shutil.rmtree(tmp_path / "learner")
    for v in (0, 3, 5):
        cfg, meta = check_draft(kept[v])
        assert meta.version == v and meta.weights_sha256 == read_meta(drafts[v]).weights_sha256
    assert choose_draft(record, drafts[0]) == Path(kept[3]).resolve()
    removed = store.prune(recorded_paths(record) | {kept[5]})
    assert removed == [kept[0]] and sorted(map(str, store.entries())) == sorted([kept[3], kept[5]])


def test_a_store_entry_is_whole_or_absent(drafts, tmp_path: Path, monkeypatch) -> None:
    """Planted from here: the copy fails half-way. Nothing of it is left under the entry's
    name, and the next keep makes it whole."""
    from codraft.server import draft_store
    from codraft.server.draft_store import DraftStore

    store = DraftStore(tmp_path / "store")
    real = draft_store._link_or_copy
    calls = []

    def fail_second(src: Path, dst: Path) -> None:
        calls.append(src.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(draft_store, "_link_or_copy", fail_second)
    with pytest.raises(OSError):
        store.keep(str(drafts[3]))
    assert list((tmp_path / "store").iterdir()) == []
    monkeypatch.setattr(draft_store, "_link_or_copy", real)
    kept = store.keep(str(drafts[3]))
    assert sorted(p.name for p in Path(kept).iterdir()) == sorted(
        p.name for p in drafts[3].iterdir()
    )


# ------------------------------------------------------------------------------ failed record
class _Engine:
    """Answers the control API's RPCs like an engine with drafts v0 (serving) and v5."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current = {"version": 0, "sha256": "0" * 64, "path": "/d0", "loaded_at": "t"}

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None) -> list:
        self.calls.append(method)
        if method == "codraft_load_draft":
            new = {**self.current, "version": 5, "sha256": "5" * 64, "path": "/d5"}
            self.previous, self.current = self.current, new
            return [{"ok": True, "ready": True, "draft": self.current}]
        if method == "codraft_rollback_draft":
            rolled, self.current = self.current, self.previous
            return [{"ok": True, "draft": self.current, "rolled_back_from": rolled["version"]}]
        return [{"ok": True, "draft": self.current, "policy": {"version": 0}}]


def _control(record: Path):
    from codraft.server.api import ControlSettings, EngineControl

    engine = _Engine()
    control = EngineControl(engine, ControlSettings(committed_file=str(record)))
    control.draft_version = 0
    return engine, control


def test_a_swap_whose_record_cannot_be_written_fails_and_the_engine_goes_back(
    tmp_path: Path,
) -> None:
    import asyncio

    from codraft.server.auth import ControlError

    record = tmp_path / "rec.json"
    record.mkdir()  # a real failure of the atomic replace
    engine, control = _control(record)
    with pytest.raises(ControlError) as err:
        asyncio.run(control.swap("codraft_load_draft", path="/d5", version=5))
    assert err.value.status == 500
    assert "could not be recorded" in err.value.message and "rolled back to v0" in err.value.message
    assert engine.calls == ["codraft_load_draft", "codraft_rollback_draft"]
    assert control.versions()[0] == 0 and engine.current["version"] == 0
    record.rmdir()
    asyncio.run(control.swap("codraft_load_draft", path="/d5", version=5))
    assert json.loads(record.read_text())["version"] == 5


def test_an_unrecorded_rollback_is_reported_not_undone(tmp_path: Path) -> None:
    import asyncio

    from codraft.server.auth import ControlError

    record = tmp_path / "rec.json"
    engine, control = _control(record)
    asyncio.run(control.swap("codraft_load_draft", path="/d5", version=5))
    record.unlink()
    record.mkdir()
    with pytest.raises(ControlError) as err:
        asyncio.run(control.swap("codraft_rollback_draft", reason="test"))
    assert err.value.status == 500 and "a restart would serve" in err.value.message
    assert engine.calls[-1] == "codraft_rollback_draft" and engine.current["version"] == 0
