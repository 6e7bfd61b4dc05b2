"""The stages of a GPU attempt, each with its time or its error, for the attempt's report: a run
that fails says where (import, engine start, a kernel, NCCL, memory). With `path`, the report is
written when a stage starts (`next` names it) and when it ends, so a process killed inside a
stage that cannot be interrupted (NCCL's init) leaves what ran and where it stopped.
Standard library only: the SGLang venv, which holds no codraft, imports it too."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any


class Stages:
    def __init__(self, report: dict, tag: str, path: Path | None = None) -> None:
        self.report, self.tag, self.path = report, tag, path
        report.setdefault("stages", {})

    def run(self, name: str, fn: Any) -> Any:
        """fn()'s value, or None with the error (and its traceback) recorded."""
        self.report["next"] = name
        self.save()
        t0 = time.perf_counter()
        entry: dict[str, Any] = {}
        value = None
        try:
            value = fn()
        except Exception as e:  # recorded: the report says what broke and how
            entry.update(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-4000:])
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        self.report["stages"][name] = entry
        self.report.pop("next")
        self.save()
        print(f"[{self.tag}] {name}: {entry.get('error', 'ok')} ({entry['seconds']} s)", flush=True)
        return value

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.report, indent=2, default=str))
