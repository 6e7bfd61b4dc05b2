"""What the draft reads, kept on the host across an engine sleep, and its digest.

vLLM's sleep level 2 discards every tensor allocated while the model was loading (its memory
pool tagged "weights"); on wake-up that memory is mapped again with undefined contents. vLLM
then restores the target's buffers and the trainer pushes the target's weights; nothing gives
the draft back its own. A draft is more than its layers' parameters: vLLM's DFlash model keeps
tensors beside them (fused K/V weights, stacked K-norm weights, aliases), parameter-less
modules hold tables, and the proposer object that drives the draft keeps tensors of its own.
On the H200 a copy of the layers alone came back from level 2 with the acceptance of a blind
draft (1.09 tokens per step against 1.69 before, outputs still lossless): something else the
draft reads had been discarded.

So the copy taken before a sleep is of *everything the draft reads*, found by walking the
objects (`draft_tensors`): the drafter's parameters, buffers and tensor attributes, module by
module, and the proposer's tensor attributes, less the target's own tensors (they share
storage with a target parameter or buffer: vLLM and the trainer bring those back), and of
those only the ones inside vLLM's sleep-mode memory pools (`pool_tags`; the rest a sleep leaves
alone). Wake-up may come in steps (`tags=weights`, the trainer's push, `tags=kv_cache`): each
kept tensor is copied back when its own pool wakes, into the tensor that holds its place then
(the same object, or the one vLLM rebuilt there at wake-up), so every alias and captured CUDA
graph sees its old values. Runtime buffers come back with their pre-sleep contents, which the
next step overwrites anyway.

`digest` is the same walk as checksums: what `GET /v1/draft/digest` answers, to see that a
push landed or what a sleep lost.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class Place:
    """Where a tensor lives: `owner`'s parameter, buffer or plain attribute `key`."""

    owner: Any
    kind: str  # "param" | "buffer" | "attr"
    key: str

    def get(self) -> torch.Tensor | None:
        if self.kind == "param":
            return self.owner._parameters.get(self.key)
        if self.kind == "buffer":
            return self.owner._buffers.get(self.key)
        value = vars(self.owner).get(self.key)
        return value if isinstance(value, torch.Tensor) else None


def storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta or otherwise storage-less
        return 0


def target_storages(target: nn.Module) -> set[int]:
    """The storages of the target's parameters and buffers (a draft's tensors sharing one are
    the target's, e.g. a shared embedding)."""
    return {p for t in [*target.parameters(), *target.buffers()] if (p := storage_ptr(t))}


def module_tensors(model: nn.Module, attributes: bool = True) -> list[tuple[str, Place]]:
    """A module tree's tensors by name ("<module path>.<name>"): parameters, buffers and, with
    `attributes`, the tensors its modules keep as plain attributes (derived ones, aliases),
    never an attention layer's KV cache (no state, and a sleep's to drop). Meta and empty
    tensors included: the caller decides."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=True):
        base = f"{prefix}." if prefix else ""
        out += [
            (base + k, Place(module, "param", k))
            for k, v in module._parameters.items()
            if v is not None
        ]
        out += [
            (base + k, Place(module, "buffer", k))
            for k, v in module._buffers.items()
            if v is not None
        ]
        if attributes:
            out += [
                (base + k, Place(module, "attr", k))
                for k, v in vars(module).items()
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
                and "kv_cache" not in k
            ]  # fmt: skip
    return out


def draft_tensors(proposer: Any, drafter: nn.Module, target: nn.Module) -> dict[str, Place]:
    """Every tensor the draft reads that is not the target's, by name ("drafter.<module
    path>.<name>", "proposer.<attribute>"): the drafter's parameters, buffers and tensor
    attributes, the proposer's tensor attributes (`proposer` may be None). Left out: empty and
    meta tensors (nothing to keep) and the attention layers' KV cache (a sleep drops it; the
    draft's state is elsewhere)."""
    shared = target_storages(target)
    found: dict[str, Place] = {}

    def add(name: str, place: Place) -> None:
        t = place.get()
        if t is None or t.is_meta or not t.numel() or storage_ptr(t) in shared:
            return
        found[name] = place

    for name, place in module_tensors(drafter):
        add(f"drafter.{name}", place)
    if proposer is not None:
        for key, value in vars(proposer).items():
            if isinstance(value, torch.Tensor):
                add(f"proposer.{key}", Place(proposer, "attr", key))
    return found


