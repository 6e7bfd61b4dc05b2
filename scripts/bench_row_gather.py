"""What the row gather (codraft.server.row_copy.RowCopier.copy) costs the engine's thread, on a GPU.

On the H200 at Llama-8B geometry the hooks' record took 352 us a step with the tap on, of which
the gather was 265 us, against 84 us for the whole record with the tap sending ids only
(docs/bench/gpu_graphs_scale_repeats_h200.json). The gather is a handful of tensor operations
on the engine's stream, so this drives the product's RowCopier alone, at the scale run's
geometry (hidden 4,096, 3 tap layers, bf16, batch B with k = 3: 4B rows a step), to see where
that time goes:

* arms: "alone" (copy() in a loop, the staged rows dropped at once), "feed" (a thread takes
  every step's rows to the host through StagedRows.to_host() and copies them out, as the tap's
  feed thread does), "busy" (a thread running pure Python, holding the interpreter lock as an
  assembling thread would);
* per arm: the engine thread's host microseconds per copy() call (median and p90), and the same
  for each of the primitives copy() is made of, timed on the same tensors in the "alone" setting.

Only torch and numpy are needed; without codraft installed the module is loaded from its file.

    python3 scripts/bench_row_gather.py --out runs/bench_row_gather.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import queue
import statistics
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_row_copy() -> Any:
    try:
        from codraft.server import row_copy
    except ImportError:  # the GPU machine before install: load the files it needs
        for name in ("host_stage", "device_ring", "row_copy"):  # each imports those before it
            full = f"codraft.server.{name}"
            spec = importlib.util.spec_from_file_location(full, ROOT / "server" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module  # for the import, and dataclasses look their module up
            spec.loader.exec_module(module)
        row_copy = sys.modules["codraft.server.row_copy"]
    return row_copy


def stats_us(ns: list[int]) -> dict[str, float]:
    ns = sorted(ns)
    return {"median_us": statistics.median(ns) / 1e3, "p90_us": ns[int(0.9 * len(ns))] / 1e3}


def forward_inputs(rows: int, hidden: int, taps: int, dev: torch.device) -> tuple:
    """Stand-ins for a step's forward outputs (static buffers, bf16) and inputs."""
    ids = torch.randint(0, 128_000, (rows + 64,), device=dev, dtype=torch.int32)
    pos = torch.arange(rows + 64, device=dev, dtype=torch.int64)
    aux = [torch.randn(rows + 64, hidden, device=dev, dtype=torch.bfloat16) for _ in range(taps)]
    last = torch.randn(rows + 64, hidden, device=dev, dtype=torch.bfloat16)
    return ids, pos, aux, last


def run_arm(rc: Any, arm: str, rows: int, fwd: tuple, steps: int, dev: torch.device) -> dict:
    copier = rc.RowCopier(dev, torch.bfloat16, 1 << 30)
    ids, pos, aux, last = fwd
    work = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)  # keeps the GPU busy
    handoff: queue.Queue = queue.Queue(maxsize=8)
    stop = threading.Event()

    def feed() -> None:
        out = np.empty(0, dtype=np.uint8)
        while True:
            staged = handoff.get()
            if staged is None:
                return
            staged.to_host()
            nbytes = staged.taps.numel() * 2 + staged.last.numel() * 2
            if out.nbytes < nbytes:
                out = np.empty(nbytes, dtype=np.uint8)
            out[: staged.taps.numel() * 2] = staged.taps.view(torch.uint8).numpy().reshape(-1)

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i * i

    helper = {"feed": feed, "busy": busy}.get(arm)
    thread = threading.Thread(target=helper, daemon=True) if helper else None
    if thread:
        thread.start()
    times = []
    for step in range(steps):
        torch.mm(work, work)  # the step's forward, queued ahead as under async scheduling
        t0 = time.perf_counter_ns()
        staged = copier.copy(ids, pos, aux, last, [(0, rows)])
        times.append(time.perf_counter_ns() - t0)
        if arm == "feed":
            handoff.put(staged)
        del staged
        if step % 32 == 31:
            torch.cuda.synchronize(dev)
    stop.set()
    if arm == "feed":
        handoff.put(None)
    if thread:
        thread.join()
    torch.cuda.synchronize(dev)
    return stats_us(times[steps // 10 :])


def primitives(rows: int, fwd: tuple, steps: int, dev: torch.device) -> dict:
    """Host time of each operation copy() is made of, on the same tensors."""
    ids, pos, aux, last = fwd
    views = [t[:rows] for t in aux]
    ops = {
        "slice x6": lambda: (ids[:rows], pos[:rows], last[:rows], *[t[:rows] for t in aux]),
        "cat of the tap layers": lambda: torch.cat(views, dim=-1),
        "last.to(copy=True)": lambda: last[:rows].to(torch.bfloat16, copy=True),
        "ids.to(int32, copy=True)": lambda: ids[:rows].to(torch.int32, copy=True),
        "pos.to(int64, copy=True)": lambda: pos[:rows].to(torch.int64, copy=True),
        "Event(blocking=True)": lambda: torch.cuda.Event(blocking=True),
        "Event + record": lambda: torch.cuda.Event(blocking=True).record(),
        "empty [rows, 4H] bf16": lambda: torch.empty(
            rows, 4 * last.shape[1], device=dev, dtype=torch.bfloat16
        ),  # fmt: skip
        "weakref.finalize": lambda: weakref.finalize(views[0], int),
    }
    out = {}
    for name, op in ops.items():
        times = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            op()
            times.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize(dev)
        out[name] = stats_us(times[steps // 10 :])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench_row_gather.json")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--taps", type=int, default=3)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--arms", default="alone,feed,busy")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_row_gather needs a CUDA device (on the CPU the gather is the copy)")
    dev = torch.device("cuda", 0)
    rc = load_row_copy()
    report: dict = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "geometry": {"hidden": args.hidden, "taps": args.taps, "k": args.k, "dtype": "bf16"},
        "switch_interval_s": sys.getswitchinterval(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "batches": {},
    }
    for b in (int(x) for x in args.batches.split(",")):
        rows = b * (args.k + 1)
        fwd = forward_inputs(rows, args.hidden, args.taps, dev)
        row = {"rows": rows}
        for arm in args.arms.split(","):
            row[arm] = run_arm(rc, arm, rows, fwd, args.steps, dev)
        print(f"b{b} ({rows} rows): " + ", ".join(
            f"{a} {row[a]['median_us']:.1f}/{row[a]['p90_us']:.1f} us"
            for a in args.arms.split(",")), flush=True)  # fmt: skip
        row["primitives"] = primitives(rows, fwd, args.steps, dev)
        report["batches"][b] = row
        for name, s in row["primitives"].items():
            print(f"    {name:28s} {s['median_us']:7.1f} / {s['p90_us']:7.1f} us")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
