"""Run a function of (rank, world) -> {case: error} on every rank of a real gloo group and
collect, per case, the largest error over the ranks (rank 0 writes them; the caller reads)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Cases = Callable[[int, int], dict[str, float]]


def _worker(rank: int, cases: Cases, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        res = cases(rank, world)
        vals = torch.tensor(list(res.values()), dtype=torch.float64)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        if rank == 0:
            Path(out_file).write_text(json.dumps(dict(zip(res, vals.tolist(), strict=True))))
    finally:
        dist.destroy_process_group()


def max_over_ranks(cases: Cases, world: int) -> dict[str, float]:
    """`cases` (a module-level function, so the spawned ranks can import it) on `world` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        mp.spawn(_worker, args=(cases, world, str(Path(tmp) / "init"), str(out)), nprocs=world)
        return json.loads(out.read_text())
