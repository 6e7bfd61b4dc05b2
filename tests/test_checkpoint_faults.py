"""Learner checkpoints under faults: a damaged newest checkpoint is skipped on resume (the one
before it is taken, and training ends where an uninterrupted run ends), and a write that hits a
full disk leaves no torn checkpoint, keeps the previous one the newest, and is reported.

The full disk is a real one: a tmpfs mounted just large enough for one checkpoint (the test is
skipped where this process may not mount)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_trainer import _args, _write_taps

import codraft.learner.checkpoints as checkpoints
from codraft.draft.checkpoint import load_draft
from codraft.learner.checkpoints import checkpoint_problem, newest_good
from codraft.learner.offline import train_from_dir
from codraft.learner.online.daemon import OnlineLearner
from codraft.learner.online.metrics import LearnerMetrics
from codraft.learner.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def taps(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_taps(tiny_llama_dir, tmp_path_factory.mktemp("taps"))


@pytest.fixture(scope="module")
def straight(tiny_llama_dir: Path, taps: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of 9 steps: the draft every resume below must end at."""
    out = tmp_path_factory.mktemp("straight")
    return Path(train_from_dir(_args(taps, tiny_llama_dir, out, steps=9))["draft"])


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x55
    path.write_bytes(bytes(data))


DAMAGE = {
    "trainer.pt flipped": (lambda c: _flip(c / "trainer.pt"), "trainer.pt hashes to"),
    "trainer.pt truncated": (
        lambda c: (c / "trainer.pt").write_bytes((c / "trainer.pt").read_bytes()[:1000]),
        "trainer.pt hashes to",
    ),
    "draft weights flipped": (
        lambda c: _flip(c / "draft" / "model.safetensors", 0.9),
        "sha256 mismatch",
    ),
    "draft config gone": (lambda c: (c / "draft" / "config.json").unlink(), "missing file"),
    "state.json torn": (lambda c: (c / "state.json").write_text('{"step": '), "unreadable"),
}


def _same(a: Path, b: Path) -> None:
    wa, _ = load_draft(a)
    wb, _ = load_draft(b)
    for (name, x), (_, y) in zip(wa.state_dict().items(), wb.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=f"{name} differs")


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped(
    damage: str, tiny_llama_dir: Path, taps: Path, straight: Path, tmp_path: Path, caplog
) -> None:
    out = tmp_path / "run"
    train_from_dir(_args(taps, tiny_llama_dir, out, steps=6))  # checkpoints at steps 3 and 6
    newest = out / "ckpt-00000006"
    assert newest_good(out) == newest and checkpoint_problem(newest) is None
    hurt, message = DAMAGE[damage]
    hurt(newest)
    assert message in checkpoint_problem(newest)
    assert newest_good(out) == out / "ckpt-00000003"
    with caplog.at_level(logging.WARNING, logger="codraft.learner.checkpoints"):
        resumed = train_from_dir(_args(taps, tiny_llama_dir, out, steps=9))
    assert any("ckpt-00000006 is damaged and skipped" in r.message for r in caplog.records)
    assert resumed["steps"] == 9
    _same(Path(resumed["draft"]), straight)  # resumed at step 3 with its data position


