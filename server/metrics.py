"""GET /metrics: vLLM's own Prometheus metrics plus codraft's, in one text exposition.

codraft's counters live in the engine (the worker extension); `CodraftCollector` turns the last
`codraft_stats`/`codraft_info` replies into Prometheus families. A scrape sends no RPC to the
engine: it reads the replies EngineControl's refresher keeps (codraft_info every `refresh_s`,
codraft_stats every `stats_refresh_s`; failed refreshes serve the previous values and count in
`codraft_stats_refresh_errors_total`), so scrapes at any rate cost the engine nothing. The
route is unauthenticated on both ports (--api-key too leaves it open:
`codraft.server.api_key`), as scrape endpoints usually are: it exposes versions and counters,
nothing that changes the server.

Metrics (counters carry the `_total` suffix in the exposition):
  codraft_tap_messages_sent, codraft_tap_messages_dropped, codraft_tap_bytes_sent,
  codraft_tap_bytes_dropped (counters), codraft_tap_queue_depth, codraft_tap_enabled,
  codraft_tap_sample_rate (gauges);
  codraft_draft_drafts, codraft_draft_draft_tokens, codraft_draft_accepted_tokens
  (counters, label version), codraft_draft_acceptance_length (gauge, label version);
  codraft_draft_swaps, codraft_draft_rollbacks, codraft_draft_auto_rollbacks (counters);
  codraft_draft_version, codraft_policy_version (gauges); codraft_draft_info (label kind:
  eagle3 or dflash); codraft_version_headers (counter, label source: engine | arrival).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.routing import Route

from codraft.server.api import EngineControl
from codraft.server.auth import ControlError


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, int | float) else None


class CodraftCollector(Collector):
    """Prometheus families from the latest codraft_stats and codraft_info replies."""

    def __init__(self, header_sources: dict[str, int] | None = None) -> None:
        self.stats: dict[str, Any] = {}
        self.info: dict[str, Any] = {}
        self.header_sources = header_sources if header_sources is not None else {}

    def update(self, stats: dict[str, Any] | None, info: dict[str, Any] | None) -> None:
        if stats is not None:
            self.stats = stats
        if info is not None:
            self.info = info

    def collect(self) -> Iterator[Metric]:
        tap = self.stats.get("tap") or {}
        for key, doc in (
            ("messages_sent", "tap messages handed to ZeroMQ"),
            ("messages_dropped", "tap messages dropped (queue full or no learner)"),
            ("bytes_sent", "tap bytes handed to ZeroMQ"),
            ("bytes_dropped", "tap bytes dropped"),
        ):
            if (v := _num(tap.get(key))) is not None:
                yield CounterMetricFamily(f"codraft_tap_{key}", doc, value=v)
        if (v := _num(tap.get("queue_depth"))) is not None:
            yield GaugeMetricFamily("codraft_tap_queue_depth", "tap messages queued", value=v)
        tap_cfg = self.info.get("tap") or {}
        if (v := _num(tap_cfg.get("enabled"))) is not None:
            yield GaugeMetricFamily("codraft_tap_enabled", "1 when the tap streams", value=v)
        if (v := _num(tap_cfg.get("sample_rate"))) is not None:
            yield GaugeMetricFamily("codraft_tap_sample_rate", "tap sample rate", value=v)

        acceptance = self.stats.get("acceptance") or {}
        families = {
            "drafts": CounterMetricFamily(
                "codraft_draft_drafts", "verification steps by draft version", labels=["version"]
            ),
            "draft_tokens": CounterMetricFamily(
                "codraft_draft_draft_tokens", "proposed draft tokens", labels=["version"]
            ),
            "accepted_tokens": CounterMetricFamily(
                "codraft_draft_accepted_tokens", "accepted draft tokens", labels=["version"]
            ),
            "acceptance_length": GaugeMetricFamily(
                "codraft_draft_acceptance_length",
                "mean tokens per verification step",
                labels=["version"],
            ),
        }
        for version, row in sorted(acceptance.items(), key=lambda kv: str(kv[0])):
            if not isinstance(row, dict):
                continue
            for key, family in families.items():
                if (v := _num(row.get(key))) is not None:
                    family.add_metric([str(version)], v)
        yield from families.values()

        for key, doc in (
            ("swaps", "draft swaps"),
            ("rollbacks", "draft rollbacks (manual and automatic)"),
            ("auto_rollbacks", "automatic draft rollbacks"),
        ):
            if (v := _num(self.stats.get(key))) is not None:
                yield CounterMetricFamily(f"codraft_draft_{key}", doc, value=v)
        draft = self.info.get("draft") or {}
        if (draft_version := _num(draft.get("version"))) is not None:
            yield GaugeMetricFamily("codraft_draft_version", "loaded draft", value=draft_version)
        headers = CounterMetricFamily(
            "codraft_version_headers",
            "complete responses' version headers, by source: engine (the draft serving when the "
            "request finished) or arrival (the engine could not tell)",
            labels=["source"],
        )
        for source, n in self.header_sources.items():
            headers.add_metric([source], n)
        yield headers
        if isinstance(kind := draft.get("kind"), str):
            info = InfoMetricFamily("codraft_draft", "the serving draft's kind")
            info.add_metric([], {"kind": kind})
            yield info
        policy = _num(self.stats.get("policy_version"))
        if policy is None:
            policy = _num((self.info.get("policy") or {}).get("version"))
        if policy is not None:
            yield GaugeMetricFamily("codraft_policy_version", "loaded policy", value=policy)


def vllm_registry() -> CollectorRegistry:
    """vLLM's own metrics registry (imported at scrape time: vLLM sets it up as the engine
    starts)."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    return get_prometheus_registry()


