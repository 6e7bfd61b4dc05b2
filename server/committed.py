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


def record_path(work_dir: str | Path, model: Path) -> Path:
    """The record of the server of target `model` (one per target: two servers of different
    targets may share a work dir)."""
    key = hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:12]
    return Path(work_dir) / f"committed-draft-{key}.json"


def write_record(path: Path, draft: dict[str, Any]) -> None:
    """Record `draft` (codraft_info's draft: version, sha256, path, loaded_at) atomically."""
    keep = {k: draft.get(k) for k in ("version", "sha256", "path", "loaded_at")}
    atomic_write_json(path, keep)


def choose_draft(record: Path, start: Path) -> Path:
    """The recorded draft when it is whole and newer than `start` (the --draft folder or the
    untrained draft), else `start`."""
    from codraft.draft.checkpoint import DraftCheckpointError, check_draft, read_meta

    try:
        rec = json.loads(record.read_text())
    except FileNotFoundError:
        return start
    except (OSError, ValueError) as e:
        log.warning("ignoring the committed-draft record %s: unreadable (%s)", record, e)
        return start
    try:
        path, version, sha = Path(rec["path"]), int(rec["version"]), str(rec["sha256"])
        _, meta = check_draft(path)
    except (KeyError, TypeError, ValueError, DraftCheckpointError) as e:
        log.warning("ignoring the committed-draft record %s: %s; serving %s", record, e, start)
        return start
    if meta.weights_sha256 != sha or meta.version != version:
        log.warning(
            "ignoring the committed-draft record %s: %s is now v%d (sha256 %s), the record says "
            "v%d (%s); serving %s", record, path, meta.version, meta.weights_sha256, version, sha,
            start,
        )  # fmt: skip
        return start
    try:
        start_version = read_meta(start).version
    except DraftCheckpointError:  # an EAGLE-3 folder without codraft.json serves as version 0
        start_version = 0
    if path.resolve() == start.resolve() or version <= start_version:
        return start
    log.warning(
        "serving draft v%d from %s, the newest this server committed before it stopped (%s), "
        "instead of v%d from %s; --no-resume-draft starts from the latter",
        version, path, record, start_version, start,
    )  # fmt: skip
    return path.resolve()
