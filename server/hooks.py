"""The engine step, as codraft sees it: a few methods of one vLLM model runner, wrapped.

vLLM has two GPU model runners, and codraft hooks both (the same methods on their CPU
subclasses): the V1 runner (`vllm.v1.worker.gpu_model_runner`) and the V2 runner
(`vllm.v1.worker.gpu.model_runner`, what vLLM 0.26 picks for dense models on CUDA). Hooks are per
runner *instance*, installed by the first codraft RPC; vLLM's files and classes are untouched;
the internals they read are listed and checked in codraft.server.compat.

What the forward already returns is all codraft needs, so the served model is exactly the one
plain vLLM serves (the same compiled graph, the same CUDA graphs): EAGLE-3 makes the target
return the aux hidden states of the draft's tap layers (aux layer k = residual stream after k
layers = codraft tap k), and the forward's `hidden_states` is the final hidden state after the
final norm (the tap's `last_hidden`, what lm_head reads).

* `execute_model` tells the listener about the step before it runs (new requests, finished
  ones), then builds a `StepRecord` (which rows of the flat batch belong to which request, how
  many are draft proposals) from the forward's inputs and outputs (V1: seen by the wrapped
  `_model_forward`; V2: the runner's `execute_model_state`) and has the rows the listener wants
  gathered on the device (codraft.server.row_copy: no host-device sync in the step).
* `sample_tokens` hands the record and each request's sampled tokens (accepted drafts + the
  bonus token) to the listener once they exist: at once, or, with async scheduling, when the
  engine materialises the step's output (`get_output`), one step later.

Listener callbacks run inside the engine step; an exception in them is logged and counted
(`errors`), never raised into vLLM.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from codraft.server.device_ring import DeviceRing
from codraft.server.row_copy import RowCopier, StagedRows

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- one step
@dataclass
class ReqSlice:
    """One request's rows in a step's flat batch."""

    req_id: str
    start: int  # first row in the flat batch
    num_tokens: int  # rows scheduled this step
    num_drafts: int  # of which draft proposals (the last ones)


# Functions, not methods: they run for every request of every step.
def accepted(s: ReqSlice, sampled: list[int]) -> int:
    """Draft proposals of `s` the target accepted, given what the step sampled for it (the
    accepted drafts and one bonus/correction token)."""
    return min(max(len(sampled) - 1, 0), s.num_drafts)


def final_rows(s: ReqSlice, sampled: list[int]) -> int:
    """How many leading rows of `s` are final: the scheduled rows minus the rejected proposals."""
    return s.num_tokens - s.num_drafts + accepted(s, sampled)


@dataclass
class StepRecord:
    """One engine step as the listener sees it. `rows` holds the gathered rows of the slices
    listed in `row_offsets` (slice index -> first row in `rows`), copied off the device."""

    seq: int
    slices: list[ReqSlice]
    context: Any = None  # what the listener attached in before_step
    rows: StagedRows | None = None
    row_offsets: dict[int, int] = field(default_factory=dict)


class StepListener:
    """What the hooks report to (implemented by the worker extension)."""

    def before_step(self, scheduler_output: Any) -> Any:
        """Engine thread, before the step runs; the return value becomes record.context."""

    def rows_wanted(self, slices: list[ReqSlice]) -> list[int]:
        """Engine thread: the slices whose rows to gather and copy."""
        return []

    def after_sample(self) -> None:
        """Engine thread, after the step's drafting (its proposals are for the next step)."""

    def on_step(self, record: StepRecord, sampled: list[list[int]] | None) -> None:
        """When the step's tokens exist (None: the step produced no output)."""


@dataclass
class HookTimes:
    """Host time spent in codraft's wrappers, for the per-step cost of capture."""

    steps: int = 0
    record_ns: int = 0  # execute_model, after the forward: the record and the row gather
    gather_ns: int = 0  # of record_ns: the row gather (RowCopier.copy) alone
    deliver_ns: int = 0  # sampled tokens handed to the listener

    def to_dict(self) -> dict[str, float | int]:
        n = max(self.steps, 1)
        return {
            "steps": self.steps,
            "record_us_per_step": self.record_ns / n / 1e3,
            "gather_us_per_step": self.gather_ns / n / 1e3,
            "deliver_us_per_step": self.deliver_ns / n / 1e3,
        }


