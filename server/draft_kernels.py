"""Draft weights in the drafter's kernel format, built off the engine loop, installed in place.

vLLM turns checkpoint tensors into what its kernels use while it loads a model: the layers'
weight loaders fuse and shard (q/k/v into qkv_proj, gate/up into gate_up_proj, TP slices), and
`quant_method.process_weights_after_loading` post-processes (the CPU build packs every Linear
weight into a oneDNN or sgl handle held by `layer.cpu_linear`, and leaves an empty `weight`).
vLLM's in-place reload (`reload_weights`) does all of that on the live model, so it has to run
between engine steps, and its cost is the swap's cost.

`stage_kernels` runs the same steps on a *shadow* of the live drafter: a copy of its module tree
whose loadable layers get fresh parameters materialised from the metadata vLLM recorded when it
built the model (`record_metadata_for_reloading`), loaded with the model's own `load_weights`
and post-processed with the layers' own `process_weights_after_loading`. Modules shared with the
target (the embedding) and layers without parameters of their own (attention, rotary tables)
are the live objects themselves and are never written. The result, a `KernelState`, holds per
live layer the kernel-format tensors and the kernel attributes (`cpu_linear`). It is built in a
background thread while the engine keeps stepping.

`install` then only copies those tensors into the live parameters' storage (`copy_`: pointers
that kernels or graphs hold stay valid) and sets the kernel attributes: a few milliseconds.
`snapshot_live` captures the live state the same way (clones), so the draft vLLM loaded at
start can be rolled back to like any other.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch import nn

# Attributes that a layer's process_weights_after_loading sets and its forward reads.
KERNEL_ATTRS = ("cpu_linear",)


class StageError(RuntimeError):
    """The drafter's layout does not allow staging; the caller falls back to reload_weights."""


@dataclass
class LayerKernels:
    layer: nn.Module  # the live layer
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # params and buffers
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class KernelState:
    layers: list[LayerKernels]
    timing: dict[str, float] = field(default_factory=dict)  # stage_kernels' parts, ms

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for k in self.layers for t in k.tensors.values())


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in module._parameters.items() if p is not None}
    out.update({n: b for n, b in module._buffers.items() if b is not None})
    return out


def _loadable_layers(model: nn.Module, shared: set[int]) -> list[nn.Module]:
    """Live layers with parameters of their own (not the target's)."""
    return [
        m
        for m in model.modules()
        if id(m) not in shared and any(id(p) not in shared for p in m._parameters.values())
    ]


def _shared_ids(model: nn.Module, target: nn.Module) -> set[int]:
    """Ids of the drafter's modules and tensors that are the target's (never written), and of
    its layers without parameters (attention: bound to the KV cache; rotary tables)."""
    target_params = {id(p) for p in target.parameters()}
    ids = set(target_params)
    for m in model.modules():
        own = list(m._parameters.values())
        if (own and all(id(p) in target_params for p in own)) or (not own and not m._modules):
            ids.add(id(m))
    return ids


def _shadow(module: nn.Module, shared: set[int]) -> nn.Module:
    """A copy of the module tree: new module objects (own dicts) except for shared ones."""
    if id(module) in shared:
        return module
    s = copy.copy(module)
    s.__dict__["_parameters"] = dict(module._parameters)
    s.__dict__["_buffers"] = dict(module._buffers)
    s.__dict__["_modules"] = {n: _shadow(m, shared) for n, m in module._modules.items()}
    return s


def _unwrap(value: Any) -> Any:
    """A weight loader without vLLM's layerwise-reload wrappers (an earlier reload_weights on
    the live drafter leaves them on the recorded metadata)."""
    while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
        value = value.__wrapped__
    return value


