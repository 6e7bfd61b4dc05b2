"""Learner checkpoints: a draft in EAGLE-3 format plus the trainer's state, written atomically.

Layout under the output folder:

    ckpt-00000120/            one training step's checkpoint (written as a temp dir, renamed)
        draft/                the EAGLE-3 checkpoint stock vLLM loads (config.json,
                              model.safetensors, codraft.json)
        trainer.pt            optimizer, scheduler, step, RNG (torch.save; read weights_only)
        state.json            step, draft version, data position, counters
    latest                    name of the newest complete checkpoint (atomically replaced)

A reader never sees half a checkpoint: every directory appears by rename, and `latest` is updated
only after its target is complete. Old checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from codraft.atomic import atomic_write_bytes, atomic_write_dir, remove_stale_temps
from codraft.draft.checkpoint import DraftMeta, save_draft
from codraft.draft.model import Eagle3Draft

LATEST = "latest"
PREFIX = "ckpt-"


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
            (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        atomic_write_bytes(self.root / LATEST, final.name.encode())
        self._prune()
        return final

    def latest(self) -> Path | None:
        try:
            name = (self.root / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        path = self.root / name
        return path if (path / "state.json").is_file() else None

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
