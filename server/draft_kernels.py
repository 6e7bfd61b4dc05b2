"""Draft weights in the drafter's kernel format, built off the engine loop, installed in place.

vLLM turns checkpoint tensors into what its kernels use while it loads a model: the layers'
weight loaders fuse and shard (q/k/v into qkv_proj, gate/up into gate_up_proj, TP slices), and
`quant_method.process_weights_after_loading` post-processes (the CPU build packs every Linear
weight into a oneDNN or sgl handle held by `layer.cpu_linear`, and leaves an empty `weight`).
vLLM's in-place reload (`reload_weights`) does all of that on the live model, so it has to run
between engine steps, and its cost is the swap's cost.

`stage_kernels` runs the same steps on a *shadow* of the live drafter: a copy of its module tree
whose loadable layers get fresh parameters materialised from the metadata vLLM recorded when it
built the model (`record_metadata_for_reloading`; one the checkpoint does not hold keeps its
live value), loaded with the model's own `load_weights` and post-processed with the layers' own
`process_weights_after_loading`. Modules shared with the target (the embedding; DFlash's
lm_head) and layers without parameters of their own (attention, rotary tables)
are the live objects themselves and are never written. The result, a `KernelState`, holds per
live layer the kernel-format tensors and the kernel attributes (`cpu_linear`). It is built in a
background thread while the engine keeps stepping.

Some drafters also derive model-level tensors from their layers' weights when they load
(`DERIVED_ATTRS`): vLLM's DFlash model stacks every layer's K/V projection into one fused weight
(and the K-norm weights into one tensor) for the context's K/V, outside the layers. The shadow's
`load_weights` builds them on the shadow; the state carries them like the layers' tensors.

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
# Plain tensor attributes a drafter module derives from its layers' weights while loading
# (vLLM's DFlashQwen3Model._build_fused_kv_buffers): they must follow every swap.
DERIVED_ATTRS = ("_fused_kv_weight", "_fused_kv_bias", "_k_norm_weights")


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
    # (live module, attribute, tensor): the drafter's derived tensors (DERIVED_ATTRS)
    derived: list[tuple[nn.Module, str, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        own = sum(t.numel() * t.element_size() for k in self.layers for t in k.tensors.values())
        return own + sum(t.numel() * t.element_size() for *_, t in self.derived)


def _derived(module: nn.Module) -> dict[str, torch.Tensor]:
    return {a: t for a in DERIVED_ATTRS if isinstance(t := module.__dict__.get(a), torch.Tensor)}


def derived_tensors(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The live drafter's derived tensors (DERIVED_ATTRS), by module."""
    return [(m, a, t) for m in model.modules() for a, t in _derived(m).items()]


def rebuild_from_layers(model: nn.Module) -> None:
    """Let vLLM's DFlash model derive again, from its layers as they are now, what it keeps
    outside them (`_build_fused_kv_buffers`: the fused K/V weight, the stacked K-norm weights,
    its reference to the RoPE table); a no-op for drafters without it. Its reload runs that
    rebuild while the layers still hold placeholders (meta on CUDA), so it runs again after
    one (first in `rebuild_derived`, and after a snapshot is put back)."""
    for module in model.modules():
        if hasattr(module, "_build_fused_kv_buffers"):
            module._build_fused_kv_buffers()


