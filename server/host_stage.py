"""Pinned host buffers that a step's device rows are copied into, off the engine's stream.

Used by the thread that takes the rows to the host (codraft.server.row_copy's StagedRows, in the
engine's process; codraft.server.device_ring's RingReader, in the tap process): one DMA a
tensor into a buffer it reuses, no pinned memory allocated per step.
"""

from __future__ import annotations

from typing import Any

import torch


class HostStage:
    """Pinned host buffers, one per tensor of a step, reused by every copy of one thread; they
    grow (to the next power of two) when a step needs more. The copy runs on a side stream."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self._bufs: list[torch.Tensor] = []

    def _view(self, i: int, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if i == len(self._bufs):
            self._bufs.append(torch.empty(0, dtype=torch.uint8))
        if self._bufs[i].numel() < nbytes:
            size = 1 << max(nbytes - 1, 1).bit_length()
            self._bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return self._bufs[i][:nbytes].view(like.dtype).view(like.shape)

    def copy(self, ready: Any, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors' values in pinned host memory, once `ready` (an event) has passed."""
        out = tuple(self._view(i, t) for i, t in enumerate(tensors))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for dst, src in zip(out, tensors, strict=True):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # this thread sleeps, never spins
            done.record(self.stream)
        done.synchronize()
        return out
