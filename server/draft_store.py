"""The server's own copies of the drafts it serves, holds for rollback or has committed.

A draft is posted by path, and the folder behind that path belongs to whoever wrote it: a
learner's checkpoint retention deletes its older checkpoints, a user tidies a folder. The server
must not depend on them: a restarted server resumes the draft its committed-draft record names,
and a caller (the demo, an evaluation) reads the serving draft's folder from `GET /v1/draft`.
So before a draft is prepared, the control API puts it in the store (`keep`) and hands the
engine the store's folder: `<work-dir>/drafts-<target key>/v<version>-<sha256 prefix>`, named
by what the checkpoint's codraft.json says it is. Its files are hard links to the posted ones
where the filesystem allows (checkpoints are written to a temporary folder and renamed, never
rewritten in place, so a link keeps the bytes that were checked), copies otherwise. Entries
are written to a temporary folder and renamed, like checkpoints. After every change of the
serving draft the store drops the entries nothing holds any more (`prune`): not the serving
draft, the previous one (a rollback's target), the staged one, or any entry of the
committed-draft record.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from pathlib import Path

from codraft.draft.checkpoint import META_NAME, DraftCheckpointError, read_meta

log = logging.getLogger(__name__)
TMP_PREFIX = ".tmp-"


class DraftStore:
    """Copies of drafts under `root` (see module doc)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def keep(self, path: str) -> str:
        """The store's folder for the draft at `path` (made now if need be); `path` itself when
        it is no draft folder with a codraft.json (the engine then says what is wrong), or when
        it already lies in the store."""
        src = Path(path)
        try:
            if src.parent.resolve() == self.root.resolve():
                return path
            meta = read_meta(src)
        except (DraftCheckpointError, OSError):  # missing, unreadable, a name too long
            return path
        name = f"v{meta.version}-{(meta.weights_sha256 or 'nosha')[:16]}"
        out = self.root / name
        if out.is_dir() and _same_files(src, out):
            return str(out)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for f in sorted(src.iterdir()):
                if f.is_file():
                    _link_or_copy(f, tmp / f.name)
            if out.exists():  # an entry of the same name with other files: the posted one wins
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return str(out)

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir())

    def prune(self, holding: set[str]) -> list[str]:
        """Remove the entries (and leftover temporary folders) not in `holding`; returns the
        removed ones."""
        held = {os.path.realpath(p) for p in holding if p}
        removed = []
        for entry in self.entries():
            if os.path.realpath(entry) in held:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
        if removed:
            log.info("draft store %s: removed %s", self.root, ", ".join(removed))
        return removed


def _same_files(a: Path, b: Path) -> bool:
    """Whether folder `b` holds the files of `a` (same names, sizes and codraft.json)."""
    try:
        fa = {f.name: f.stat().st_size for f in a.iterdir() if f.is_file()}
        fb = {f.name: f.stat().st_size for f in b.iterdir() if f.is_file()}
        return fa == fb and (a / META_NAME).read_bytes() == (b / META_NAME).read_bytes()
    except OSError:
        return False


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)
