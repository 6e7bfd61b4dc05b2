"""The check-side shim of `scripts/gpu_sglang/engine_checks.py --dtype float32`
(scripts/gpu_sglang/native_ops/sitecustomize.py), here with a stand-in for SGLang's layernorm
module (SGLang itself runs on CUDA machines only): in a fresh interpreter with the shim on
PYTHONPATH, an op class named in CODRAFT_CHECK_NATIVE_OPS runs its torch implementation on
float32 input and keeps its CUDA path on bf16; unnamed, nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1] / "scripts" / "gpu_sglang" / "native_ops"

STAND_IN = """
class RMSNorm:
    def __init__(self):
        self._forward_method = self.forward_cuda  # SGLang binds its path when an op is built
    def forward(self, x):
        return self._forward_method(x)
    def forward_native(self, x):
        return "native"
    def forward_cuda(self, x):
        return "cuda"
"""

PROBE = """
import torch
from sglang.srt.layers.layernorm import RMSNorm
op = RMSNorm()
print(*(op.forward(torch.ones(2, dtype=t)) for t in (torch.float32, torch.bfloat16)))
"""


def run(tmp_path: Path, wanted: str) -> str:
    pkg = tmp_path / "sglang" / "srt" / "layers"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (pkg.parents[1], pkg.parent, pkg):
        (d / "__init__.py").touch()
    (pkg / "layernorm.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(tmp_path)]),
           "CODRAFT_CHECK_NATIVE_OPS": wanted}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    return done.stdout.split()


def test_float32_goes_through_the_torch_implementation_of_the_named_ops(tmp_path: Path) -> None:
    assert run(tmp_path, "RMSNorm,SiluAndMul") == ["native", "cuda"]


def test_ops_not_named_keep_their_kernels(tmp_path: Path) -> None:
    assert run(tmp_path, "SiluAndMul") == ["cuda", "cuda"]
    assert run(tmp_path, "") == ["cuda", "cuda"]
