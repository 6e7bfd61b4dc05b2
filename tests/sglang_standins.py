"""SGLang's objects as far as codraft's SGLang engine (codraft.server.sglang.engine) reads them,
for where SGLang cannot run (no CPU build of its kernels reaches this machine; docs/sglang.md):
the scheduler's speculative workers (by their class names), the draft model, a request and the
forward mode, with the attributes codraft reads from SGLang 0.5.17. Used by
tests/test_sglang_engine.py and scripts/bench_sglang_hooks.py; on the GPU the plugin's hooks call
the same engine methods with SGLang's own objects (scripts/gpu_sglang/engine_checks.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


class EAGLEWorkerV2:  # the name codraft checks: SGLang's EAGLE worker v2
    def __init__(self, target_runner, draft_model):
        self.target_worker = SimpleNamespace(model_runner=target_runner)
        self.draft_worker = SimpleNamespace(draft_runner=SimpleNamespace(model=draft_model))


class DFlashWorkerV2:  # SGLang's DFlash worker, by name
    pass


class DraftModel(torch.nn.Module):
    """SGLang's EAGLE-3 draft, reduced to what codraft uses: parameters under the checkpoint's
    names (SGLang renames them; its `load_weights` maps them back) and `load_weights`, which
    copies into the existing parameters and skips d2t/t2d as SGLang's does."""

    def __init__(self, tensors: dict[str, torch.Tensor], embed: torch.nn.Parameter) -> None:
        super().__init__()
        self.names = {}
        for name, t in tensors.items():
            if name in ("d2t", "t2d"):
                continue
            key = name.replace(".", "__")
            self.names[name] = key
            self.register_parameter(key, torch.nn.Parameter(t.clone(), requires_grad=False))
        self.embed = embed  # the target's, shared (SGLang's set_embed)

    skip: frozenset[str] = frozenset()  # names this loader does not know (SGLang skips them)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name in ("d2t", "t2d") or name in self.skip:
                continue
            param = getattr(self, self.names[name])
            getattr(param, "weight_loader", _default_loader)(param, t)


def _default_loader(param: torch.Tensor, w: torch.Tensor) -> None:
    param.data.copy_(w)


class Req:
    def __init__(self, rid: str, prompt: list[int]) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, []
        self.done = False

    def finished(self) -> bool:
        return self.done


class Mode:
    """SGLang's ForwardMode as far as codraft asks it: a step's batch is EXTEND or DECODE; the
    verification's forward batch is TARGET_VERIFY, which SGLang counts among the extend modes."""

    def __init__(self, name: str) -> None:
        self.name = name

    def is_extend(self) -> bool:
        return self.name in ("EXTEND", "TARGET_VERIFY")

    def is_target_verify(self) -> bool:
        return self.name == "TARGET_VERIFY"

    def __str__(self) -> str:
        return self.name
