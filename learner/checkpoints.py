"""Learner checkpoints: a draft in EAGLE-3 format plus the trainer's state, written atomically.

Layout under the output folder:

    ckpt-00000120/            one training step's checkpoint (written as a temp dir, renamed)
        draft/                the EAGLE-3 checkpoint stock vLLM loads (config.json,
                              model.safetensors, codraft.json)
        trainer.pt            optimizer, scheduler, step, RNG (torch.save; read weights_only)
        state.json            step, draft version, data position, counters, trainer.pt's sha256
    latest                    name of the newest complete checkpoint (atomically replaced)

A reader never sees half a checkpoint: every directory appears by rename, and `latest` is updated
only after its target is complete. Old checkpoints beyond `keep` are removed.

What a resume takes is the newest checkpoint that is whole (`newest_good`): its state.json
readable, trainer.pt and the draft's weights hashing to what was recorded, the draft's files as
check_draft wants them. One that a disk, a copy or a person damaged after it was written is
skipped with a warning naming what is wrong, and the one before it is taken.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from codraft.atomic import atomic_write_bytes, atomic_write_dir, remove_stale_temps
from codraft.draft.checkpoint import (
    DraftCheckpointError,
    DraftMeta,
    check_draft,
    save_draft,
    sha256_file,
)
from codraft.draft.model import Eagle3Draft

log = logging.getLogger(__name__)
LATEST = "latest"
PREFIX = "ckpt-"


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with checkpoint folder `path`, or None when it is whole."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"state.json unreadable: {e}"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return "state.json records no step"
    want = state.get("trainer_sha256")
    try:
        got = sha256_file(path / "trainer.pt")
    except OSError as e:
        return f"trainer.pt unreadable: {e}"
    if want is not None and got != want:
        return f"trainer.pt hashes to {got}, state.json records {want}"
    try:
        check_draft(path / "draft")
    except DraftCheckpointError as e:
        return str(e)
    return None


def newest_good(root: str | Path) -> Path | None:
    """The newest whole checkpoint under `root` (by step; see the module doc), or None."""
    for path in sorted((p for p in Path(root).glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged and skipped: %s", path, problem)
    return None


@dataclass
class Resumed:
    path: Path
    state: dict[str, Any]
    trainer: dict[str, Any]


class CheckpointDir:
    def __init__(self, root: str | Path, keep: int = 3) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        remove_stale_temps(self.root)

    def save(
        self, step: int, draft: Eagle3Draft, meta: DraftMeta, trainer: dict, state: dict
    ) -> Path:
        final = self.root / f"{PREFIX}{step:08d}"
        with atomic_write_dir(final, overwrite=True) as tmp:
            save_draft(tmp / "draft", draft, meta)
            torch.save(trainer, tmp / "trainer.pt")
            state = {**state, "step": step, "trainer_sha256": sha256_file(tmp / "trainer.pt")}
            (tmp / "state.json").write_text(json.dumps(state, indent=2))
        atomic_write_bytes(self.root / LATEST, final.name.encode())
        self._prune()
        return final

    def latest(self) -> Path | None:
        """The newest whole checkpoint (`newest_good`)."""
        return newest_good(self.root)

    def load_latest(self, device: str | torch.device = "cpu") -> Resumed | None:
        path = self.latest()
        if path is None:
            return None
        state = json.loads((path / "state.json").read_text())
        trainer = torch.load(path / "trainer.pt", map_location=device, weights_only=True)
        return Resumed(path, state, trainer)

    def _prune(self) -> None:
        ckpts = sorted(p for p in self.root.glob(f"{PREFIX}*") if p.is_dir())
        for old in ckpts[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
