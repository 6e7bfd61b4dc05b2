"""The shared-GPU transport (`codraft.learner.parallel.host_staged`) and the start-up that picks it
(`codraft.learner.parallel.launch`), on a CPU-only machine.

The shim is forced on CPU tensors (`enable(stage_cpu=True)`): the same code as for CUDA tensors,
with a plain host buffer where a GPU gets a pinned one. Start-up is checked with a fake GPU count
and a recording `init_process_group`: which device, backend and `device_id` a rank would use.
The pipeline and TapChannel over this transport: tests/test_pp.py (`world2_staged`) and
tests/test_bench_pp_train.py (`--share-gpu`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

TIMEOUT_S = 0.5


# ---------------------------------------------------------------------- in the workers
def shim_cases(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from codraft.learner.parallel import host_staged
    from codraft.learner.parallel.p2p_wait import PeerTimeout, wait_work

    out: dict[str, Any] = {}
    peer = 1 - rank
    payload = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16) + 0.5

    # off: the torch.distributed calls themselves
    host_staged.disable()
    if rank == 0:
        w = host_staged.isend(payload, peer)
    else:
        got = torch.empty_like(payload)
        w = host_staged.irecv(got, peer)
    out["off_type"] = type(w).__name__
    w.wait()
    if rank == 1:
        out["off_equal"] = torch.equal(got, payload)

    # on, CPU tensors staged: bf16 into a strided view, an int64 header, an all-reduce
    host_staged.enable(stage_cpu=True)
    if rank == 0:
        works = [host_staged.isend(payload, peer), host_staged.isend(torch.tensor([7, 8]), peer)]
        out["on_type"] = type(works[0]).__name__
        for w in works:
            w.wait()
    else:
        target = torch.zeros(4, 3, dtype=torch.bfloat16).t()  # [3, 4], not contiguous
        header = torch.zeros(2, dtype=torch.int64)
        w_data, w_head = host_staged.irecv(target, peer), host_staged.irecv(header, peer)
        out["on_type"] = type(w_data).__name__
        # a device that is not the CPU: wait_work must wait (not poll) a staged request
        wait_work(w_data, torch.device("cuda"), 10.0, lambda: "the data")
        wait_work(w_head, torch.device("cpu"), 10.0, lambda: "the header")
        out["on_equal"] = torch.equal(target, payload)
        out["header"] = header.tolist()
        out["wait_again"] = w_data.wait() and w_data.is_completed()
    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    host_staged.all_reduce(t, op=dist.ReduceOp.MAX)
    out["all_reduce"] = float(t)

    # a receive holds its data only after wait (gloo fills the host buffer; wait copies it)
    if rank == 0:
        dist.barrier()  # rank 1 has posted
        host_staged.send(torch.ones(5), peer)
        dist.barrier()
    else:
        late = torch.zeros(5)
        w = host_staged.irecv(late, peer)
        dist.barrier()
        dist.barrier()  # the send is done
        out["before_wait"] = float(late.sum())
        w.wait(timedelta(seconds=10))
        out["after_wait"] = float(late.sum())
    out["counts"] = host_staged.counts()

    # a staged receive that nobody sends: PeerTimeout with the description, whatever device
    if rank == 1:
        group = dist.new_group([0, 1])
        w = host_staged.irecv(torch.empty(3), peer, group)
        try:
            wait_work(w, torch.device("cuda"), TIMEOUT_S, lambda: "taps from stage 0")
            out["timeout"] = "none"
        except PeerTimeout as e:
            out["timeout"] = str(e)
    else:
        dist.new_group([0, 1])
    dist.barrier()
    host_staged.disable()
    return out


# ---------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    from codraft.learner.parallel.spawn import run_world

    return run_world(shim_cases, 2, timeout_s=60)


def test_off_is_torch_distributed(world2: list[dict[str, Any]]) -> None:
    assert all(r["off_type"] != "StagedWork" for r in world2)
    assert world2[1]["off_equal"] is True


def test_staged_transfers_land_after_wait(world2: list[dict[str, Any]]) -> None:
    r = world2[1]
    assert all(w["on_type"] == "StagedWork" for w in world2)
    assert r["on_equal"] is True, "bf16 into a strided view"
    assert r["header"] == [7, 8]
    assert r["wait_again"] is True
    assert r["before_wait"] == 0.0 and r["after_wait"] == 5.0
    assert all(w["all_reduce"] == 2.0 for w in world2)
    assert r["counts"]["transfers"] >= 4 and r["counts"]["bytes"] > 0


def test_staged_receive_times_out_with_its_description(world2: list[dict[str, Any]]) -> None:
    msg = world2[1]["timeout"]
    assert "taps from stage 0" in msg and f"waited {TIMEOUT_S:g} s" in msg, msg


# ---------------------------------------------------------------------- start-up
class _Stop(Exception):
    pass


def _start(monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, ranks: int, **cfg: Any):
    """init_distributed on a fake host with `gpus` GPUs as local rank `local_rank` of `ranks`:
    the device it binds and the init_process_group call (stopped there)."""
    import torch.distributed as dist

    from codraft.learner.parallel import launch

    seen: dict[str, Any] = {}

    def init(backend: str, **kw: Any) -> None:
        seen.update(backend=backend, **kw)
        raise _Stop

    monkeypatch.setattr(launch, "_gpus", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    with pytest.raises(_Stop):
        launch.init_distributed(launch.ParallelConfig(**cfg))
    return seen


def test_more_ranks_than_gpus_share_gpu0_over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _start(monkeypatch, gpus=1, local_rank=1, ranks=2, pp=2, share_gpu=None)
    assert seen["set_device"] == torch.device("cuda", 0)
    assert seen["backend"] == "gloo" and seen["device_id"] is None


def test_ranks_spread_over_the_gpus_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _start(monkeypatch, gpus=2, local_rank=3, ranks=4, pp=4, share_gpu=True)
    assert seen["set_device"] == torch.device("cuda", 1) and seen["backend"] == "gloo"


def test_one_gpu_per_rank_stays_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _start(monkeypatch, gpus=2, local_rank=1, ranks=2, pp=2, share_gpu=None)
    assert seen["set_device"] == torch.device("cuda", 1)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)


def test_too_few_gpus_without_sharing_says_how_to_share(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="share_gpu"):
        _start(monkeypatch, gpus=1, local_rank=0, ranks=2, pp=2)


def test_sharing_refuses_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="gloo"):
        _start(monkeypatch, gpus=1, local_rank=0, ranks=2, pp=2, share_gpu=True, backend="nccl")


def test_cpu_share_is_gloo_without_device_id(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _start(monkeypatch, gpus=0, local_rank=0, ranks=2, pp=2, share_gpu=True)
    assert "set_device" not in seen and seen["backend"] == "gloo" and seen["device_id"] is None
