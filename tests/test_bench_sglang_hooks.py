"""`scripts/bench_sglang_hooks.py` at a small size: every arm runs, and through both tap
placements every request of every generation (warm-up included) is captured and sent, none
incomplete, so the timings it reports are of a tap that worked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_hooks_benchmark_captures_every_request_in_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "hooks.json"
    batch, generations = 4, 1
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_sglang_hooks.py"), "--out", str(out),
           "--batch", str(batch), "--generations", str(generations), "--life", "4",
           "--repeats", "1", "--host-ms", "1", "--gpu-ms", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got = json.loads(out.read_text())
    assert set(got["median"]) == {"none", "process", "thread"}
    assert set(got["added_ms_per_step"]) == {"process", "thread"}
    requests = batch * (generations + 1)
    for arm in ("process", "thread"):
        (run,) = got["runs"][arm]
        tap = run["tap"]
        assert tap["requests_captured"] == tap["messages_sent"] == requests, (arm, tap)
        assert tap["requests_incomplete"] == tap["requests_inconsistent"] == 0, (arm, tap)
        assert run["launch_hooks_ms"] > 0 and run["prefill_step_ms"] > 0, run
    assert got["runs"]["none"][0]["tap"] is None