# ---------------------------------------------------------------------------- runners
def runner_kind(runner: Any) -> str:
    """Which of vLLM's model runners this is: "v2" (the V2 runner or its CPU subclass) or
    "v1" (the V1 runner or its CPU subclass)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    except ImportError:
        V2 = None
    if V2 is not None and isinstance(runner, V2):
        return "v2"
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    if isinstance(runner, V1):
        return "v1"
    raise RuntimeError(
        f"codraft hooks vLLM's V1 or V2 GPU model runner (or their CPU subclasses), found "
        f"{type(runner).__module__}.{type(runner).__name__}"
    )


def _unwrap(model: Any) -> Any:
    """A model without vLLM's CUDA-graph / micro-batch wrappers around it."""
    while True:
        inner = getattr(model, "unwrap", None)
        if callable(inner):
            unwrapped = inner()
            if unwrapped is model:
                return model
            model = unwrapped
            continue
        runnable = model.__dict__.get("runnable") if hasattr(model, "__dict__") else None
        if runnable is None:
            return model
        model = runnable


def target_model(runner: Any) -> Any:
    get_model = getattr(runner, "get_model", None)
    return _unwrap(get_model() if callable(get_model) else runner.model)


def drafter_model(runner: Any) -> Any:
    """The running draft model (V1: runner.drafter.model; V2: the speculator's)."""
    get_draft = getattr(runner, "get_draft_model", None)
    if callable(get_draft):
        model = get_draft()
        if model is not None:
            return _unwrap(model)
    drafter = getattr(runner, "drafter", None)
    if drafter is None:
        raise RuntimeError(
            "the engine has no draft model: start it with EAGLE-3 or DFlash speculation"
        )
    return _unwrap(drafter.model)


def proposer(runner: Any) -> Any:
    """The object that drives the draft (V2: the runner's speculator; V1: its drafter), or None."""
    return getattr(runner, "speculator", None) or getattr(runner, "drafter", None)


def _aux_holder(model: Any) -> Any:
    """The module holding `aux_hidden_state_layers` (what set_aux_hidden_state_layers sets)."""
    parent = model
    if hasattr(model, "get_language_model"):
        parent = model.get_language_model()
    holder = getattr(parent, "model", parent)
    if not hasattr(holder, "aux_hidden_state_layers"):
        raise RuntimeError(
            f"{type(model).__name__} has no aux hidden state layers: the target must support "
            "EAGLE-3 in vLLM and speculative decoding must use method 'eagle3' or 'dflash'"
        )
    return holder


