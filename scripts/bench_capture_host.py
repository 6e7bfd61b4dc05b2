"""What the tap's capture thread takes from the engine's thread, on the host alone.

codraft's capture thread (codraft.server.capture.Assembler) shares the engine's process, and so
its interpreter lock, with vLLM's engine loop, which is host-bound at large batches. This runs
the real Assembler (messages built, checked and encoded as the publisher would send them) on
synthetic steps of a given geometry (default: Llama-8B width, 3 tap layers, bf16 on the wire,
64 requests of 4 final rows a step, 100-token prompts, 120 outputs each), beside a stand-in for
the engine thread: a loop of small torch operations, each of which gives up the lock and takes it
back, as the engine's own calls do. Reported, medians over `--repeats` alternating runs: the
engine loop's time per step with the capture thread idle and busy, and the capture thread's own
time per step (how many steps a second it can keep up with). No GPU: the host copy from the
device is not part of it (on the CPU the rows are on the host already).

    .venv/bin/python scripts/bench_capture_host.py --out runs/bench_capture_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from codraft.server.capture import (
    Assembler,
    CaptureStats,
    ReqState,
    StopRule,
    TapTarget,
    _Finish,
    _Rows,
)
from codraft.server.row_copy import StagedRows
from codraft.tap.message import encode


def make_steps(args: argparse.Namespace) -> list[list]:
    """Every step's operations, built before anything is timed."""
    H, T, B, per, life = args.hidden, args.taps, args.batch, args.rows, args.life
    taps = torch.randn(B * per, T * H).to(torch.bfloat16)
    last = torch.randn(B * per, H).to(torch.bfloat16)
    steps = []
    for g in range(args.steps // life):
        states = [
            ReqState(
                f"r{g}-{i}", list(range(100)), None, 0, "full", StopRule(frozenset(), 0, 10**6)
            )
            for i in range(B)
        ]
        for st in states:
            st.outputs = [7] * (life * per)
        seqs = [st.prompt_ids + st.outputs for st in states]
        for s in range(life):
            pos = s * per
            ids = torch.tensor([q[pos + j] for q in seqs for j in range(per)], dtype=torch.int32)
            positions = torch.arange(per).repeat(B) + pos
            rows = StagedRows(ids, positions, taps.clone(), last.clone())
            step: list = [_Rows(rows, [(st, i * per, per) for i, st in enumerate(states)])]
            if s == life - 1:
                step += [_Finish(st, 0) for st in states]
            steps.append(step)
    return steps


def engine_step(ops: int) -> None:
    x = torch.zeros(8)
    for _ in range(ops):
        x = x + 1


def run(args: argparse.Namespace, capture: bool) -> dict:
    steps = make_steps(args)
    sent = [0]

    def emit(msg) -> None:
        sent[0] += sum(len(f) for f in encode(msg))

    target = TapTarget(tuple(range(args.taps)), args.hidden, "bench", torch.bfloat16, 4096)
    asm = Assembler(target, emit, lambda: 0, 8192, CaptureStats())
    t0 = time.perf_counter()
    for step in steps:
        engine_step(args.engine_ops)
        if capture:
            for op in step:
                asm.put(op)
    engine = time.perf_counter() - t0
    asm.flush(600)
    total = time.perf_counter() - t0
    asm.close()
    n = len(steps)
    return {"engine_ms_per_step": engine / n * 1e3, "all_done_ms_per_step": total / n * 1e3,
            "bytes_sent": sent[0]}  # fmt: skip


def capture_alone(args: argparse.Namespace) -> float:
    """The capture thread's own time per step, nothing beside it."""
    steps = make_steps(args)
    target = TapTarget(tuple(range(args.taps)), args.hidden, "bench", torch.bfloat16, 4096)
    asm = Assembler(target, lambda m: encode(m), lambda: 0, 8192, CaptureStats())
    t0 = time.perf_counter()
    for step in steps:
        for op in step:
            asm.put(op)
    asm.flush(600)
    dt = time.perf_counter() - t0
    asm.close()
    return dt / len(steps) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench_capture_host.json")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--taps", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rows", type=int, default=4, help="final rows per request per step")
    p.add_argument("--life", type=int, default=30, help="steps a request lives")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--engine-ops", type=int, default=400, help="torch ops per engine step")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"idle": [], "busy": []}
    for _ in range(args.repeats):
        runs["idle"].append(run(args, capture=False))
        runs["busy"].append(run(args, capture=True))
    alone = [capture_alone(args) for _ in range(args.repeats)]
    med = {k: statistics.median(r["engine_ms_per_step"] for r in v) for k, v in runs.items()}
    step_bytes = args.batch * args.rows * (args.taps + 1) * args.hidden * 2
    report = {
        "command": " ".join(
            ["python scripts/bench_capture_host.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "geometry": {k: getattr(args, k) for k in ("hidden", "taps", "batch", "rows", "life")},
        "feature_bytes_per_step": step_bytes,
        "engine_ms_per_step": med,
        "engine_slowdown": med["busy"] / med["idle"],
        "capture_ms_per_step_alone": statistics.median(alone),
        "capture_mb_per_s_alone": step_bytes / statistics.median(alone) / 1e3,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
