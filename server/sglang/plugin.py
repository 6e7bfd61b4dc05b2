"""codraft's SGLang plugin: the hooks that put codraft's engine (codraft.server.sglang.engine)
into SGLang's scheduler process. No SGLang file is changed.

SGLang (0.5.17) loads general plugins, entry-point group `sglang.srt.plugins` (codraft's
pyproject names `register` below), in every process it starts, and wraps the methods they name
through its `HookRegistry` before the engine is built. `register` does nothing unless
`codraft serve --engine sglang` (or a script) set `CODRAFT_SGLANG` (engine.ENV), so installing
codraft changes no other SGLang server. The hooks:

* `ModelRunner.load_model` (after): marks the target's logits processor (not the draft's);
* `LogitsProcessor.forward` (around): for the marked one, hands the final hidden state (after
  the final norm) to SGLang's capture of the tap layers as one more captured layer, so the
  verify and extend outputs carry it, CUDA graphs included (the graphs are captured after
  `load_model`);
* `ModelRunner.forward` (around, target only): the engine takes that state off before the
  draft reads the hidden states, and gathers the captured rows;
* `EAGLEWorkerV2.forward_batch_generation` and `DFlashWorkerV2.forward_batch_generation`
  (around): which batch the target forward belongs to, and the step's capture attached to its
  result;
* `Scheduler.__init__` (after): builds the engine; `Scheduler.process_batch_result` (after):
  the step's accepted lengths and finished requests; `Scheduler.process_input_requests`
  (after): codraft's control calls, between batches;
* SGLang's own weight routes (its scheduler's weight updater): `release_memory_occupation`
  (around) and `resume_memory_occupation` (after) keep the draft across a release of the
  weights; `update_weights_from_{disk,tensor,distributed,ipc}` (after) make each successful
  target update a new policy version; the speculative worker's `update_weights_from_disk` /
  `_ipc` and the EAGLE worker's `update_weights_from_tensor` (around) leave codraft's draft
  alone (those routes would load the target's weights into it).

Under SGLang's profiler each of codraft's step hooks is a range of its own ("codraft.<hook>"),
so a trace tells codraft's host time in the scheduler's step from SGLang's; without the
profiler the check costs well under a microsecond.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

from codraft.server.sglang.engine import ENV, Settings, SGLangEngine, split_final

log = logging.getLogger(__name__)

_engine: SGLangEngine | None = None
MARK = "_codraft_final_state"


def _ranged(name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, inside a profiler range `name` while a profiler records."""
    if torch.autograd._profiler_enabled():
        with record_function(name):
            return fn(*args)
    return fn(*args)


def engine() -> SGLangEngine | None:
    """This process's engine (a scheduler process's, once built)."""
    return _engine


