"""Waiting on a point-to-point request with a deadline and an error that says what was awaited.

torch's own timeouts belong to the process group (the collective watchdog): when one fires the
message names a sequence number, not a pipeline stage or a microbatch, and on NCCL the process is
torn down. Every wait of the pipeline and of TapChannel goes through `wait_work` instead, with a
timeout well below the watchdog's, so a peer that stops sending raises `PeerTimeout` naming what
was expected from whom.

How to wait differs by backend, and the code stays device-agnostic by asking the tensor's device:

* CPU tensors (gloo): a gloo receive makes progress only inside `Work.wait` (`is_completed()`
  stays False until someone waits), so the wait is `work.wait(timeout)`, whose timeout error is
  re-raised as `PeerTimeout`. The same for a `StagedWork` (a device tensor's transfer staged
  through host memory over gloo, `codraft.learner.parallel.host_staged`), whatever the tensor's
  device.
* other devices (NCCL): `is_completed()` reports the request's CUDA event without blocking, so
  it is polled with a short back-off until the deadline; then `work.wait()` orders the current
  stream after the transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from codraft.learner.parallel.host_staged import Request, StagedWork

Describe = Callable[[], str]


class PeerTimeout(TimeoutError):
    """A peer did not send (or receive) what this rank waited for in time."""


class PeerFailed(RuntimeError):
    """The transport failed while waiting (the peer died, the connection closed)."""


def watchdog_seconds(backend: str) -> float:
    """The process groups' default collective timeout for `backend`, in seconds."""
    try:
        from torch.distributed.distributed_c10d import _get_default_timeout

        return _get_default_timeout(backend).total_seconds()
    except Exception:  # private helper moved: assume NCCL's 10 minutes, the shortest default
        return 600.0


def check_below_watchdog(timeout_s: float, group: dist.ProcessGroup | None, what: str) -> None:
    """Refuse a deadline that the collective watchdog of `group`'s backend would beat: the
    descriptive error must come first."""
    if group is None:
        return
    limit = watchdog_seconds(dist.get_backend(group))
    if timeout_s > limit / 2:
        raise ValueError(
            f"{what} of {timeout_s:g} s is not well below the collective watchdog "
            f"({limit:g} s on {dist.get_backend(group)}), which would abort first with a message "
            f"that names no stage or microbatch; use at most {limit / 2:g} s"
        )


def wait_work(
    work: Request | None, device: torch.device, timeout_s: float, describe: Describe
) -> None:
    """Wait for `work` (from isend/irecv) at most timeout_s seconds.

    Raises PeerTimeout with `describe()` (what was awaited, from whom) when the time runs out,
    PeerFailed when the transport reports an error.
    """
    if work is None:
        return
    if device.type == "cpu" or isinstance(work, StagedWork):
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as e:
            text = str(e)
            if "imed out" in text or "timeout" in text.lower():
                raise PeerTimeout(f"{describe()} (waited {timeout_s:g} s)") from None
            raise PeerFailed(f"{describe()}: the transport failed: {text}") from e
        return
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise PeerTimeout(f"{describe()} (waited {timeout_s:g} s)")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    try:
        work.wait()
    except RuntimeError as e:
        raise PeerFailed(f"{describe()}: the transport failed: {e}") from e
