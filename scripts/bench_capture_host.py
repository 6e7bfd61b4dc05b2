"""What assembling the tap's messages takes from the engine's thread, on the host alone.

vLLM's engine loop is host-bound at large batches, and every thread of its process shares one
interpreter lock. This drives codraft's own tap code on synthetic steps of a given geometry
(default: Llama-8B width, 3 tap layers, bf16 on the wire, 64 requests of 4 final rows a step,
100-token prompts, 120 outputs each) beside a stand-in for the engine thread (a loop of small
torch operations, each of which gives up the lock and takes it back, as the engine's calls do),
with the messages sent over ZeroMQ to a receiver in a process of its own. Arms, alternated
`--repeats` times (medians reported): "idle" (the engine loop alone), "thread" (the Assembler
thread and the publisher in the engine's process: `tap_assembly = "thread"`) and "process"
(codraft.server.tap_process: the engine's process only copies each step's final rows into a
pipe; the default). Per arm: the engine loop's time per step, and the time until everything it
captured was received. No GPU: the device-to-host copy is not part of it (on the CPU the rows
are on the host already).

    .venv/bin/python scripts/bench_capture_host.py --out runs/bench_capture_host.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from codraft.server.capture import (
    Assembler,
    CaptureStats,
    ReqState,
    StopRule,
    TapTarget,
    _Finish,
    _Rows,
)
from codraft.server.publisher import TapPublisher
from codraft.server.row_copy import StagedRows
from codraft.server.tap_process import RemotePublisher, TapProcess


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


def _receive(endpoint: str, count: Any, stop: Any) -> None:
    """The learner's side, in a process of its own: a PULL socket counting bytes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    while not stop.is_set():
        if sock.poll(100):
            frames = sock.recv_multipart(copy=False)
            with count.get_lock():
                count.value += sum(len(f.buffer) for f in frames)
    sock.close(linger=0)
    ctx.term()


def run(args: argparse.Namespace, arm: str, endpoint: str, received: Any) -> dict:
    """One arm: "idle" (the engine loop alone), "thread" (assembly and publisher in this
    process, as with tap_assembly = "thread") or "process" (the tap process)."""
    steps = make_steps(args)
    target = TapTarget(tuple(range(args.taps)), args.hidden, "bench", torch.bfloat16, 4096)
    stats = CaptureStats()
    pub_args = dict(queue_size=4096, hwm=4096, linger_ms=5000)
    asm = pub = None
    if arm == "thread":
        pub = TapPublisher(endpoint, **pub_args)
        asm = Assembler(target, pub.put, lambda: 0, 8192, stats)
    elif arm == "process":
        asm = TapProcess(target, None, lambda: 0, 8192, stats)
        pub = RemotePublisher(asm, endpoint, **pub_args)
        # a serving engine's tap process is up long before a step is timed: its start (an
        # interpreter importing torch, about a second) is not a step's cost
        if not asm.flush(600):
            raise RuntimeError("the tap process did not answer its first flush within 600 s")
    before = received.value
    t0 = time.perf_counter()
    for step in steps:
        engine_step(args.engine_ops)
        if asm is not None:
            for op in step:
                asm.put(op)
    engine = time.perf_counter() - t0
    sent = 0
    if asm is not None:
        asm.flush(600)
        pub.flush(600)
        sent = pub.totals().bytes_sent
        while received.value - before < sent and time.perf_counter() - t0 < 600:
            time.sleep(0.01)
    total = time.perf_counter() - t0
    if asm is not None:
        pub.close()
        asm.close()
    n = len(steps)
    return {"engine_ms_per_step": engine / n * 1e3, "all_done_ms_per_step": total / n * 1e3,
            "bytes_sent": sent, "messages_built": stats.messages_built}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    mp = multiprocessing.get_context("spawn")
    received, stop = mp.Value("q", 0), mp.Event()
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    receiver = mp.Process(target=_receive, args=(endpoint, received, stop), daemon=True)
    receiver.start()
    arms = ("idle", "thread", "process")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    try:
        for _ in range(args.repeats):
            for a in arms:
                runs[a].append(run(args, a, endpoint, received))
    finally:
        stop.set()
        receiver.join(5)
    med = {a: statistics.median(r["engine_ms_per_step"] for r in runs[a]) for a in arms}
    done = {a: statistics.median(r["all_done_ms_per_step"] for r in runs[a]) for a in arms}
    step_bytes = args.batch * args.rows * (args.taps + 1) * args.hidden * 2
    report = {
        "command": " ".join(
            ["python scripts/bench_capture_host.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "geometry": {k: getattr(args, k) for k in ("hidden", "taps", "batch", "rows", "life")},
        "feature_bytes_per_step": step_bytes,
        "engine_ms_per_step": med,
        "engine_slowdown": {a: med[a] / med["idle"] for a in ("thread", "process")},
        "all_sent_ms_per_step": done,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