def pool_tags() -> Callable[[int], str | None] | None:
    """A lookup from a device address to the tag of vLLM's sleep-mode memory pool holding it
    ("weights", "kv_cache"; None outside every pool: memory a sleep never touches), or None
    when the engine has no such allocator (vLLM's CPU build, sleep mode off)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:
        return None
    allocator = CuMemAllocator.instance
    if allocator is None or not allocator.pointer_to_data:
        return None
    spans = sorted((ptr, d.handle[1], d.tag) for ptr, d in allocator.pointer_to_data.items())
    starts = [s for s, _, _ in spans]

    def tag(ptr: int) -> str | None:
        i = bisect.bisect_right(starts, ptr) - 1
        return spans[i][2] if i >= 0 and ptr < spans[i][0] + spans[i][1] else None

    return tag


@dataclass
class SleepCopy:
    """The host copy of `draft_tensors` that a sleep can discard, taken before it, each
    written back when its pool wakes up."""

    saved: dict[str, tuple[Place, str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def take(
        cls, places: dict[str, Place], tag_of: Callable[[int], str | None] | None = None
    ) -> SleepCopy:
        """`tag_of` is `pool_tags()`: tensors outside every pool are not copied (a sleep
        leaves them be); without it every tensor is, as part of the weights."""
        saved = {}
        with torch.inference_mode():
            for name, place in places.items():
                t = place.get()
                assert t is not None
                tag = "weights" if tag_of is None else tag_of(storage_ptr(t))
                if tag is not None:
                    saved[name] = (place, tag, t.detach().to("cpu", copy=True))
        return cls(saved)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t in self.saved.values())

    def tags(self) -> set[str]:
        return {tag for _, tag, _ in self.saved.values()}

    def restore(self, tags: list[str] | None = None) -> list[str]:
        """Copy every kept tensor of the pools woken (`tags`; None: all) into the tensor that
        holds its place now, and forget it. Returns the names that could not be (gone, or a
        different shape or dtype), also logged."""
        missed = []
        with torch.inference_mode():
            for name, (place, tag, kept) in list(self.saved.items()):
                if tags is not None and tag not in tags:
                    continue
                del self.saved[name]
                live = place.get()
                if (
                    live is None
                    or live.is_meta
                    or (live.shape, live.dtype) != (kept.shape, kept.dtype)
                ):
                    missed.append(name)
                    continue
                live.data.copy_(kept)
        if missed:
            log.error("codraft: after wake-up, %d draft tensors could not be restored: %s",
                      len(missed), ", ".join(missed[:8]))  # fmt: skip
        return missed


def digest(places: dict[str, Place]) -> dict[str, dict[str, Any]]:
    """Per tensor: shape, dtype, device, and checksums (float64 sum and sum of squares; for
    integer tensors the integer sum) — equal digests mean equal values for every practical
    purpose, and a NaN shows."""
    out = {}
    with torch.inference_mode():
        for name, place in sorted(places.items()):
            t = place.get()
            assert t is not None
            if t.is_floating_point():
                d = t.detach().double()
                sums = {"sum": _number(d.sum()), "sum_sq": _number((d * d).sum())}
            else:
                sums = {"sum": int(t.detach().long().sum())}
            out[name] = {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "device": str(t.device),
                **sums,
            }
    return out


def _number(t: torch.Tensor) -> float | str:
    """A float JSON can carry: "nan", "inf" and "-inf" as strings."""
    x = float(t)
    return x if math.isfinite(x) else str(x)
