"""An EAGLE-3 draft's weights inside SGLang: written in place, kept for rollback.

SGLang (0.5.17) has no draft-only weight update (docs/sglang.md), so codraft writes a checked
codraft checkpoint into SGLang's draft model itself, through the model's own `load_weights`
(SGLang's name mapping: `midlayer.` -> `layers.0.`, q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`), which copies into the existing parameters: the draft's CUDA graphs keep
reading the same memory. What codraft does not write:

* tensors the draft shares with the target (SGLang gives an EAGLE-3 draft the target's
  embedding): writing them would change the target;
* `d2t`/`t2d`: SGLang turns `d2t` into the token map it samples with when the draft loads and
  never reads it again, so a draft with another vocabulary map is refused.

Before a write the draft's own parameters are copied on the device (one draft's worth, a few
MB to a few hundred MB): the rollback copy, and what is put back when a write fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from codraft.server.sleep_copy import storage_ptr, target_storages
from codraft.server.weights import SwapError

NOT_WRITTEN = ("d2t", "t2d")


def owned_parameters(draft: Any, target: Any) -> dict[str, torch.Tensor]:
    """The draft model's parameters that are not the target's (shared storages excluded)."""
    shared = target_storages(target)
    return {name: p for name, p in draft.named_parameters() if storage_ptr(p) not in shared}


class DraftWeights:
    """The serving draft's parameters (`owned_parameters`) and how to replace them."""

    def __init__(self, draft: Any, target: Any, d2t: torch.Tensor | None) -> None:
        self.draft = draft
        self.params = owned_parameters(draft, target)
        if not self.params:
            raise SwapError(503, "the SGLang draft model has no parameters of its own")
        self.d2t = None if d2t is None else d2t.detach().cpu()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A device copy of every owned parameter."""
        return {name: p.detach().clone() for name, p in self.params.items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(saved[name])
        _sync(self.params)

    def check_maps(self, tensors: dict[str, torch.Tensor]) -> None:
        d2t = tensors.get("d2t")
        if (d2t is None) != (self.d2t is None) or (
            d2t is not None and not torch.equal(d2t.cpu(), self.d2t)
        ):
            raise SwapError(
                422,
                "the draft's vocabulary map (d2t) differs from the serving draft's: SGLang "
                "samples with the map it started with; train the draft with the same map or "
                "restart the server with it",
            )

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write a checked checkpoint's tensors (checkpoint names); on any failure the
        previous values are put back and SwapError(500) is raised."""
        self.check_maps(tensors)
        saved = self.snapshot()
        _sync(self.params)  # nothing of a step still reads them while they change
        try:
            with torch.no_grad(), self._recording() as written:
                self.draft.load_weights(_written(tensors))
            missing = sorted(set(self.params) - written)
            if missing:  # SGLang's loader skips names it does not know, silently
                raise ValueError(f"the checkpoint wrote none of the draft's {missing[:4]}")
            bad = [n for n, p in self.params.items() if not bool(torch.isfinite(p).all())]
            if bad:
                raise ValueError(f"not finite after the write: {bad[:4]}")
            _sync(self.params)
        except Exception as e:
            self.restore(saved)
            raise SwapError(500, f"writing the draft failed ({e}); previous draft restored") from e
        self.saved = saved

    @contextmanager
    def _recording(self) -> Iterator[set[str]]:
        """Which owned parameters a `load_weights` writes: SGLang's loaders call each
        parameter's `weight_loader` (the default loader when it has none), wrapped here."""
        written: set[str] = set()
        before = {name: p.__dict__.get("weight_loader") for name, p in self.params.items()}
        for name, p in self.params.items():
            inner = before[name] or _copy

            def loader(param: Any, w: torch.Tensor, *a: Any, _n=name, _f=inner) -> Any:
                written.add(_n)
                return _f(param, w, *a)

            p.weight_loader = loader
        try:
            yield written
        finally:
            for name, p in self.params.items():
                if before[name] is None:
                    del p.weight_loader
                else:
                    p.weight_loader = before[name]

    def take_saved(self) -> dict[str, torch.Tensor]:
        """The copy `write` made of the draft it replaced (for a rollback)."""
        saved, self.saved = self.saved, None
        return saved


def _written(tensors: dict[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    return ((n, t) for n, t in tensors.items() if n not in NOT_WRITTEN)


def _copy(param: torch.Tensor, w: torch.Tensor, *shard: Any) -> None:
    """What SGLang's default weight loader does for an unsharded parameter."""
    if shard or param.shape != w.shape:
        raise ValueError(f"a {tuple(w.shape)} tensor for a {tuple(param.shape)} parameter")
    param.data.copy_(w)


def _sync(params: dict[str, torch.Tensor]) -> None:
    first = next(iter(params.values()))
    if first.is_cuda:
        torch.cuda.synchronize(first.device)