# ---------------------------------------------------------------------------- hooks
class RunnerHooks:
    """The wrapped methods of one runner instance (see module doc)."""

    def __init__(
        self,
        runner: Any,
        tap_layers: tuple[int, ...],
        listener: StepListener,
        wire_dtype: torch.dtype,
        max_device_bytes: int,
        ring: DeviceRing | None = None,
    ) -> None:
        self.runner = runner
        self.kind = runner_kind(runner)
        self.tap_layers = tuple(tap_layers)
        self.listener = listener
        self.copier = RowCopier(runner.device, wire_dtype, max_device_bytes, ring)
        self.errors = 0
        self.times = HookTimes()
        self._orig: dict[str, Callable] = {}
        self._seq = itertools.count()
        self._in_step = False
        self._fwd: tuple | None = None
        self._pending: StepRecord | None = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        holder = _aux_holder(target_model(self.runner))
        # vLLM 0.32 stores the aux layers sorted, 0.26 as given; both return them in layer order.
        have = tuple(sorted(int(t) for t in holder.aux_hidden_state_layers))
        if have != tuple(sorted(self.tap_layers)):
            raise RuntimeError(
                f"the target collects aux hidden states of layers {list(have)}, but the draft's "
                f"tap layers are {list(self.tap_layers)}; codraft needs them equal"
            )
        if list(self.tap_layers) != sorted(set(self.tap_layers)):
            raise RuntimeError(f"tap layers must be increasing, got {list(self.tap_layers)}")
        names = ("_model_forward",) if self.kind == "v1" else ()
        for name in (*names, "execute_model", "sample_tokens"):
            self._orig[name] = getattr(self.runner, name)
        if self.kind == "v1":
            self.runner._model_forward = self._model_forward_v1
        self.runner.execute_model = self._execute_model
        self.runner.sample_tokens = self._sample_tokens

    def uninstall(self) -> None:
        for name in self._orig:
            self.runner.__dict__.pop(name, None)  # back to the class's method
        self._orig.clear()

    # ------------------------------------------------------------------ forward outputs
    def _model_forward_v1(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig["_model_forward"](*args, **kwargs)
        if self._in_step and isinstance(out, tuple) and len(out) == 2:
            # views of buffers the next step overwrites: gathered before it (_record)
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            self._fwd = (input_ids, positions, out[0], out[1])
        return out

    def _forward_v2(self) -> tuple | None:
        """The V2 runner's forward of this step: (input_ids, positions, hidden, aux)."""
        st = getattr(self.runner, "execute_model_state", None)
        if st is None or st.aux_hidden_states is None or st.hidden_states is None:
            return None
        batch = st.input_batch
        return (batch.input_ids, batch.positions, st.hidden_states, st.aux_hidden_states)

    # ------------------------------------------------------------------ wrappers
    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "v2" and _is_dummy_run(args, kwargs):
            return self._orig["execute_model"](scheduler_output, *args, **kwargs)
        listener = self.listener
        context = self._guard(listener.before_step, scheduler_output)
        self._fwd, self._pending = None, None
        self._in_step = True
        try:
            out = self._orig["execute_model"](scheduler_output, *args, **kwargs)
        finally:
            self._in_step = False
        t0 = time.perf_counter_ns()
        fwd = self._forward_v2() if self.kind == "v2" else self._fwd
        self._fwd = None
        if out is None and fwd is not None:
            with torch.inference_mode():
                self._pending = self._guard(self._record, scheduler_output, fwd, context)
        else:  # no forward this step: the listener still learns about finished requests
            self._guard(listener.on_step, StepRecord(next(self._seq), [], context), None)
        self.times.record_ns += time.perf_counter_ns() - t0
        return out

    def _sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        record, self._pending = self._pending, None
        out = self._orig["sample_tokens"](*args, **kwargs)
        listener = self.listener
        self._guard(listener.after_sample)
        if record is None:
            return out
        t0 = time.perf_counter_ns()
        self.times.steps += 1
        from vllm.v1.outputs import ModelRunnerOutput

        if isinstance(out, ModelRunnerOutput):
            self._guard(self._deliver, listener, record, out)
        elif hasattr(out, "get_output"):  # tokens exist once the engine materialises them
            get_output = out.get_output

            def get_output_and_deliver() -> Any:
                result = get_output()
                t1 = time.perf_counter_ns()
                self._guard(self._deliver, listener, record, result)
                self.times.deliver_ns += time.perf_counter_ns() - t1
                return result

            out.get_output = get_output_and_deliver
        else:  # the step failed or produced nothing
            self._guard(listener.on_step, record, None)
        self.times.deliver_ns += time.perf_counter_ns() - t0
        return out

    # ------------------------------------------------------------------ helpers
    def _guard(self, fn: Callable, *args: Any) -> Any:
        """Run a codraft callback; an error in it is logged and counted, never raised into
        the engine step."""
        try:
            return fn(*args)
        except Exception:
            self.errors += 1
            log.exception("codraft capture: %s failed (counted; serving continues)", fn.__name__)
            return None

    def _layout(self, scheduler_output: Any) -> list[ReqSlice]:
        """The step's requests in flat-batch order with their row counts."""
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        if self.kind == "v2":
            batch = self.runner.execute_model_state.input_batch
            req_ids = list(batch.req_ids)
            counts = batch.num_scheduled_tokens.tolist()
            starts = batch.query_start_loc_np[: len(req_ids)].tolist()
        else:
            req_ids = list(self.runner.input_batch.req_ids)
            scheduled = scheduler_output.num_scheduled_tokens
            counts = [int(scheduled[r]) for r in req_ids]
            starts = list(itertools.accumulate(counts, initial=0))[:-1]
        return [
            ReqSlice(r, s, n, len(spec.get(r, ())))
            for r, s, n in zip(req_ids, starts, counts, strict=True)
        ]

    def _record(self, scheduler_output: Any, fwd: tuple, context: Any) -> StepRecord:
        input_ids, positions, hidden, taps = fwd
        record = StepRecord(next(self._seq), self._layout(scheduler_output), context)
        wanted = self.listener.rows_wanted(record.slices) if input_ids is not None else []
        if wanted:
            ranges, offset = [], 0
            for i in wanted:
                s = record.slices[i]
                record.row_offsets[i] = offset
                ranges.append((s.start, s.start + s.num_tokens))
                offset += s.num_tokens
            t0 = time.perf_counter_ns()
            record.rows = self.copier.copy(input_ids, positions, taps, hidden, ranges)
            self.times.gather_ns += time.perf_counter_ns() - t0
            if record.rows is None:
                record.row_offsets.clear()
        return record

    def _deliver(self, listener: StepListener, record: StepRecord, output: Any) -> None:
        index = output.req_id_to_index
        sampled_all = output.sampled_token_ids or []
        sampled = []
        for s in record.slices:
            i = index.get(s.req_id)
            sampled.append(list(sampled_all[i]) if i is not None and i < len(sampled_all) else [])
        listener.on_step(record, sampled)


def _is_dummy_run(args: tuple, kwargs: dict) -> bool:
    """V2's execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)."""
    return bool(kwargs.get("dummy_run", args[1] if len(args) > 1 else False))