def rebuild_derived(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Write the derived tensors of `weights` (checkpoint names) into the live drafter, as its
    `_build_fused_kv_buffers` stacks them (per layer the K rows then the V rows of qkv_proj,
    layer after layer; the K-norm weights stacked). vLLM's in-place reload runs the model's
    `load_weights`, whose own rebuild reads the layers' weights while they are still the
    reload's placeholders (on CPU the fused weight comes out empty): this is its repair.
    Raises StageError when the checkpoint or the drafter does not fit that layout."""
    rebuild_from_layers(model)  # first what it derives from the modules (rope tables, layers)
    for module, name, live in derived_tensors(model):
        n = len(getattr(module, "layers", ()))
        try:
            if name == "_fused_kv_weight":
                parts = [
                    torch.cat([weights[f"layers.{i}.self_attn.{w}_proj.weight"] for w in "kv"])
                    for i in range(n)
                ]
            elif name == "_k_norm_weights":
                parts = [weights[f"layers.{i}.self_attn.k_norm.weight"] for i in range(n)]
            else:
                raise StageError(f"no rule to rebuild {type(module).__name__}.{name}")
        except KeyError as e:
            raise StageError(f"the checkpoint has no {e} to rebuild {name} from") from None
        new = (torch.cat if name == "_fused_kv_weight" else torch.stack)(parts)
        new = new.to(device=live.device, dtype=live.dtype)
        with torch.no_grad():
            if new.shape == live.shape:
                live.copy_(new)
            else:  # the reload replaced it (an empty placeholder): the rebuilt one takes over
                module.__dict__[name] = new.contiguous()


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in module._parameters.items() if p is not None}
    out.update({n: b for n, b in module._buffers.items() if b is not None})
    return out


def _params(module: nn.Module) -> list[torch.Tensor]:
    """A module's own parameters (a `bias` registered as None is none)."""
    return [p for p in module._parameters.values() if p is not None]


def _loadable_layers(model: nn.Module, shared: set[int]) -> list[nn.Module]:
    """Live layers with parameters of their own (not the target's)."""
    return [
        m
        for m in model.modules()
        if id(m) not in shared and any(id(p) not in shared for p in _params(m))
    ]


def _shared_ids(model: nn.Module, target: nn.Module) -> set[int]:
    """Ids of the drafter's modules and tensors that are the target's (never written), and of
    its layers without parameters (attention: bound to the KV cache; rotary tables)."""
    target_params = {id(p) for p in target.parameters()}
    ids = set(target_params)
    for m in model.modules():
        own = _params(m)  # (a shared lm_head has bias=None beside the target's weight)
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
            fresh = _materialize(meta, layer, twin, info.restore_device)
            live = layer._parameters.get(name)
            if live is not None and live.shape == fresh.shape:  # what the checkpoint does not
                with torch.no_grad():  # hold keeps its live value (DFlash's mask_embedding)
                    fresh.copy_(live)
            twin._parameters[name] = fresh
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
    derived = []
    for live_module, name, live_t in derived_tensors(drafter_model):
        new_t = _derived(twins[id(live_module)]).get(name)
        if new_t is None or new_t is live_t:
            raise StageError(f"{type(live_module).__name__}.{name} was not rebuilt by loading")
        if new_t.shape != live_t.shape or new_t.dtype != live_t.dtype:
            raise StageError(
                f"{type(live_module).__name__}.{name}: {list(new_t.shape)} {new_t.dtype} after "
                f"loading, live {list(live_t.shape)} {live_t.dtype}"
            )
        derived.append((live_module, name, new_t))
    timing = {
        "materialize_ms": 1e3 * (t1 - t0),
        "load_weights_ms": 1e3 * (t2 - t1),
        "process_ms": 1e3 * (t3 - t2),
        "collect_ms": 1e3 * (time.perf_counter() - t3),
    }
    return KernelState(state, timing, derived)


def snapshot_live(
    drafter_model: nn.Module, target_model: nn.Module, device: str | torch.device | None = None
) -> KernelState:
    """The live drafter's kernel state (tensors cloned, onto `device` if given: the host for
    a copy that must outlive the device's memory), to install again on rollback."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.clone() if device is None else t.to(device, copy=True)

    shared = _shared_ids(drafter_model, target_model)
    state = []
    for layer in _loadable_layers(drafter_model, shared):
        tensors = {n: copy(t) for n, t in _own_tensors(layer).items() if t.numel()}
        attrs = {a: layer.__dict__[a] for a in KERNEL_ATTRS if a in layer.__dict__}
        state.append(LayerKernels(layer, tensors, attrs))
    derived = [(m, a, copy(t)) for m, a, t in derived_tensors(drafter_model)]
    return KernelState(state, derived=derived)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A copy that is a normal tensor (not an inference-mode one, which vLLM's loaders could
    not update in place later)."""
    with torch.inference_mode(False):
        return t.clone()


def install(state: KernelState) -> None:
    """Write `state` into the live drafter: copy_ into the live storage, set kernel attrs."""
    with torch.inference_mode():
        for k in state.layers:
            live = _own_tensors(k.layer)
            for name, t in k.tensors.items():
                if live[name].is_meta:  # a reload left a placeholder: the copy takes its place
                    if name in k.layer._parameters:
                        k.layer._parameters[name] = nn.Parameter(_plain(t), requires_grad=False)
                    else:
                        k.layer._buffers[name] = _plain(t)
                else:
                    live[name].data.copy_(t)
            for name, value in k.attrs.items():
                k.layer.__dict__[name] = value
        for module, name, t in state.derived:
            live = module.__dict__[name]
            if live.is_meta or live.shape != t.shape:  # a reload's placeholder, or rebuilt
                module.__dict__[name] = _plain(t)
            else:
                live.copy_(t)