def _materialize(
    meta: torch.Tensor, live: nn.Module, twin: nn.Module, device: torch.device
) -> torch.Tensor:
    """vLLM's materialize_meta_tensor + restore_layer_refs for `twin`, without touching the
    recorded metadata: its weight loaders are bound to `twin`, never to the live layer."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    t = torch.empty_strided(
        tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device=device
    )
    t.__class__ = meta.__class__
    attrs = {}
    for k, v in meta.__dict__.items():
        v = _unwrap(v)
        if isinstance(v, MethodType) and (v.__self__ is layer_ref_sentinel or v.__self__ is live):
            v = v.__func__.__get__(twin)
        attrs[k] = v
    t.__dict__ = attrs
    return t


def _pairs(live: nn.Module, shadow: nn.Module) -> dict[int, nn.Module]:
    """id(live layer) -> its shadow, walking both trees in step."""
    out = {id(live): shadow}
    for name, child in live._modules.items():
        if child is not None:
            out.update(_pairs(child, shadow._modules[name]))
    return out


def stage_kernels(
    drafter_model: nn.Module,
    target_model: nn.Module,
    weights: dict[str, torch.Tensor],
) -> KernelState:
    """The kernel-format state of `weights` (checkpoint names) for the live drafter; touches
    nothing live. Raises StageError when the drafter's layers do not fit this scheme."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    if any("embed_tokens" in name for name in weights):
        raise StageError("the draft's embedding is the target's: a checkpoint must not hold one")
    t0 = time.perf_counter()
    shared = _shared_ids(drafter_model, target_model)
    live_layers = _loadable_layers(drafter_model, shared)
    shadow = _shadow(drafter_model, shared)
    twins = _pairs(drafter_model, shadow)
    for layer in live_layers:
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            raise StageError(f"no reload metadata for {type(layer).__name__}")
        twin = twins[id(layer)]
        for name, meta in info.restore_metadata[0].items():
            twin._parameters[name] = _materialize(meta, layer, twin, info.restore_device)
    t1 = time.perf_counter()
    with torch.inference_mode():
        shadow.load_weights(iter(weights.items()))
        t2 = time.perf_counter()
        for layer in live_layers:
            twin = twins[id(layer)]
            method = getattr(twin, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(twin)
    t3 = time.perf_counter()
    state = []
    for layer in live_layers:
        twin = twins[id(layer)]
        live, new = _own_tensors(layer), _own_tensors(twin)
        if live.keys() != new.keys():
            raise StageError(
                f"{type(layer).__name__}: tensors {sorted(new)} after loading, live {sorted(live)}"
            )
        for name, t in new.items():
            if t.shape != live[name].shape or t.dtype != live[name].dtype:
                raise StageError(
                    f"{type(layer).__name__}.{name}: {list(t.shape)} {t.dtype} after loading, "
                    f"live {list(live[name].shape)} {live[name].dtype}"
                )
        attrs = {a: twin.__dict__[a] for a in KERNEL_ATTRS if a in twin.__dict__}
        if set(attrs) != {a for a in KERNEL_ATTRS if a in layer.__dict__}:
            raise StageError(f"{type(layer).__name__}: kernel attributes differ after loading")
        tensors = {n: t for n, t in new.items() if t.numel()}
        state.append(LayerKernels(layer, tensors, attrs))
    timing = {
        "materialize_ms": 1e3 * (t1 - t0),
        "load_weights_ms": 1e3 * (t2 - t1),
        "process_ms": 1e3 * (t3 - t2),
        "collect_ms": 1e3 * (time.perf_counter() - t3),
    }
    return KernelState(state, timing)


def snapshot_live(drafter_model: nn.Module, target_model: nn.Module) -> KernelState:
    """The live drafter's kernel state (tensors cloned), to install again on rollback."""
    shared = _shared_ids(drafter_model, target_model)
    state = []
    for layer in _loadable_layers(drafter_model, shared):
        tensors = {n: t.detach().clone() for n, t in _own_tensors(layer).items() if t.numel()}
        attrs = {a: layer.__dict__[a] for a in KERNEL_ATTRS if a in layer.__dict__}
        state.append(LayerKernels(layer, tensors, attrs))
    return KernelState(state)


def install(state: KernelState) -> None:
    """Write `state` into the live drafter: copy_ into the live storage, set kernel attrs."""
    with torch.inference_mode():
        for k in state.layers:
            live = _own_tensors(k.layer)
            for name, t in k.tensors.items():
                live[name].data.copy_(t)
            for name, value in k.attrs.items():
                k.layer.__dict__[name] = value
