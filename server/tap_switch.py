"""The tap's run-time settings and its publisher, as both engines keep them.

`TapSwitch` holds whether the tap is on, its mode, sample rate and endpoint (first from
`EngineConfig`, then from the `codraft_set_tap` RPC), the publisher that sends to that endpoint,
and the counters that outlive a publisher (what earlier publishers sent and dropped, requests
sampled out). The vLLM worker extension (codraft.server.worker_ext) and the SGLang engine
(codraft.server.sglang.engine) each keep one; what differs between them comes in as callables:
how a publisher is made (in the engine, or in vLLM's tap process) and what to do with the
capture when the endpoint changes or the tap goes off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from codraft.server.engine_config import (
    TAP_ROLE,
    EngineConfig,
    check_endpoint,
    check_sample_rate,
)
from codraft.server.publisher import PublisherStats, TapPublisher, sampled
from codraft.server.weights import SwapError


class TapSwitch:
    """The tap of one engine process (module doc)."""

    def __init__(
        self,
        cfg: EngineConfig,
        *,
        flush: Callable[[], Any],
        drop: Callable[[], Any] | None = None,
        make: Callable[..., Any] = TapPublisher,
        sender: bool = True,
    ) -> None:
        """`flush()`: wait until what was captured so far reached the publisher (before it
        closes); `drop()`: forget what is being captured (the tap went off); `make(endpoint,
        queue_size=, hwm=, linger_ms=, keys=)`: a publisher (keys: the engine's tap keys,
        `EngineConfig.tap_keys()`); `sender`: whether this process publishes
        at all (one rank of a tensor-parallel group does)."""
        self.cfg = cfg
        self.enabled = cfg.tap_on
        self.mode = cfg.tap_mode if cfg.tap_mode != "off" else "full"
        self.sample_rate = float(cfg.tap_sample_rate)
        self.endpoint = cfg.tap_endpoint
        self.flush, self.drop, self.make, self.sender = flush, drop, make, sender
        self.publisher: Any = None
        self.closed_totals = PublisherStats()
        self.sampled_out = 0

    def want(self, req_id: str) -> str | None:
        """How a new request is captured: the mode, or None (tap off, or sampled out)."""
        if not (self.sender and self.enabled and self.publisher is not None):
            return None
        if not sampled(req_id, self.sample_rate):
            self.sampled_out += 1
            return None
        return self.mode

    def emit(self, msg: Any) -> None:
        if self.publisher is not None:
            self.publisher.put(msg)

    def apply(self) -> None:
        """Open, move or close the publisher to match the settings; SwapError(422) when the
        endpoint cannot be used (the tap is then off)."""
        want = self.sender and self.enabled and self.endpoint is not None
        if self.publisher is not None and (not want or self.publisher.endpoint != self.endpoint):
            self.flush()  # what was captured so far goes to the endpoint it was captured for
            self.close_publisher()
        if want and self.publisher is None:
            try:
                self.publisher = self.make(
                    self.endpoint,
                    queue_size=self.cfg.tap_queue_size,
                    hwm=self.cfg.tap_hwm,
                    linger_ms=self.cfg.tap_linger_ms,
                    keys=self.cfg.tap_keys(),
                )
            except ValueError as e:
                self.enabled = False
                raise SwapError(422, str(e)) from None
        if not self.enabled and self.drop is not None:
            self.drop()

    def set(
        self, enabled: Any = None, mode: Any = None, sample_rate: Any = None, endpoint: Any = None
    ) -> dict[str, Any]:
        """The `codraft_set_tap` RPC: None leaves a setting as it is; mode "off" turns it off."""
        if enabled is not None and not isinstance(enabled, bool):
            raise SwapError(422, f"enabled must be true, false or null, got {enabled!r}")
        if mode is not None and mode not in ("full", "ids", "off"):
            raise SwapError(422, f"mode must be 'full', 'ids', 'off' or null, got {mode!r}")
        try:
            rate = check_sample_rate(sample_rate) if sample_rate is not None else self.sample_rate
            new_endpoint = check_endpoint(endpoint) if endpoint is not None else self.endpoint
            if new_endpoint is not None:  # off the host only with the keys it started with
                self.cfg.tap_keys().required(new_endpoint, TAP_ROLE)
        except ValueError as e:
            raise SwapError(422, str(e)) from None
        on = self.enabled if enabled is None else enabled
        if mode == "off":
            on = False
        if on and new_endpoint is None:
            raise SwapError(422, "cannot enable the tap without an endpoint: give endpoint too")
        if mode in ("full", "ids"):
            self.mode = mode
        self.enabled, self.sample_rate, self.endpoint = on, rate, new_endpoint
        self.apply()
        return {"ok": True, "tap": self.info()}

    def info(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "mode": self.mode,
            "sample_rate": self.sample_rate,
            "endpoint": self.endpoint,
        }

    def close_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.closed_totals.add(self.publisher.totals())
            self.publisher = None

    def counters(self, flush: bool = False) -> dict[str, Any]:
        """What every publisher so far sent and dropped, the queue now, requests sampled out;
        `flush` first waits (bounded) until the publisher's queue is empty."""
        if flush and self.publisher is not None:
            self.publisher.flush()
        totals = PublisherStats(**vars(self.closed_totals))
        depth = 0
        if self.publisher is not None:
            totals.add(self.publisher.totals())
            depth = self.publisher.stats()["queue_depth"]
        return {**vars(totals), "queue_depth": depth, "requests_sampled_out": self.sampled_out}
