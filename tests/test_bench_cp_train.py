"""`scripts/bench_cp_train.py` (issue 9): the CP training-step benchmark must not rot.

* ``--smoke`` under torchrun at world 2 (gloo, CPU, tiny draft): every case's ring step and
  gather-baseline step match the single-process step (loss and draft gradients), every step
  and attention-only measurement is recorded, and ``--combine`` turns the records into rows;
* the summary's arithmetic on made-up records: strong-scaling efficiency against the smallest
  CP that fitted, ring vs gather ratios, the attention's share, OOM cases left empty.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_cp_train.py"


@cache
def _module():
    spec = importlib.util.spec_from_file_location("bench_cp_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_bench_cp_train_smoke_world2(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--smoke", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    records = json.loads(out.read_text())
    cases = {(r["tokens"], r["layout"]) for r in records}
    assert cases == {(t, lay) for t in (96, 160) for lay in ("packed", "single")}
    checks = [r for r in records if r["kind"] == "check"]
    assert len(checks) == len(cases)
    for r in checks:
        for key in ("ring_loss_rel_err", "ring_grad_rel_err", "gather_loss_rel_err"):
            assert r[key] < 1e-4, (r["tokens"], r["layout"], key, r[key])
        assert r["gather_grad_rel_err"] < 1e-4, r
    for kind in ("step", "attention"):
        got = [r for r in records if r["kind"] == kind]
        assert {(r["tokens"], r["layout"], r["method"]) for r in got} == {
            (*c, m) for c in cases for m in ("ring", "gather")
        }
        for r in got:
            assert r["cp"] == 2 and r["status"] == "ok" and r["ms"] > 0
            assert len(r["ms_steps"]) == 2 and r["docs"] == (3 if r["layout"] == "packed" else 1)

    summary = tmp_path / "summary.json"
    combine = [sys.executable, str(SCRIPT), "--combine", str(out), "--out", str(summary)]
    done = subprocess.run(combine, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| layout | tokens | CP |" in done.stdout
    rows = json.loads(summary.read_text())
    assert len(rows) == len(cases)
    for row in rows:
        assert row["cp"] == 2 and row["ring_eff"] == 1.0 and row["attn_ring_eff"] == 1.0
        assert 0 < row["attn_share_ring"] and row["time_ratio_gather_over_ring"] > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").stat().st_size > 0
    assert summary.with_suffix(".png").stat().st_size > 0


def _rec(kind: str, method: str, cp: int, ms: float | None, peak: float = 0.0) -> dict:
    base = {"kind": kind, "method": method, "cp": cp, "tokens": 1024, "layout": "single"}
    if ms is None:
        return {**base, "status": "oom"}
    return {**base, "status": "ok", "ms": ms, "peak_gib": peak, "extra_gib": peak / 2}


def test_summary_efficiency_and_ratios() -> None:
    mod = _module()
    records = [
        _rec("step", "plain", 1, 90.0, 70.0),
        _rec("step", "ring", 1, 100.0, 80.0),
        _rec("step", "ring", 2, 55.0, 40.0),
        _rec("step", "ring", 8, 16.0, 10.0),
        _rec("step", "gather", 1, None),  # did not fit: its efficiency starts at CP 2
        _rec("step", "gather", 2, 60.0, 50.0),
        _rec("step", "gather", 8, 20.0, 27.0),
        _rec("attention", "ring", 1, 40.0, 8.0),
        _rec("attention", "ring", 8, 5.0, 1.0),
        _rec("attention", "gather", 8, 6.0, 3.0),
    ]
    rows = {r["cp"]: r for r in mod.summarize(records)}
    assert sorted(rows) == [1, 2, 8]
    assert math.isclose(rows[2]["ring_eff"], 100 / (2 * 55))
    assert math.isclose(rows[8]["ring_eff"], 100 / (8 * 16))
    assert math.isclose(rows[8]["ring_eff_vs_plain_cp1"], 90 / (8 * 16))
    assert rows[1]["gather_ms"] is None and rows[1]["gather_eff"] is None
    assert math.isclose(rows[8]["gather_eff"], 2 * 60 / (8 * 20))
    assert math.isclose(rows[8]["time_ratio_gather_over_ring"], 20 / 16)
    assert math.isclose(rows[8]["mem_ratio_gather_over_ring"], 27 / 10)
    assert math.isclose(rows[8]["attn_share_ring"], 5 / 16)
    assert math.isclose(rows[8]["attn_ring_eff"], 40 / (8 * 5))
    assert math.isclose(rows[8]["attn_mem_ratio_gather_over_ring"], 3.0)
    assert rows[2]["attn_ring_ms"] is None and rows[2]["attn_ring_eff"] is None
    assert "OOM/-" in mod.table(list(rows.values()))


def test_doc_lengths_are_one_batch_for_every_cp() -> None:
    mod = _module()
    for tokens in (65536, 262144):
        lengths = mod.doc_lengths(tokens, "packed", 8, 16)
        assert sum(lengths) == tokens and len(lengths) == 8
        assert all(n > 0 and n % 16 == 0 for n in lengths)
        assert mod.doc_lengths(tokens, "single", 8, 16) == [tokens]
