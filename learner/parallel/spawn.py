"""Run one function in a world of N real processes joined by torch.distributed (gloo on CPU):
the multi-process harness of the pipeline tests and the benchmark's smoke run.

`run_world(fn, n, *args)` spawns n processes; each joins the group through a file rendezvous,
calls `fn(rank, n, *args)` and hands its return value back (torch.save / torch.load, so tensors
travel). One spawn can run many cases: put them in `fn`, build fresh process groups per case.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, fn: Callable[..., Any], world: int, folder: str, timeout_s: float, args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    result = fn(rank, world, *args)
    torch.save(result, Path(folder) / f"result-{rank}.pt")
    dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's slow teardown (seconds per process
    # on a busy machine, and gloo threads of failure-injection cases may still wait on peers).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """fn(rank, world_size, *args) in world_size spawned gloo processes -> results by rank.
    `fn` must be importable by name (a module-level function). A process that raises makes
    this raise (torch.multiprocessing.ProcessRaisedException, with the child's traceback)."""
    with tempfile.TemporaryDirectory(prefix="codraft-world-") as folder:
        mp.start_processes(
            _entry,
            args=(fn, world_size, folder, timeout_s, args),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        return [
            torch.load(Path(folder) / f"result-{r}.pt", weights_only=False)
            for r in range(world_size)
        ]
