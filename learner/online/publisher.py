"""Publisher: tell the server to load a checkpoint the learner wrote, and make sense of its answer.

The checkpoint is already complete on the shared disk (written atomically), so a publish is
`POST /v1/draft/prepare {path, version, sha256}` (the server reads, hashes, checks and stages it
in the background while it keeps serving), a wait until GET /v1/draft/prepare says it is
staged, and `POST /v1/draft {version, path, sha256}`, which then only installs it
(`CodraftClient.publish_draft`). Connection failures are retried with exponential
backoff; a 409 (version not newer than the server's) means another learner or an earlier life of
this one got ahead: the outcome carries the server's version so the caller can number its next
draft above it; a 422 (contract or checksum) is a bug to report, not to retry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from codraft.client import CodraftClient
from codraft.client.errors import CodraftConnectionError, CodraftHTTPError, NotNewer
from codraft.draft.checkpoint import read_meta

log = logging.getLogger("codraft.learn.publish")


@dataclass
class PublishOutcome:
    ok: bool
    status: int  # HTTP status, or 0 when the server could not be reached
    message: str = ""
    server_version: int | None = None


class Publisher:
    def __init__(self, client: CodraftClient, attempts: int = 4, backoff_s: float = 0.5) -> None:
        self.client = client
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s

    def newest_version(self) -> int | None:
        """The version a new draft must exceed: the highest the server has installed (after a
        rollback that is above the serving one), or the serving one where the server does not
        say."""
        info = self.client.draft()
        if info.version is None:
            return info.highest_version
        return max(info.version, info.highest_version or 0)

    def publish(self, draft_dir: Path) -> PublishOutcome:
        meta = read_meta(draft_dir)
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                info = self.client.publish_draft(
                    meta.version, str(Path(draft_dir).resolve()), meta.weights_sha256
                )
                return PublishOutcome(True, 200, server_version=info.version)
            except NotNewer as e:
                return PublishOutcome(False, 409, str(e), self._server_version())
            except CodraftHTTPError as e:
                log.error("the server refused draft v%d (%d): %s", meta.version, e.status, e)
                return PublishOutcome(False, e.status, str(e))
            except CodraftConnectionError as e:
                if attempt == self.attempts:
                    return PublishOutcome(False, 0, str(e))
                log.warning("publish v%d: %s; retrying in %.1fs", meta.version, e, delay)
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _server_version(self) -> int | None:
        try:
            return self.newest_version()
        except (CodraftConnectionError, CodraftHTTPError):
            return None