def sglang_registry() -> CollectorRegistry | None:
    """SGLang's metrics (written by its processes to PROMETHEUS_MULTIPROC_DIR when it runs with
    --enable-metrics); None without them."""
    where = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not where or not os.path.isdir(where):
        return None
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


class MetricsEndpoint:
    """Renders the engine's registry (`engine_registry`: vLLM's, SGLang's, or none) followed by
    codraft's own (refreshed from the engine first)."""

    def __init__(
        self,
        control: EngineControl,
        engine_registry: Callable[[], CollectorRegistry | None] = vllm_registry,
    ) -> None:
        self.control = control
        self.engine_registry = engine_registry
        self.collector = CodraftCollector(control.header_sources)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.refresh_errors = Counter(
            "codraft_stats_refresh_errors",
            "failed background refreshes of codraft stats and info",
            registry=self.registry,
        )
        self._errors_seen = 0

    async def refresh(self) -> None:
        """Ask the engine now (what the refresher does; for callers without one running)."""
        try:
            await asyncio.gather(self.control.refresh_stats(), self.control.info())
        except ControlError:
            self.control.refresh_errors += 1
        self.use_cache()

    def use_cache(self) -> None:
        """Take EngineControl's cached replies, with the versions it knows now (a swap through
        the API updates them at once, before the next refresh), and its count of failed
        refreshes."""
        draft, policy = self.control.versions()
        info, stats = self.control.last_info, self.control.last_stats
        if info is not None:
            info = {
                **info,
                "draft": {**(info.get("draft") or {}), "version": draft},
                "policy": {**(info.get("policy") or {}), "version": policy},
            }
        if stats is not None and policy is not None:
            stats = {**stats, "policy_version": policy}
        self.collector.update(stats, info)
        errors = self.control.refresh_errors
        if errors > self._errors_seen:
            self.refresh_errors.inc(errors - self._errors_seen)
            self._errors_seen = errors

    async def handle(self, request: Request) -> Response:
        self.use_cache()
        engine = self.engine_registry()
        body = generate_latest(engine) if engine is not None else b""
        body += generate_latest(self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def install_metrics(app: FastAPI, endpoint: MetricsEndpoint) -> None:
    """Serve `endpoint` at /metrics on `app`, ahead of any /metrics route already there (vLLM
    mounts its own)."""
    app.router.routes.insert(0, Route("/metrics", endpoint.handle, methods=["GET"]))