def _scheduler_built(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    global _engine
    settings = Settings.from_env()
    if settings is not None and _engine is None:
        _engine = SGLangEngine(scheduler, settings)  # a failure here stops the server: said why


def _after_load(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(runner, "is_draft_worker", False):
        processor = getattr(runner.model, "logits_processor", None)
        if processor is not None:
            setattr(processor, MARK, True)


def _logits_forward(original: Any, processor: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(processor, MARK, False) and len(args) >= 2:
        final = args[1]  # the hidden states after the final norm, every row
        if len(args) >= 5:
            args = (*args[:4], _with_final(args[4], final), *args[5:])
        elif "aux_hidden_states" in kwargs:
            kwargs["aux_hidden_states"] = _with_final(kwargs["aux_hidden_states"], final)
    return original(processor, *args, **kwargs)


def _with_final(aux: Any, final: Any) -> Any:
    import torch

    if isinstance(aux, list | tuple) and aux:
        return [*aux, final]
    if isinstance(aux, torch.Tensor):  # SGLang's packed form of the captured layers
        return torch.cat([aux, final], dim=-1)
    return aux  # nothing captured in this forward


def _runner_forward(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any):
    out = original(runner, forward_batch, *args, **kwargs)
    if getattr(runner.model, "logits_processor", None) is not None and getattr(
        runner.model.logits_processor, MARK, False
    ):
        hidden = _ranged("codraft.split_final", split_final, runner, out)
        if hidden is not None and _engine is not None:
            _ranged("codraft.on_target_forward", _engine.on_target_forward, forward_batch, hidden)
    return out


def _generation(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    if _engine is None:
        return original(worker, batch, *args, **kwargs)
    _ranged("codraft.on_batch", _engine.on_batch, batch)
    result = None
    try:
        result = original(worker, batch, *args, **kwargs)
        return result
    finally:
        _ranged("codraft.end_batch", _engine.end_batch, result)


def _batch_result(result: Any, scheduler: Any, batch: Any, step_result: Any, *a: Any, **k: Any):
    if _engine is not None:
        _ranged("codraft.on_result", _engine.on_result, batch, step_result)


def _inputs(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if _engine is not None:
        _ranged("codraft.poll", _engine.poll)


def _release(original: Any, manager: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    if _engine is not None:
        _engine.before_release(getattr(req, "tags", None))
    return original(manager, req, *args, **kwargs)


def _resume(result: Any, manager: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    if _engine is not None:
        _engine.after_resume(getattr(req, "tags", None))


def _target_updated(source: str) -> Any:
    def hook(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
        if _engine is not None and getattr(result, "success", False):
            _engine.policy_changed(source)

    return hook


def _draft_kept(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's reload of the speculative worker's draft from the target's folder or IPC
    handles (its routes load the target's weights into the draft too): codraft's EAGLE-3 draft
    comes through codraft's /v1/draft and is kept."""
    if _engine is None:
        return original(worker, *args, **kwargs)
    return True, "the EAGLE-3 draft is codraft's (POST /v1/draft): kept"


def _tensor_to_target(original: Any, worker: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """update_weights_from_tensor through the EAGLE worker writes the draft, then the target,
    with the same named tensors: with codraft's draft the target alone gets them (as SGLang's
    disable_draft_model=True does)."""
    if _engine is None:
        return original(worker, req, *args, **kwargs)
    return worker.target_worker.update_weights_from_tensor(req)


_WEIGHTS = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"

HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.__init__", _scheduler_built, "AFTER"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.load_model", _after_load, "AFTER"),
    ("sglang.srt.layers.logits_processor.LogitsProcessor.forward", _logits_forward, "AROUND"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward", _runner_forward, "AROUND"),
    (
        "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
        _generation,
        "AROUND",
    ),
    (
        "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
        _generation,
        "AROUND",
    ),
    ("sglang.srt.managers.scheduler.Scheduler.process_batch_result", _batch_result, "AFTER"),
    ("sglang.srt.managers.scheduler.Scheduler.process_input_requests", _inputs, "AFTER"),
    (f"{_WEIGHTS}.release_memory_occupation", _release, "AROUND"),
    (f"{_WEIGHTS}.resume_memory_occupation", _resume, "AFTER"),
    *(
        (f"{_WEIGHTS}.update_weights_from_{s}", _target_updated(s), "AFTER")
        for s in ("disk", "tensor", "distributed", "ipc")
    ),  # fmt: skip
    (
        "sglang.srt.speculative.base_spec_worker.BaseSpecWorker.update_weights_from_disk",
        _draft_kept,
        "AROUND",
    ),  # fmt: skip
    (
        "sglang.srt.speculative.base_spec_worker.BaseSpecWorker.update_weights_from_ipc",
        _draft_kept,
        "AROUND",
    ),  # fmt: skip
    (
        "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.update_weights_from_tensor",
        _tensor_to_target,
        "AROUND",
    ),  # fmt: skip
)


def register() -> None:
    """SGLang's plugin entry point (every SGLang process calls it)."""
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])
    log.info("codraft: SGLang hooks registered")
