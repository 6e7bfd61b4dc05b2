"""Process-group start-up under torchrun, for `codraft learn --cp N` and the CP benchmark.

    torchrun --nproc-per-node 8 -m codraft.cli learn ... --cp 4     # 2 data replicas x CP 4

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous variables; without them (a plain
``python`` start) the world is one process and no process group is created. NCCL on CUDA (one
GPU per process, ``cuda:LOCAL_RANK``), gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from learner.data.packing import PackedBatch
from learner.parallel.mesh import ParallelDims, ParallelMesh


@dataclass
class ParallelConfig:
    cp: int = 1  # context-parallel ranks per batch
    pp: int = 1  # pipeline stages (recompute mode, learner.recompute)
    backend: str = "auto"  # "auto": nccl on CUDA, gloo on CPU
    device: str = "auto"  # "auto": cuda:LOCAL_RANK when CUDA is available, else cpu
    timeout_s: float = 600.0


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cp",
        type=int,
        default=ParallelConfig.cp,
        help="context-parallel ranks per batch (start under torchrun with a multiple of it)",
    )


def config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(cp=getattr(args, "cp", 1))


def _device(cfg: ParallelConfig, local_rank: int) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(cfg: ParallelConfig | None = None) -> tuple[ParallelMesh, torch.device]:
    """Join the job torchrun started (or stay single), pick this rank's device, build the mesh.

    Collective: every rank calls it once at start-up.
    """
    cfg = cfg or ParallelConfig()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1 and not dist.is_initialized():
        if cfg.cp * cfg.pp > 1:
            raise RuntimeError(
                f"--cp {cfg.cp} / --pp {cfg.pp} need {cfg.cp * cfg.pp} processes (or a multiple), "
                f"got one: start with torchrun --nproc-per-node {cfg.cp * cfg.pp} ..."
            )
        return ParallelMesh.single(), device
    if not dist.is_initialized():
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    dims = ParallelDims(dist.get_world_size(), cp=cfg.cp, pp=cfg.pp)
    return ParallelMesh.build(dims), device


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def my_batches(
    batches: Iterable[PackedBatch], mesh: ParallelMesh
) -> Iterator[tuple[PackedBatch, Any]]:
    """Split one common batch stream over the data-parallel replicas, in runs of ``dp``
    batches: replica j trains on the j-th batch of each run, every CP rank of a replica on the
    same batch. Yields ``(my batch, resume cursor)``, the cursor being the run's last batch's,
    the same on every rank (what a checkpoint saves). A trailing partial run is dropped: every
    replica must take part in every step."""
    run: list[PackedBatch] = []
    for batch in batches:
        run.append(batch)
        if len(run) == mesh.dp_size:
            yield run[mesh.dp_rank], run[-1].cursor
            run = []
