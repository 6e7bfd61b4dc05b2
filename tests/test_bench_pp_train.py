"""`scripts/bench_pp_train.py --smoke` under torchrun, world 2 (gloo, CPU, tiny target): the
benchmark of issue 10 runs all three modes (no taps, TapChannel, host staging) for two microbatch
counts, and its non-interference check finds the pipeline's results bitwise identical in all.

The same run with `--share-gpu` forces the single-GPU mode's transport on CPU: every transfer
(activations, taps, credits, the script's all-reduces) is staged through a host copy
(`codraft.learner.parallel.host_staged`), and the JSON says the times are not NCCL figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "tapchannel", "host")
CHECKED = ("stage_activations", "last_hidden", "logits", "teacher_logits", "taps", "draft_loss")


def _smoke(tmp_path: Path, *extra: str) -> tuple[str, dict[str, Any]]:
    """Run the smoke benchmark; its stdout and JSON, after the checks every mode shares."""
    out = tmp_path / "smoke.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(ROOT / "scripts" / "bench_pp_train.py"), "--smoke", "--out", str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "identical in all modes" in done.stdout

    got = json.loads(out.read_text())
    assert got["pp"] == 2 and got["passed"] is True
    assert got["tap_sources"] == [0] and got["tap_bytes_per_step"] > 0
    assert [r["microbatches"] for r in got["records"]] == [2, 4]
    for r in got["records"]:
        assert r["microbatches_run"] == r["microbatches"]
        for mode in MODES:
            step = r["step_s"][mode]
            assert step["n"] == got["steps"] and 0 < step["p10"] <= step["median"] <= step["p90"]
        off, tc = r["step_s"]["off"]["median"], r["step_s"]["tapchannel"]["median"]
        assert math.isclose(r["tapchannel_overhead"], tc / off - 1)
        for mode in ("tapchannel", "host"):
            assert r["transfer_s"][mode]["median"] > 0
            assert r["get_wait_s_per_step"][mode]["host_clock_s"]["n"] == got["steps"]
        assert r["speedup_transfer"] > 0 and r["speedup_step"] > 0
        for mode in ("off", "host"):
            flags = r["identical"][mode]
            assert all(flags[k] is True for k in CHECKED), (r["microbatches"], mode, flags)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return done.stdout, got
    assert out.with_suffix(".png").stat().st_size > 0
    return done.stdout, got


def test_bench_pp_train_smoke(tmp_path: Path) -> None:
    stdout, got = _smoke(tmp_path)
    how = got["transport"]
    assert how["mode"] == "gloo" and how["backend"] == "gloo"
    assert how["host_staged"] is False and how["staged_on_this_rank"] is None
    assert "transport: gloo" in stdout


def test_bench_pp_train_smoke_host_staged(tmp_path: Path) -> None:
    """The single-GPU mode's transport, forced on CPU tensors: the same checks pass, and the
    run says that its times are not NCCL figures."""
    stdout, got = _smoke(tmp_path, "--share-gpu")
    how = got["transport"]
    assert how["mode"] == "cpu_host_staged_gloo" and how["backend"] == "gloo"
    assert how["host_staged"] is True and how["nccl_figures"] is False
    staged = how["staged_on_this_rank"]  # the last stage: activations in, taps in, credits out
    assert staged["transfers"] > 0 and staged["bytes"] > 0
    assert "transport: cpu_host_staged_gloo" in stdout
