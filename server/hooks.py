"""The engine step, as codraft sees it: three methods of one vLLM model runner, wrapped.

Hooks (per runner instance, installed by the worker extension; vLLM's files are untouched; the
internals are listed and checked in server.compat):

* `runner._model_forward` - sees the forward's `input_ids` and `positions` and its output
  `(hidden_states, aux_hidden_states)`. EAGLE-3 already makes the target return the aux hidden
  states of the draft's tap layers (aux layer k = residual stream after k layers = codraft tap
  k). vLLM's `hidden_states` there is AFTER the final norm, so the pre-norm last hidden state is
  captured through the same mechanism: layer L (the number of layers) is added to the model's
  aux layers, and the wrapper takes that last aux entry off the list before vLLM (and so the
  drafter) sees it. Nothing the drafter receives changes.
* `runner.execute_model` - records which rows of the flat batch belong to which request, how
  many of them are draft proposals (`scheduler_output.scheduled_spec_decode_tokens`), and tells
  the listener which requests the scheduler reports finished, before the step runs.
* `runner.sample_tokens` - once the step's `ModelRunnerOutput` exists (at once, or when an
  async output is materialised), hands the listener the step record and each request's sampled
  tokens (accepted drafts + the bonus token).

Listener callbacks run inside the engine step; an exception in them is logged and counted
(`errors`), never raised into vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# Steps whose host-side first positions are checked against the device's (see _first_positions).
HOST_POSITION_CHECKS = 16


# ---------------------------------------------------------------------------- one step
@dataclass
class ReqSlice:
    """One request's rows in a step's flat batch."""

    req_id: str
    start: int  # first row in the flat batch
    num_tokens: int  # rows scheduled this step
    num_drafts: int  # of which draft proposals (the last ones)
    position: int  # sequence position of the first row

    def final_rows(self, sampled: list[int]) -> int:
        """How many leading rows are final once the step sampled `sampled` for this request."""
        if self.num_drafts == 0:
            return self.num_tokens
        accepted = min(max(len(sampled) - 1, 0), self.num_drafts)
        return self.num_tokens - self.num_drafts + accepted

    def accepted(self, sampled: list[int]) -> int:
        return min(max(len(sampled) - 1, 0), self.num_drafts) if self.num_drafts else 0


@dataclass
class StepRecord:
    """What one engine step fed the target and what it returned (device tensors)."""

    slices: list[ReqSlice]
    input_ids: torch.Tensor | None  # [N]
    taps: list[torch.Tensor]  # aux hidden states of the draft's tap layers, each [N, H]
    last_hidden: torch.Tensor | None  # [N, H], residual stream after the last layer


class StepListener:
    """What the hooks report to (implemented by the worker extension)."""

    def before_step(self, scheduler_output: Any) -> None: ...

    def on_step(self, record: StepRecord, sampled: list[list[int]]) -> None: ...


# ---------------------------------------------------------------------------- hooks
class RunnerHooks:
    """Wraps `_model_forward`, `execute_model` and `sample_tokens` of one runner instance."""

    NAMES = ("_model_forward", "execute_model", "sample_tokens")

    def __init__(self, runner: Any, tap_layers: tuple[int, ...], listener: StepListener) -> None:
        self.runner = runner
        self.listener = listener
        self.tap_layers = tuple(tap_layers)
        self.num_layers = int(runner.model_config.hf_config.num_hidden_layers)
        self.extra_last = self.num_layers not in self.tap_layers
        self.errors = 0
        # first positions from the runner's host bookkeeping (no device sync), and how many
        # steps checked them against the device's (see _first_positions)
        self.host_positions = True
        self.host_position_checks = 0
        self._orig: dict[str, Callable] = {}
        self._in_step = False
        self._fwd: tuple | None = None
        self._pending: StepRecord | None = None

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        runner = self.runner
        model = _raw_model(runner)
        holder = _aux_holder(model)
        # vLLM 0.32 stores the aux layers sorted, 0.26 as given; both return them in layer order.
        have = tuple(sorted(holder.aux_hidden_state_layers))
        if have != tuple(sorted(self.tap_layers)):
            raise RuntimeError(
                f"the target collects aux hidden states of layers {list(have)}, but the draft's "
                f"tap layers are {list(self.tap_layers)}; codraft needs them equal"
            )
        if list(self.tap_layers) != sorted(self.tap_layers):
            raise RuntimeError(f"tap layers must be increasing, got {list(self.tap_layers)}")
        if self.extra_last:
            _check_not_compiled(runner)
            model.set_aux_hidden_state_layers(self.tap_layers + (self.num_layers,))
        for name in self.NAMES:
            self._orig[name] = getattr(runner, name)
        runner._model_forward = self._model_forward
        runner.execute_model = self._execute_model
        runner.sample_tokens = self._sample_tokens

    def uninstall(self) -> None:
        for name in self.NAMES:
            if name in self._orig:
                delattr(self.runner, name)  # back to the class's method
        self._orig.clear()
        if self.extra_last:
            _raw_model(self.runner).set_aux_hidden_state_layers(self.tap_layers)

    # ------------------------------------------------------------------ wrappers
    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig["_model_forward"](*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list | tuple)):
            return out  # not an EAGLE-3 forward with aux outputs (e.g. a PP stage)
        hidden, aux = out
        if self.extra_last:
            last, aux = aux[-1], list(aux[:-1])
            out = (hidden, aux)
        else:
            last = aux[self.tap_layers.index(self.num_layers)]
        if self._in_step:
            # input_ids/positions are views of persistent buffers that later steps (and the
            # drafter) overwrite: copy them; the aux outputs are fresh tensors of this forward.
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            self._fwd = (
                None if input_ids is None else input_ids.clone(),
                None if positions is None else positions.clone(),
                list(aux),
                last,
            )
        return out

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._guard(self.listener.before_step, scheduler_output)
        self._fwd, self._pending = None, None
        self._in_step = True
        try:
            out = self._orig["execute_model"](scheduler_output, *args, **kwargs)
        finally:
            self._in_step = False
        if out is None and self._fwd is not None:
            self._pending = self._guard(self._record, scheduler_output)
        self._fwd = None
        return out

    def _sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig["sample_tokens"](*args, **kwargs)
        record, self._pending = self._pending, None
        if record is None:
            return out
        from vllm.v1.outputs import ModelRunnerOutput

        if isinstance(out, ModelRunnerOutput):
            self._guard(self._deliver, record, out)
        elif hasattr(out, "get_output"):  # async scheduling: tokens exist once get_output runs
            get_output = out.get_output

            def get_output_and_deliver() -> Any:
                result = get_output()
                self._guard(self._deliver, record, result)
                return result

            out.get_output = get_output_and_deliver
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

    def _record(self, scheduler_output: Any) -> StepRecord:
        input_ids, positions, taps, last = self._fwd
        req_ids = list(self.runner.input_batch.req_ids)
        counts = [int(scheduler_output.num_scheduled_tokens[r]) for r in req_ids]
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        starts, total = [], 0
        for n in counts:
            starts.append(total)
            total += n
        slices = [
            ReqSlice(r, s, n, len(spec.get(r, ())), p)
            for r, s, n, p in zip(
                req_ids, starts, counts, self._first_positions(positions, starts), strict=True
            )
        ]
        return StepRecord(slices, input_ids, taps, last)

    def _first_positions(self, positions: Any, starts: list[int]) -> list[int]:
        """Each request's first scheduled position. The runner computed them on the host from
        ``input_batch.num_computed_tokens_cpu`` (exact without async scheduling, which codraft
        refuses); reading those avoids a device->host copy, i.e. a sync of every GPU step. The
        first steps check them against the positions the model ran with; on any difference
        (another vLLM's bookkeeping) the device positions are read from then on."""

        def device() -> list[int]:
            idx = torch.tensor(starts, dtype=torch.long, device=positions.device)
            return positions[idx].tolist()

        host = getattr(self.runner.input_batch, "num_computed_tokens_cpu", None)
        if host is None or not self.host_positions:
            return device()
        first = host[: len(starts)].tolist()
        if self.host_position_checks < HOST_POSITION_CHECKS:
            self.host_position_checks += 1
            ran = device()
            if first != ran:
                log.error(
                    "codraft capture: input_batch.num_computed_tokens_cpu %s differs from the "
                    "positions the model ran with %s; reading positions from the device",
                    first[:8], ran[:8],
                )  # fmt: skip
                self.host_positions = False
                return ran
        return first

    def _deliver(self, record: StepRecord, output: Any) -> None:
        index = output.req_id_to_index
        sampled_all = output.sampled_token_ids
        sampled = []
        for s in record.slices:
            i = index.get(s.req_id)
            sampled.append(list(sampled_all[i]) if i is not None and i < len(sampled_all) else [])
        self.listener.on_step(record, sampled)


def _raw_model(runner: Any) -> Any:
    """The runner's model without a CUDA-graph / micro-batch wrapper around it."""
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def _check_not_compiled(runner: Any) -> None:
    """The extra aux layer is set after start-up: a model that torch.compile traced before
    would not return it (vLLM drops the guards). enforce_eager=True turns compilation off."""
    config = getattr(runner, "compilation_config", None)
    if config is None:
        config = getattr(getattr(runner, "vllm_config", None), "compilation_config", None)
    mode = getattr(config, "mode", None)
    if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
        raise RuntimeError(
            f"the target model is compiled (compilation mode {getattr(mode, 'name', mode)}); "
            "codraft adds an aux layer after start-up, which a compiled graph would not see: "
            "run the engine with enforce_eager=True"
        )


def _aux_holder(model: Any) -> Any:
    """The module holding `aux_hidden_state_layers` (what set_aux_hidden_state_layers sets)."""
    parent = model
    if hasattr(model, "get_language_model"):
        parent = model.get_language_model()
    holder = getattr(parent, "model", parent)
    if not hasattr(holder, "aux_hidden_state_layers"):
        raise RuntimeError(
            f"{type(model).__name__} has no aux hidden state layers: the target must support "
            "EAGLE-3 in vLLM and speculative decoding must use method 'eagle3'"
        )
    return holder
