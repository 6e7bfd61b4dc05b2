"""`codraft status`: what the server serves, gathered from its routes and shown as a table."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from codraft.client.client import CodraftClient
from codraft.client.errors import CodraftConnectionError, CodraftError, CodraftHTTPError
from codraft.client.models import DraftInfo, Health, Ready, TapInfo


@dataclass
class Status:
    server: str
    health: Health | None = None
    ready: Ready | None = None
    draft: DraftInfo | None = None
    tap: TapInfo | None = None
    metrics: dict[str, float] | None = None
    errors: dict[str, CodraftError] = field(default_factory=dict)

    @property
    def refused(self) -> bool:
        """True when the server answered some route with an error (e.g. 401 without a token)."""
        return any(isinstance(e, CodraftHTTPError) for e in self.errors.values())

    @property
    def policy_version(self) -> int | None:
        if self.ready is not None and self.ready.policy_version is not None:
            return self.ready.policy_version
        value = (self.metrics or {}).get("codraft_policy_version")
        return None if value is None else int(value)

    def to_json(self) -> dict[str, Any]:
        def dump(m: Any) -> Any:
            return None if m is None else m.model_dump()

        return {
            "server": self.server,
            "health": dump(self.health),
            "ready": dump(self.ready),
            "draft": dump(self.draft),
            "policy": {"version": self.policy_version},
            "tap": dump(self.tap),
            "metrics": self.metrics,
            "errors": {k: str(e) for k, e in self.errors.items()},
        }


def collect_status(client: CodraftClient) -> Status:
    """Ask every read-only route; an unreachable server raises CodraftConnectionError, other
    failures are kept in `errors` so the rest still shows."""
    status = Status(client.base_url)
    for name, ask in (
        ("health", client.health),
        ("ready", client.ready),
        ("draft", client.draft),
        ("tap", client.tap),
        ("metrics", client.metrics),
    ):
        try:
            setattr(status, name, ask())
        except CodraftConnectionError:
            raise
        except CodraftError as e:
            status.errors[name] = e
    return status


# ------------------------------------------------------------------------------ rows
def _v(version: int | None) -> str:
    return "none" if version is None else f"v{version}"


def _count(metrics: dict[str, float], name: str) -> int | None:
    value = metrics.get(name)
    return None if value is None else int(value)


def rows(s: Status) -> list[tuple[str, str]]:
    out = [("server", s.server)]
    if s.health is not None:
        out.append(("health", "ok" if s.health.ok else f"{s.health.status}: {s.health.detail}"))
    if s.ready is not None:
        out.append(("ready", "yes" if s.ready.ready else f"no ({s.ready.detail})"))
    if (d := s.draft) is not None:
        sha = (d.sha256 or "?")[:12]
        out.append(
            (
                "draft",
                f"{d.kind or '?'} {_v(d.version)}  sha256 {sha}…  tap layers {d.tap_layers}  "
                f"loaded {d.loaded_at}  previous {_v(d.previous_version)}",
            )
        )
        out.append(("draft path", str(d.path)))
        a = d.acceptance
        if a is None or not a.drafts:
            out.append(("acceptance", "no verifications yet"))
        else:
            length = f"{a.acceptance_length:.2f}" if a.acceptance_length is not None else "?"
            rate = f"{100 * a.rate:.1f}%" if a.rate is not None else "?"
            out.append(
                (
                    "acceptance",
                    f"length {length} over {a.drafts:,} verifications; {rate} of "
                    f"{a.draft_tokens:,} draft tokens accepted",
                )
            )
    if s.ready is not None or s.metrics is not None:
        out.append(("policy", _v(s.policy_version)))
    if (t := s.tap) is not None:
        state = "on" if t.enabled else "off"
        out.append(
            ("tap", f"{state}, mode {t.mode}, sample rate {t.sample_rate}, endpoint {t.endpoint}")
        )
        if t.stats is not None:
            st = t.stats
            out.append(
                (
                    "tap stream",
                    f"{st.messages_sent:,} messages sent, {st.messages_dropped:,} dropped, "
                    f"queue {st.queue_depth}",
                )
            )
    if s.metrics is not None:
        swaps = _count(s.metrics, "codraft_draft_swaps_total")
        rollbacks = _count(s.metrics, "codraft_draft_rollbacks_total")
        auto = _count(s.metrics, "codraft_draft_auto_rollbacks_total")
        if swaps is not None:
            out.append(("swaps", f"{swaps} swaps, {rollbacks} rollbacks ({auto} automatic)"))
    for name, error in s.errors.items():
        out.append((f"{name} error", str(error)))
    return out


# ------------------------------------------------------------------------------ output
def render_plain(s: Status, out: TextIO) -> None:
    width = max(len(label) for label, _ in rows(s))
    for label, value in rows(s):
        out.write(f"{label:<{width}}  {value}\n")


def render_rich(s: Status, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="codraft", show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for label, value in rows(s):
        style = "red" if label.endswith("error") else None
        table.add_row(label, value, style=style)
    Console(file=out).print(table)


def render(s: Status, out: TextIO | None = None, *, as_json: bool = False) -> None:
    """JSON, a rich table on a terminal (when rich is installed), else plain lines."""
    out = out or sys.stdout
    if as_json:
        out.write(json.dumps(s.to_json(), indent=2) + "\n")
        return
    if out.isatty():
        try:
            render_rich(s, out)
            return
        except ImportError:
            pass
    render_plain(s, out)
