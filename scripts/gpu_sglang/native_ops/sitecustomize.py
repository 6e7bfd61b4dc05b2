"""Check-side shim for `engine_checks.py --dtype float32`: on PYTHONPATH, Python imports it in
every process SGLang starts. sgl_kernel has no float32 kernel for some of SGLang's ops (its
rmsnorm fails with "failed to dispatch data type Float"), so the op classes named in
CODRAFT_CHECK_NATIVE_OPS (comma-separated) run SGLang's own torch implementation of the op
(`forward_native`) whenever a float32 tensor comes in; other dtypes keep the CUDA kernels.
Every arm of a check runs with the same shim, stock SGLang's as much as codraft's. Not part of
codraft: nothing in the product imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any

# where SGLang 0.5.17 defines each op class the shim may touch
MODULES = {
    "sglang.srt.layers.layernorm": ("RMSNorm",),
    "sglang.srt.layers.activation": ("SiluAndMul",),
    "sglang.srt.layers.rotary_embedding.base": ("RotaryEmbedding",),
}
WANTED = frozenset(n for n in os.environ.get("CODRAFT_CHECK_NATIVE_OPS", "").split(",") if n)


def _floats(args: tuple, kwargs: dict) -> bool:
    import torch

    return any(
        isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in (*args, *kwargs.values())
    )


def patch(module: Any) -> list[str]:
    """Route the wanted op classes of `module` to forward_native on float32; their names."""
    done = []
    for name in MODULES.get(module.__name__, ()):
        cls = getattr(module, name, None)
        if name not in WANTED or cls is None:
            continue
        cuda = cls.forward_cuda

        def forward_cuda(self: Any, *args: Any, _cuda: Any = cuda, **kwargs: Any) -> Any:
            if _floats(args, kwargs):
                return self.forward_native(*args, **kwargs)
            return _cuda(self, *args, **kwargs)

        cls.forward_cuda = forward_cuda  # bound by each instance when it is built
        done.append(f"{module.__name__}.{name}")
    if done:
        print(f"codraft check shim: float32 through forward_native: {done}", file=sys.stderr)
    return done


class _Finder(importlib.abc.MetaPathFinder):
    """Patches each module of MODULES right after it is executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if WANTED:
    sys.meta_path.insert(0, _Finder())
