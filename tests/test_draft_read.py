"""codraft.server.draft_read: a draft's weights read once, hashed in a thread, checked without a
copy.

No vLLM: the checks and their messages against codraft.draft.load_draft on the same broken
checkpoints, the tensors against safetensors' own reading, and the read buffer's reuse.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from codraft.draft.checkpoint import DraftCheckpointError, load_draft, sha256_file
from codraft.draft.init import write_new_draft
from codraft.server.draft_read import BufferPool, read_checked
from codraft.server.weights import load_checked


def _fix_sha(d: Path) -> None:
    meta = json.loads((d / "codraft.json").read_text())
    meta["weights_sha256"] = sha256_file(d / "model.safetensors")
    (d / "codraft.json").write_text(json.dumps(meta))


def _edit(d: Path, edit: Callable[[dict[str, torch.Tensor]], None], fix_sha: bool) -> None:
    w = d / "model.safetensors"
    tensors = load_file(str(w))
    edit(tensors)
    save_file(tensors, str(w), metadata={"format": "pt"})
    if fix_sha:
        _fix_sha(d)


def _truncate(d: Path) -> None:
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])


def _flip_byte(d: Path) -> None:
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))


def _narrow_fc(t: dict[str, torch.Tensor]) -> None:
    t["fc.weight"] = t["fc.weight"][:, :64].contiguous()


def _unsorted_d2t(t: dict[str, torch.Tensor]) -> None:
    t["d2t"][5] += 3


BROKEN: dict[str, Callable[[Path], None]] = {
    "truncated": _truncate,
    "flipped byte": _flip_byte,
    "wrong shape, stale sha256": lambda d: _edit(d, _narrow_fc, fix_sha=False),
    "wrong shape": lambda d: _edit(d, _narrow_fc, fix_sha=True),
    "d2t not increasing": lambda d: _edit(d, _unsorted_d2t, fix_sha=True),
    "no weights file": lambda d: (d / "model.safetensors").unlink(),
    "intact": lambda d: None,
}


@pytest.fixture(scope="module")
def good(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_new_draft(
        tmp_path_factory.mktemp("draft_read") / "good", tiny_llama_dir, draft_vocab_size=128
    )


def _outcome(read: Callable[[], object]) -> str:
    try:
        read()
    except DraftCheckpointError as e:
        return str(e)
    return "ok"


@pytest.mark.parametrize("case", list(BROKEN))
def test_checks_and_messages_are_load_drafts(case: str, good: Path, tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    shutil.copytree(good, d)
    BROKEN[case](d)
    pool = BufferPool()
    expected = _outcome(lambda: load_draft(d))
    assert _outcome(lambda: load_checked(d)) == expected
    assert _outcome(lambda: read_checked(d, None, pool).verify_sha()) == expected
    if case == "wrong shape, stale sha256":  # both wrong: the checksum is named, as before
        assert "sha256 mismatch" in expected
    assert (expected == "ok") == (case == "intact"), expected


def test_tensors_are_the_files_and_the_buffer_is_reused(
    good: Path, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    other = write_new_draft(tmp_path / "other", tiny_llama_dir, draft_vocab_size=128, seed=5)
    pool = BufferPool()
    first = read_checked(good, None, pool)
    assert first.verify_sha() == sha256_file(good / "model.safetensors")
    want = load_file(str(good / "model.safetensors"))
    assert sorted(first.tensors) == sorted(want)
    assert all(torch.equal(first.tensors[k], want[k]) for k in want)
    assert all(first.owns(t) for t in first.tensors.values() if t.numel())
    assert not first.owns(want["fc.weight"])
    buffer = first.buffer.data_ptr()
    first.release()
    assert first.tensors == {}
    second = read_checked(other, None, pool)
    assert second.buffer.data_ptr() == buffer, "the released buffer was not reused"
    assert second.verify_sha() == sha256_file(other / "model.safetensors")
    again = load_file(str(other / "model.safetensors"))
    assert not torch.equal(again["fc.weight"], want["fc.weight"])
    assert all(torch.equal(second.tensors[k], again[k]) for k in again)
    taken = read_checked(good, None, pool)  # the pool is empty while `second` holds its buffer
    assert taken.buffer.data_ptr() != second.buffer.data_ptr()
    second.release()
    taken.release()  # released before verify_sha: the hashing thread is stopped


def test_timing_names_the_parts(good: Path) -> None:
    checked = read_checked(good, None, BufferPool())
    checked.verify_sha()
    assert {"read_ms", "check_ms", "hash_ms", "hash_wait_ms"} <= set(checked.timing)
    assert checked.timing["bytes"] == (good / "model.safetensors").stat().st_size
