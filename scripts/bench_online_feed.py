"""What rank 0's batch feed costs the distributed online learner (codraft.learner.online.feed).

Rank 0 of `codraft learn --server` under torchrun draws every replica's batch and sends each
other rank its replica's whole batch (ids, positions, mask, boundaries, taps, last hidden
state). This drives `BatchFeed.send_batches` / `recv_batch` themselves in a real process group
(gloo on CPU, NCCL with --device cuda) for full-feature batches of a given geometry, and reports
per step: the bytes rank 0 sends, the seconds from the first send to the last rank's receipt,
and the bandwidth. Against the trainer's own step (docs/benchmarks.md) this says whether one
ingesting rank keeps up.

    .venv/bin/python scripts/bench_online_feed.py --world 2 --tokens 4096 --hidden 576
    torchrun --nproc-per-node 8 scripts/bench_online_feed.py --device cuda --tokens 16384 \\
        --hidden 4096 --cp 4 --out runs/feed_h200.json

Without torchrun it spawns `--world` gloo processes itself (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _batch(tokens: int, hidden: int, taps: int, dtype: torch.dtype, docs: int):
    from codraft.learner.data.packing import PackedBatch

    n = tokens // docs
    cu = torch.arange(0, docs + 1, dtype=torch.int32) * n
    return PackedBatch(
        input_ids=torch.randint(0, 1000, (n * docs,)),
        positions=torch.arange(n).repeat(docs),
        cu_seqlens=cu,
        loss_mask=torch.ones(n * docs, dtype=torch.uint8),
        doc_lens=torch.full((docs,), n, dtype=torch.int32),
        taps=torch.randn(n * docs, taps * hidden).to(dtype),
        last_hidden=torch.randn(n * docs, hidden).to(dtype),
    )


def measure(rank: int, world: int, args: dict) -> dict:
    from codraft.learner.online.feed import BatchFeed
    from codraft.learner.parallel.mesh import ParallelDims, ParallelMesh

    device = torch.device(args["device"], int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cpu":
        device = torch.device("cpu")
    mesh = ParallelMesh.build(ParallelDims(world, cp=args["cp"]))
    feed = BatchFeed(mesh, device)
    dtype = getattr(torch, args["dtype"])
    batches = [
        _batch(args["tokens"], args["hidden"], args["taps"], dtype, args["docs"])
        for _ in range(mesh.dp_size)
    ] if rank == 0 else None  # fmt: skip
    times = []
    for i in range(args["warmup"] + args["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            feed.bytes_sent = 0
            feed.send_batches(batches)
        else:
            feed.recv_batch()
        dist.barrier()  # the step's transfers are over on every rank
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    return {"seconds": times, "bytes": feed.bytes_sent if rank == 0 else 0}


def _spawned(rank: int, world: int, args: dict) -> dict:
    return measure(rank, world, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per replica's batch")
    p.add_argument("--hidden", type=int, default=576, help="target hidden size")
    p.add_argument("--taps", type=int, default=3, help="tap layers")
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="feature dtype on the wire")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="write the report here (JSON)")
    a = p.parse_args(argv)
    args = vars(a)
    if "RANK" in os.environ:  # under torchrun
        from codraft.learner.parallel.launch import ParallelConfig, init_distributed

        init_distributed(ParallelConfig(cp=a.cp, device="auto" if a.device == "cuda" else "cpu"))
        res = measure(dist.get_rank(), dist.get_world_size(), args)
        world = dist.get_world_size()
        if dist.get_rank() != 0:
            return 0
    else:
        from codraft.learner.parallel.spawn import run_world

        world = a.world
        res = run_world(_spawned, world, args)[0]
    secs = statistics.median(res["seconds"])
    report = {
        "command": " ".join(["python", *sys.argv]),
        "backend": "nccl" if a.device == "cuda" else "gloo",
        "world": world,
        "cp": a.cp,
        "tokens_per_replica": a.tokens,
        "hidden": a.hidden,
        "taps": a.taps,
        "dtype": a.dtype,
        "bytes_sent_per_step": res["bytes"],
        "seconds_per_step_median": secs,
        "seconds_per_step": res["seconds"],
        "gb_per_s": res["bytes"] / secs / 1e9,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "seconds_per_step"}, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
