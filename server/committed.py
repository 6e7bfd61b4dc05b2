"""The committed draft: what a restarted `codraft serve` serves.

Every change of the serving draft (a swap, a rollback asked for or automatic) is recorded in
`<work-dir>/committed-draft-<target>.json` (`record_path`) before the control API answers it, so
a server that is killed and started again with the same command comes back serving the newest
draft it acknowledged, not the one its --draft names. The record names the checkpoint folder and
its sha256; at start (`choose_draft`) it is honoured only when that checkpoint still checks out
and is newer than the --draft one, and otherwise ignored with a warning. `--no-resume-draft`
starts from --draft whatever the record says.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from codraft.atomic import atomic_write_json

log = logging.getLogger("codraft.serve")


def _target_key(model: Path) -> str:
    return hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:12]


def record_path(work_dir: str | Path, model: Path) -> Path:
    """The record of the server of target `model` (one per target: two servers of different
    targets may share a work dir)."""
    return Path(work_dir) / f"committed-draft-{_target_key(model)}.json"


def store_path(work_dir: str | Path, model: Path) -> Path:
    """The server's own copies of its drafts (codraft.server.draft_store), one per target."""
    return Path(work_dir) / f"drafts-{_target_key(model)}"


def recorded_paths(path: Path) -> set[str]:
    """The checkpoint folders the record at `path` names (newest and earlier); none when it is
    missing or unreadable."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(rec, dict):
        return set()
    entries = [rec, *(e for e in rec.get("earlier") or [] if isinstance(e, dict))]
    return {e["path"] for e in entries if isinstance(e.get("path"), str)}


EARLIER = 7  # earlier commits kept in the record, newest first


def _entry(draft: dict[str, Any]) -> dict[str, Any]:
    return {k: draft.get(k) for k in ("version", "sha256", "path", "loaded_at")}


def write_record(path: Path, draft: dict[str, Any]) -> None:
    """Record `draft` (codraft_info's draft: version, sha256, path, loaded_at) atomically, with
    the `EARLIER` commits before it (newest first): a restart falls back through them when the
    newest commit's files no longer check out (a learner that rewrote its checkpoint folder, a
    damaged disk). The caller writes one record at a time."""
    earlier: list[dict[str, Any]] = []
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and "path" in old:
            earlier = [_entry(old)] + [e for e in old.get("earlier", []) if isinstance(e, dict)]
    except (OSError, ValueError):
        pass
    new = _entry(draft)
    same = (new["version"], new["sha256"], new["path"])
    earlier = [e for e in earlier if (e.get("version"), e.get("sha256"), e.get("path")) != same]
    atomic_write_json(path, {**new, "earlier": earlier[:EARLIER]})


def _usable(entry: Any, record: Path, kind: str | None) -> tuple[Path, int] | None:
    """(checkpoint folder, version) of a record entry whose checkpoint still checks out with
    the recorded version and sha256 and is a draft of `kind` (None: any), else None (with a
    warning)."""
    from codraft.draft.checkpoint import DraftCheckpointError, check_draft

    try:
        path, version, sha = Path(entry["path"]), int(entry["version"]), str(entry["sha256"])
        cfg, meta = check_draft(path)
    except (KeyError, TypeError, ValueError, DraftCheckpointError) as e:
        log.warning("ignoring an entry of the committed-draft record %s: %s", record, e)
        return None
    if kind is not None and cfg.kind != kind:
        log.warning(
            "ignoring an entry of the committed-draft record %s: %s is a draft of kind %s, the "
            "server starts one of kind %s", record, path, cfg.kind, kind,
        )  # fmt: skip
        return None
    if meta.weights_sha256 != sha or meta.version != version:
        log.warning(
            "ignoring an entry of the committed-draft record %s: %s is now v%d (sha256 %s), "
            "the record says v%d (%s)", record, path, meta.version, meta.weights_sha256,
            version, sha,
        )  # fmt: skip
        return None
    return path, version


def choose_draft(record: Path, start: Path) -> Path:
    """The newest recorded draft that is whole (falling back through earlier commits when the
    newest one's files no longer check out, but never to a version above a later commit's: a
    draft the server rolled back from is not served again), when it is newer than `start` (the
    --draft folder or the untrained draft); else `start`."""
    from codraft.draft.checkpoint import DraftCheckpointError, read_meta

    try:
        rec = json.loads(record.read_text())
        if not isinstance(rec, dict):
            raise ValueError(f"expected a JSON object, found {type(rec).__name__}")
    except FileNotFoundError:
        return start
    except (OSError, ValueError) as e:
        log.warning("ignoring the committed-draft record %s: unreadable (%s)", record, e)
        return start
    from codraft.server.serve_config import draft_kind

    try:  # a restart keeps the drafter kind it was started with
        kind: str | None = draft_kind(start)
    except ValueError:
        kind = None
    found = None
    ceiling = None  # never above a later commit: a draft rolled back from stays rolled back
    for entry in [rec, *(rec.get("earlier") or [])]:
        version = entry.get("version") if isinstance(entry, dict) else None
        if isinstance(version, int) and ceiling is not None and version > ceiling:
            continue
        if isinstance(version, int):
            ceiling = version if ceiling is None else min(ceiling, version)
        found = _usable(entry, record, kind)
        if found is not None:
            break
    if found is None:
        log.warning("ignoring the committed-draft record %s: no entry checks out; serving %s",
                    record, start)  # fmt: skip
        return start
    path, version = found
    try:
        start_version = read_meta(start).version
    except DraftCheckpointError:  # an EAGLE-3 folder without codraft.json serves as version 0
        start_version = 0
    if path.resolve() == start.resolve() or version <= start_version:
        return start
    log.warning(
        "serving draft v%d from %s, the newest this server committed before it stopped that "
        "still checks out (%s), instead of v%d from %s; --no-resume-draft starts from the "
        "latter", version, path, record, start_version, start,
    )  # fmt: skip
    return path.resolve()