def test_without_the_check_a_damaged_checkpoint_breaks_the_resume(
    tiny_llama_dir: Path, taps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: every checkpoint passes. The truncated trainer.pt is then loaded, and the
    resume fails: what the test above sees is the check's doing."""
    out = tmp_path / "run"
    train_from_dir(_args(taps, tiny_llama_dir, out, steps=6))
    DAMAGE["trainer.pt truncated"][0](out / "ckpt-00000006")
    monkeypatch.setattr(checkpoints, "checkpoint_problem", lambda path: None)
    with pytest.raises(RuntimeError):
        train_from_dir(_args(taps, tiny_llama_dir, out, steps=9))


# ------------------------------------------------------------------------------ full disk
@pytest.fixture
def small_disk(tmp_path: Path):
    """A mount point for a tmpfs of the size asked for; unmounted afterwards."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_full_disk_leaves_no_torn_checkpoint_and_training_goes_on(
    tiny_llama_dir: Path, tmp_path: Path, small_disk, caplog
) -> None:
    cfg = TrainConfig(draft_vocab_size=64, device="cpu", seed=0)
    probe = Trainer(tiny_llama_dir, tmp_path / "probe", cfg)
    size = _checkpoint_bytes(probe.save())
    disk = small_disk((3 * size // 4096 + 1) * 4096)
    trainer = Trainer(tiny_llama_dir, disk / "out", cfg)
    first = trainer.save()
    filler = disk / "filler"  # what else fills the disk: half a checkpoint's room is left
    filler.write_bytes(b"\0" * (shutil.disk_usage(disk).free - size // 2))
    assert trainer.draft_version == 1
    trainer.step_count = 5
    # The learner's checkpoint call (OnlineLearner._checkpoint) on a stand-in for the daemon:
    # only the trainer, the metrics and the output folder are involved.
    daemon = SimpleNamespace(
        trainer=trainer, metrics=LearnerMetrics(), cfg=SimpleNamespace(out=disk / "out"),
        _saved_step=0,
    )  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="codraft.learner.online.daemon"):
        got = OnlineLearner._checkpoint(daemon)  # type: ignore[arg-type]
    assert got is None
    assert trainer.draft_version == 1, "a failed checkpoint must not use up a version"
    assert daemon.metrics.checkpoint_failures._value.get() == 1
    (record,) = [r for r in caplog.records if "not written" in r.message]
    assert "checkpoint of step 5 not written" in record.message, record.message
    assert "bytes free" in record.message and str(first) in record.message
    leftovers = sorted(p.name for p in (disk / "out").iterdir())
    assert leftovers == [first.name, "latest"], leftovers  # no temp dir, no torn ckpt-00000005
    assert newest_good(disk / "out") == first
    assert (disk / "out" / "latest").read_text() == first.name
    # Training goes on; once there is room again, the next checkpoint takes version 2.
    filler.unlink()
    trainer.step_count = 6
    again = OnlineLearner._checkpoint(daemon)  # type: ignore[arg-type]
    assert again is not None and trainer.draft_version == 2
    assert newest_good(disk / "out") == again and daemon._saved_step == 6


# ------------------------------------------------------------------------------ kill -9
# A child writes a checkpoint over an existing one and SIGKILLs itself just before its i-th
# rename, replace or tree removal (the steps of an overwrite, counted from the test side by
# wrapping os.rename, os.replace and shutil.rmtree); with i past the last step it finishes.
# The next start's sweep must then find the old checkpoint or the new one, whole.
_CRASH_CHILD = r"""
import json, os, shutil, signal, sys
from pathlib import Path

import torch

from codraft.draft.checkpoint import DraftMeta, save_draft
from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.learner.checkpoints import CheckpointDir

kind, root, seed, crash_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = DraftConfig(
    hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=100, draft_vocab_size=100, rms_norm_eps=1e-5, rope_theta=10000.0,
    max_position_embeddings=256, target_hidden_size=32, tap_layers=(1, 3, 5), dtype="float32",
)
torch.manual_seed(seed)
draft = Eagle3Draft(cfg)
ckpts = CheckpointDir(root) if kind == "learner" else None  # the start's sweep comes first
calls = {"n": 0}

def counted(fn):
    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return wrapper

if crash_at >= 0:
    os.rename = counted(os.rename)
    os.replace = counted(os.replace)
    shutil.rmtree = counted(shutil.rmtree)
meta = DraftMeta(version=seed)
if kind == "learner":
    ckpts.save(5, draft, meta, {"seed": seed}, {"seed": seed})
else:
    save_draft(root / "draft", draft, meta, overwrite=True)
print(json.dumps({"steps": calls["n"]}))
"""


def _crash_write(kind: str, root: Path, seed: int, crash_at: int) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, kind, str(root), str(seed), str(crash_at)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _surviving_version(kind: str, root: Path) -> int | None:
    """What the next start finds after its sweep: the version of the whole checkpoint, or None
    when there is none."""
    from codraft.atomic import remove_stale_temps
    from codraft.draft.checkpoint import DraftCheckpointError, check_draft
    from codraft.learner.checkpoints import CheckpointDir

    if kind == "learner":
        found = CheckpointDir(root).latest()  # its constructor sweeps
        if found is None:
            return None
        assert found.name == "ckpt-00000005", found
        return check_draft(found / "draft")[1].version
    remove_stale_temps(root)
    try:
        return check_draft(root / "draft")[1].version
    except DraftCheckpointError:
        return None


def _crash_everywhere(kind: str, tmp_path: Path) -> dict[int, int | None]:
    """Crash point -> the version found after the sweep (1 old, 2 new)."""
    base = tmp_path / "base"
    done = _crash_write(kind, base, 1, -1)  # the old checkpoint, written whole
    assert done.returncode == 0, done.stderr
    shutil.copytree(base, tmp_path / "count")
    counted = _crash_write(kind, tmp_path / "count", 2, 0)  # counts the steps of an overwrite
    assert counted.returncode == 0, counted.stderr
    steps = json.loads(counted.stdout)["steps"]
    assert steps >= 3, f"an overwrite takes 3 renames or removals at least, counted {steps}"
    found: dict[int, int | None] = {}
    for i in range(1, steps + 2):
        root = tmp_path / f"crash{i}"
        shutil.copytree(base, root)
        run = _crash_write(kind, root, 2, i)
        killed = run.returncode == -9
        assert killed == (i <= steps), (i, run.returncode, run.stderr[-2000:])
        found[i] = _surviving_version(kind, root)
    return found


@pytest.mark.parametrize("kind", ["learner", "draft"])
def test_a_kill_at_any_step_of_an_overwrite_leaves_old_or_new(kind: str, tmp_path: Path) -> None:
    found = _crash_everywhere(kind, tmp_path)
    assert all(v in (1, 2) for v in found.values()), f"crash point -> version found: {found}"
    assert found[max(found)] == 2  # the write that finished
    assert 1 in found.values()  # and some crash points do leave the old one


def test_a_sweep_that_removes_the_aside_copy_loses_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: the sweep removes an overwrite's aside copy even when its target is
    missing (what it did before). A crash between the two renames then leaves neither
    checkpoint: the test above would see it."""
    import codraft.atomic as atomic

    monkeypatch.setattr(atomic, "restore_aside", lambda final: None)
    found = _crash_everywhere("draft", tmp_path)
    assert None in found.values(), found
