"""Process-group start-up under torchrun, for `codraft learn --cp N` and the CP benchmark.

    torchrun --nproc-per-node 8 -m codraft.cli learn ... --cp 4     # 2 data replicas x CP 4

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous variables; without them (a plain
``python`` start) the world is one process and no process group is created. NCCL on CUDA (one
GPU per process, ``cuda:LOCAL_RANK``), gloo on CPU.

Sharing GPUs (``ParallelConfig.share_gpu``, for smoke runs of multi-rank code on one GPU: NCCL
refuses two ranks on one GPU): rank ``r`` of a host uses ``cuda:r % GPUs``, every process group
is gloo, and point-to-point transfers of CUDA tensors are staged through host memory
(``codraft.learner.parallel.host_staged``). Slow, and not a measure of NCCL; the numerics are the
same.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel import host_staged
from codraft.learner.parallel.mesh import ParallelDims, ParallelMesh


@dataclass
class ParallelConfig:
    """How a learner job splits over its ranks: the one home of the cp and pp degrees (the
    mesh's `ParallelDims` is derived from them and the world size at start-up)."""

    cp: int = 1  # context-parallel ranks per batch
    pp: int = 1  # pipeline stages (recompute mode, codraft.learner.pipeline_trainer)
    backend: str = "auto"  # "auto": nccl on CUDA, gloo on CPU
    device: str = "auto"  # "auto": cuda:LOCAL_RANK when CUDA is available, else cpu
    timeout_s: float = 600.0  # the process groups' collective timeout (the watchdog)
    # The ranks of a host share its GPUs: gloo, transfers staged through host memory (smoke runs
    # on one GPU; not for timing). None: share when the host runs more ranks than it has GPUs.
    # On CPU, True stages CPU tensors through host copies too: that path's test without a GPU.
    share_gpu: bool | None = False

    def __post_init__(self) -> None:
        if self.cp < 1 or self.pp < 1:
            raise ValueError(f"cp and pp must be >= 1, got cp {self.cp}, pp {self.pp}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s (--group-timeout) must be > 0 s, got {self.timeout_s}")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _share_gpus(cfg: ParallelConfig, local_ranks: int) -> bool:
    """Whether this job's ranks share GPUs (the same answer on every rank of a host)."""
    gpus = _gpus()
    if cfg.device != "auto" or not gpus:
        return bool(cfg.share_gpu)  # a given device is used as is; on CPU True stages CPU tensors
    if cfg.share_gpu is None:
        return local_ranks > gpus
    if not cfg.share_gpu and local_ranks > gpus:
        raise RuntimeError(
            f"{local_ranks} ranks on this host but {gpus} GPU(s): NCCL needs a GPU per rank. "
            "Start at most one rank per GPU, or let the ranks share the GPUs "
            "(ParallelConfig.share_gpu; --share-gpu in the benchmarks): gloo with transfers "
            "staged through host memory, for smoke runs only"
        )
    return cfg.share_gpu


def _device(cfg: ParallelConfig, local_rank: int, share: bool) -> torch.device:
    if cfg.device != "auto":
        device = torch.device(cfg.device)
        if device.type == "cuda" and device.index is None:  # "cuda": this rank's GPU
            gpus = max(1, _gpus())
            return torch.device("cuda", local_rank % gpus if share else local_rank)
        return device
    gpus = _gpus()
    if gpus:
        return torch.device("cuda", local_rank % gpus if share else local_rank)
    return torch.device("cpu")


def _backend(cfg: ParallelConfig, device: torch.device, share: bool) -> str:
    if share:
        if cfg.backend not in ("auto", "gloo"):
            raise ValueError(
                f"ranks that share a GPU need the gloo backend (NCCL refuses two ranks on one "
                f"GPU), got backend={cfg.backend!r}"
            )
        return "gloo"
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return cfg.backend


def restart_store(timeout: timedelta) -> dist.Store | None:
    """The rendezvous store of this group of workers, its keys apart from every earlier group's
    when torchrun on one host restarts its workers; None where init_process_group's own store
    is right.

    Under torchrun the agent hosts one store for the whole job and every group of workers it
    starts (the first and each restart) meets in it under the same keys. A restarted rank may
    then read the address a killed rank published and connect to a dead port, or wait on a pair
    that never forms: seen on gloo here as "Connection refused" and "Connect timeout" until the
    restarts ran out. On one host every worker of a group has the agent's restart count, so the
    count separates the groups. Across hosts the agents' counts differ (an agent restarts its
    workers without counting when another host's fail), so there the store is left as it is.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    base = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), False, timeout
    )
    run = env.get("TORCHELASTIC_RUN_ID", "")
    return dist.PrefixStore(f"codraft/{run}/restart-{env['TORCHELASTIC_RESTART_COUNT']}", base)


def init_distributed(cfg: ParallelConfig | None = None) -> tuple[ParallelMesh, torch.device]:
    """Join the job torchrun started (or stay single), pick this rank's device, build the mesh.

    Collective: every rank calls it once at start-up.
    """
    cfg = cfg or ParallelConfig()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    share = world > 1 and _share_gpus(cfg, local_ranks)
    device = _device(cfg, local_rank, share)
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
        backend = _backend(cfg, device, share)
        timeout = timedelta(seconds=cfg.timeout_s)
        store = restart_store(timeout)
        dist.init_process_group(
            backend,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,  # gloo binds no GPU
            **(
                {}
                if store is None
                else {"store": store, "rank": int(os.environ["RANK"]), "world_size": world}
            ),  # fmt: skip
        )
    if share:
        if dist.get_backend() != "gloo":
            raise RuntimeError(
                f"ranks that share a GPU need gloo process groups, but the default group was "
                f"already initialized with {dist.get_backend()!r}"
            )
        host_staged.enable(stage_cpu=device.type == "cpu")
    dims = ParallelDims(dist.get_world_size(), cp=cfg.cp, pp=cfg.pp)
    return ParallelMesh.build(dims), device


def shutdown() -> None:
    """Every rank's clean end: the ranks leave together (a rank that tore its groups down while
    rank 0 still wrote the last checkpoint was seen to abort at exit, SIGABRT in a gloo
    thread, once in a loaded test run), then the groups go."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    host_staged.disable()


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
