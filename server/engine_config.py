"""Engine-side codraft settings: what the worker extension needs inside the vLLM worker.

They travel to every worker inside vLLM's own config, as `additional_config={"codraft": {...}}`
(`EngineConfig.to_additional_config()`; `--additional-config` on a vLLM command line), so no
environment variable or global is needed. Every field has a default that works; the tap settings
can also be changed at run time through the `codraft_set_tap` RPC.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from codraft.tap.auth import TapKeys

ADDITIONAL_CONFIG_KEY = "codraft"
TAP_MODES = ("full", "ids", "off")
TAP_DTYPES = ("float32", "bfloat16", "float16")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
TAP_ROLE = "the server's tap connects to"


@dataclass
class EngineConfig:
    """Settings of the codraft worker extension (one per engine; every worker reads the same)."""

    # --- tap: where and what to stream
    tap_endpoint: str | None = None  # the learner's PULL endpoint, e.g. tcp://127.0.0.1:5557
    tap_enabled: bool | None = None  # None: on exactly when an endpoint is set and mode != off
    tap_mode: str = "full"  # full (ids + features) | ids (token ids only) | off
    tap_sample_rate: float = 1.0  # fraction of requests captured, decided per request id
    tap_dtype: str | None = None  # feature dtype on the wire; None: the model's dtype
    tap_max_tokens: int = 8192  # tokens per message; longer requests go out in chunks
    # --- tap: CURVE (codraft.tap.auth), required when the endpoint leaves the host. Paths only:
    # the keys are read by the process that opens the socket. This server's secret certificate
    # (NAME.key_secret) and the learner's public certificate (NAME.key)
    tap_key: str | None = None
    tap_learner_key: str | None = None
    # --- tap: publisher back-pressure (never blocks an engine step)
    tap_queue_size: int = 256  # messages waiting for the publisher thread
    tap_hwm: int = 64  # ZeroMQ send high-water mark (messages)
    tap_linger_ms: int = 1000  # how long close() may spend flushing
    # device memory for gathered rows not yet copied to the host (MiB); past it a step's rows
    # are skipped and counted (steps_skipped). With tap_device_ring it is the ring's size,
    # allocated when the tap process starts
    tap_device_mb: int = 2048
    # where tap messages are assembled and sent: "process" (a process of their own, so that
    # they never wait on, nor hold up, the engine's interpreter lock) or "thread" (the engine's)
    tap_assembly: str = "process"
    # with tap_assembly "process": True hands the rows to the tap process in a ring on the
    # engine's device, shared once (CUDA IPC on a GPU, shared memory on the CPU), which copies
    # them off; False (measured faster on an H200: docs/benchmarks.md) copies them to the host
    # in the engine's process and writes them into a pipe
    tap_device_ring: bool = False
    # --- automatic rollback of a new draft whose acceptance collapses
    auto_rollback: bool = True
    # a new draft is judged once this many of its verifications (one request's drafts checked
    # in one step), from at least rollback_min_requests requests, fall in strata the previous
    # draft's acceptance covers (codraft.server.acceptance)
    rollback_window: int = 256
    rollback_min_requests: int = 8
    rollback_fraction: float = 0.5  # roll back below this fraction of the previous draft's rate
    # --- bookkeeping
    request_versions_max: int = 65536  # finished request ids remembered for /v1 responses

    def __post_init__(self) -> None:
        if self.tap_mode not in TAP_MODES:
            raise ValueError(f"tap_mode must be one of {TAP_MODES}, got {self.tap_mode!r}")
        if self.tap_assembly not in ("process", "thread"):
            raise ValueError(
                f"tap_assembly must be 'process' or 'thread', got {self.tap_assembly!r}"
            )
        for name in ("tap_device_ring", "auto_rollback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_sample_rate(self.tap_sample_rate)
        for name in ("tap_key", "tap_learner_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a path or null, got {value!r}")
        if self.tap_endpoint is not None:
            check_endpoint(self.tap_endpoint)
            self.tap_keys().required(self.tap_endpoint, TAP_ROLE)
        if self.tap_dtype is not None and self.tap_dtype not in TAP_DTYPES:
            raise ValueError(f"tap_dtype must be one of {TAP_DTYPES} or null, got {self.tap_dtype}")
        positive = (
            "tap_max_tokens",
            "tap_queue_size",
            "tap_hwm",
            "tap_device_mb",
            "rollback_window",
            "rollback_min_requests",
            "request_versions_max",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.tap_linger_ms, int) or self.tap_linger_ms < 0:
            raise ValueError(f"tap_linger_ms must be an integer >= 0, got {self.tap_linger_ms!r}")
        if not 0.0 < float(self.rollback_fraction) <= 1.0:
            raise ValueError(f"rollback_fraction must be in (0, 1], got {self.rollback_fraction}")

    def tap_keys(self) -> TapKeys:
        """The tap's key paths, named by `codraft serve`'s flags in errors."""
        return TapKeys(
            self.tap_key, self.tap_learner_key, own_flag="--tap-key",
            peers_flag="--tap-learner-key",
        )  # fmt: skip

    @property
    def tap_on(self) -> bool:
        """Whether the tap starts enabled."""
        if self.tap_enabled is not None:
            return bool(self.tap_enabled) and self.tap_mode != "off"
        return self.tap_endpoint is not None and self.tap_mode != "off"

    def to_additional_config(self) -> dict[str, Any]:
        """The value for vLLM's `additional_config` (merge it with other entries if any)."""
        return {ADDITIONAL_CONFIG_KEY: asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> EngineConfig:
        """Build from a plain dict; unknown keys are an error naming the known ones."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown codraft engine setting(s) {unknown}; known settings: {sorted(known)}"
            )
        return cls(**d)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineConfig:
        """Read `additional_config["codraft"]` of a VllmConfig (defaults when absent)."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if not isinstance(extra, dict):
            return cls()
        section = extra.get(ADDITIONAL_CONFIG_KEY)
        if section is not None and not isinstance(section, dict):
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a dict of codraft "
                f"settings, got {type(section).__name__}"
            )
        return cls.from_dict(section)


def check_endpoint(endpoint: str) -> str:
    """A ZeroMQ endpoint the publisher can connect to (tcp://, ipc:// or inproc://)."""
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        raise ValueError(
            f"tap endpoint must be a ZeroMQ endpoint starting with one of {ENDPOINT_SCHEMES} "
            f"(e.g. tcp://127.0.0.1:5557), got {endpoint!r}"
        )
    from codraft.server.publisher import check_connectable

    check_connectable(endpoint)  # also while the tap is off: it would fail when turned on
    return endpoint


def check_sample_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"tap sample_rate must be a number in [0, 1], got {rate!r}")
    return float(rate)
