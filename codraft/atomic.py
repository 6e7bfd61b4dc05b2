"""Atomic writes: a reader sees the old state or the complete new one, never a partial one.

Files are written to a temporary name in the same directory (same filesystem), flushed and
fsync'ed, then renamed into place; the parent directory is fsync'ed so the rename survives a
crash. A process that dies mid-write leaves at most a hidden `.<name>.tmp-*` entry next to the
target, which `remove_stale_temps` clears.

A directory overwrite takes three steps: the old directory is renamed aside
(`.<name>.trash-*`), the new one renamed in, the aside copy removed. A crash between the first
two leaves the target missing and the old copy aside: the aside copy is then the only whole one,
and the sweep (`remove_stale_temps`, or the next `atomic_write_dir` of that target) renames it
back instead of removing it. An aside copy is removed only while its target exists. So after
a crash at any point and the sweep, the target holds the old directory or the new one, never
neither.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_TAG = ".tmp-"
TRASH_TAG = ".trash-"


def fsync_dir(path: Path) -> None:
    """fsync a directory (so a rename in it is durable); a no-op where that is unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _hidden_sibling(final: Path, tag: str) -> Path:
    return final.parent / f".{final.name}{tag}{uuid.uuid4().hex[:12]}"


def _target_of(entry: Path, tag: str) -> Path | None:
    """The target `_hidden_sibling(target, tag)` named `entry` was made for, or None."""
    name = entry.name
    head, found, suffix = name.rpartition(tag)
    if not found or not head.startswith(".") or len(head) < 2 or len(suffix) != 12:
        return None
    return entry.parent / head[1:]


def restore_aside(final: str | os.PathLike) -> Path | None:
    """If `final` is missing and an overwrite left its old copy aside (a crash between the two
    renames), rename that copy back; return it, or None when nothing was restored."""
    final = Path(final)
    if final.exists() or final.is_symlink() or not final.parent.is_dir():
        return None
    asides = [
        e
        for e in final.parent.iterdir()
        if e.name.startswith(f".{final.name}{TRASH_TAG}") and _target_of(e, TRASH_TAG) == final
    ]
    if not asides:
        return None
    aside = max(asides, key=lambda e: e.stat().st_mtime_ns)  # one writer: at most one
    os.rename(aside, final)
    fsync_dir(final.parent)
    return aside


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root (and root itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_write_dir(final_dir: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temp dir next to `final_dir`; on clean exit it becomes `final_dir`.

    If the block raises, the temp dir is removed and `final_dir` is untouched. An existing
    `final_dir` is refused (FileExistsError) unless overwrite=True; then the old directory is
    renamed aside and removed after the new one is in place (between the two renames the path
    briefly does not exist, but it never holds a mix of old and new files; a crash there leaves
    the old copy aside, which `restore_aside` puts back: see the module doc).
    """
    final = Path(final_dir)
    restore_aside(final)  # a crash of an earlier overwrite of this target
    if final.exists() and not overwrite:
        raise FileExistsError(
            f"{final} already exists; refusing to overwrite it (pass overwrite=True, or pick a "
            "new directory such as one per version)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(final, TMP_TAG)
    tmp.mkdir()
    trash: Path | None = None
    try:
        yield tmp
        fsync_tree(tmp)
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"{final} appeared while it was being written; not replaced")
            trash = _hidden_sibling(final, TRASH_TAG)
            os.rename(final, trash)
            fsync_dir(final.parent)
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None and trash.exists() and not final.exists():
            os.rename(trash, final)  # put the old directory back
        raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file in the same dir, fsync, rename)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _hidden_sibling(final, TMP_TAG)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(final.parent)
    return final


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON (with a trailing newline) to `path` atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def remove_stale_temps(parent: str | os.PathLike) -> list[Path]:
    """Remove leftovers of interrupted atomic writes in `parent`; return what was removed.

    An overwrite's old copy whose target is missing is no leftover but the only whole copy: it
    is renamed back into place (`restore_aside`), not removed. Only call this when no writer is
    active in `parent`.
    """
    removed: list[Path] = []
    root = Path(parent)
    if not root.is_dir():
        return removed
    for entry in list(root.iterdir()):
        target = _target_of(entry, TRASH_TAG)
        if target is not None and not target.exists() and not target.is_symlink():
            restore_aside(target)
    for entry in root.iterdir():
        if entry.name.startswith(".") and (TMP_TAG in entry.name or TRASH_TAG in entry.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
