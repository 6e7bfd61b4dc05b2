"""Point-to-point transfers (and the odd small all-reduce) of device tensors over gloo, staged
through host memory: the transport when the ranks of a host share its GPU(s).

Why: a pipeline needs at least two ranks, and NCCL refuses two ranks on one GPU ("Duplicate GPU
detected"). With `ParallelConfig.share_gpu` (`codraft.learner.parallel.launch`) every rank runs on
cuda:LOCAL_RANK % GPUs, every process group is gloo, and this module is enabled. gloo's
send/recv take CPU tensors only, so each transfer of a CUDA tensor goes through a host copy:

* `isend`: the tensor is copied into a pinned host buffer first. The copy is blocking (the host
  waits for the current stream up to the tensor), so the bytes are in the buffer before gloo's
  thread reads them; the buffer lives in the returned `StagedWork` until the send is waited.
* `irecv`: gloo receives into a pinned host buffer; `StagedWork.wait` copies it into the device
  tensor, non-blocking on the current stream (later work on that stream sees the data; the
  caching host allocator keeps the buffer until that copy is done).
* `all_reduce`: through a host copy, synchronously.

gloo moves bytes, so any dtype (bf16 included) goes through send/recv. A gloo request makes
progress only inside `wait`, so `codraft.learner.parallel.p2p_wait.wait_work` waits on a
`StagedWork` as on a CPU request (`wait(timeout)`), never by polling `is_completed`.

Disabled (the default, and always on the NCCL path) every function here is the torch.distributed
call itself, unchanged. `enable(stage_cpu=True)` stages CPU tensors too (a CPU -> CPU copy): the
same code path, run by the tests on a CPU-only machine.

Times measured over this transport are not NCCL figures: every transfer goes device -> host ->
gloo (TCP, loopback) -> host -> device, sends wait for the producing stream, and ranks that share
a GPU time-slice it. It is for smoke runs and correctness checks on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class _State:
    on: bool = False
    stage_cpu: bool = False  # CPU tensors too (testing the path without a GPU)
    transfers: int = 0  # staged sends, receives and all-reduces since enable()
    bytes: int = 0  # their payload


_state = _State()


def enable(stage_cpu: bool = False) -> None:
    """Stage every transfer of a device tensor (and of CPU tensors with `stage_cpu`) through host
    memory from now on, in this process. The process groups must be gloo."""
    _state.on, _state.stage_cpu = True, stage_cpu
    _state.transfers = _state.bytes = 0


def disable() -> None:
    _state.on, _state.stage_cpu = False, False


def enabled() -> bool:
    return _state.on


def counts() -> dict[str, int]:
    """Transfers staged in this process since `enable` (sends, receives, all-reduces) and
    their bytes."""
    return {"transfers": _state.transfers, "bytes": _state.bytes}


def _staged(tensor: torch.Tensor) -> bool:
    return _state.on and (tensor.device.type != "cpu" or _state.stage_cpu)


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host buffer for `tensor`, pinned when the tensor is on a GPU (and counted:
    every staged transfer takes one)."""
    _state.transfers += 1
    _state.bytes += tensor.numel() * tensor.element_size()
    pin = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)


class StagedWork:
    """A gloo request on a host buffer, finished by `wait`: a receive then copies the buffer into
    the device tensor it was posted for."""

    def __init__(
        self, work: dist.Work, host: torch.Tensor, target: torch.Tensor | None = None
    ) -> None:
        self.work, self.host, self.target = work, host, target
        self._done = False

    def is_completed(self) -> bool:
        """True once `wait` returned (a gloo request progresses only inside wait)."""
        return self._done

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the gloo request (at most `timeout`; its timeout error is gloo's), then, for
        a receive, copy the data to the device tensor. Waiting again returns at once (gloo's own
        wait must not run twice: a second wait on a finished receive blocks until its timeout)."""
        if self._done:
            return True
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        if self.target is not None:
            pinned = self.target.device.type == "cuda"  # as `_host_like` allocated it
            self.target.copy_(self.host, non_blocking=pinned)
        self._done = True
        return True


Request = dist.Work | StagedWork


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Request:
    """`dist.isend`, or, when staged, a host copy of `tensor` sent over gloo."""
    if not _staged(tensor):
        return dist.isend(tensor, dst=dst, group=group)
    host = _host_like(tensor)
    host.copy_(tensor)  # blocking: the bytes are there before gloo reads them
    return StagedWork(dist.isend(host, dst=dst, group=group), host)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> Request:
    """`dist.irecv`, or, when staged, a gloo receive into a host buffer that `wait` copies into
    `tensor`. `tensor` holds the data only after the request was waited."""
    if not _staged(tensor):
        return dist.irecv(tensor, src=src, group=group)
    host = _host_like(tensor)
    return StagedWork(dist.irecv(host, src=src, group=group), host, tensor)


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    isend(tensor, dst, group).wait()


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    irecv(tensor, src, group).wait()


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """`dist.all_reduce` in place, or, when staged, on a host copy that is copied back."""
    if not _staged(tensor):
        dist.all_reduce(tensor, op=op, group=group)
        return
    host = _host_like(tensor)
    host.copy_(tensor)
    dist.all_reduce(host, op=op, group=group)
    tensor.copy_(host)
