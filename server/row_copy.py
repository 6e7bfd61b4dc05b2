"""A step's captured rows taken off the device without the engine step waiting for them.

The target's forward leaves its outputs in buffers that the next step overwrites: under CUDA
graphs they are the graphs' static output buffers, and `input_ids`/`positions` are views of the
runner's persistent input buffers. So the rows codraft keeps are gathered at once, on the
engine's own stream, into fresh device tensors (the tap layers side by side, the final hidden
state, both in the wire dtype, the ids and the positions), and an event is recorded
after the gather (with `EngineConfig.tap_device_ring`, into a slot of a ring shared with the
tap process: codraft.server.device_ring, which copies the rows off in that process). That is
all the engine step does: no host memory, no copy to the host, no
wait. The capture thread (codraft.server.capture) calls `StagedRows.to_host()`, which copies on a
side stream of its own that waits for the event, into pinned host buffers that the capture
thread reuses step after step (`HostStage`: a DMA, no staging through pageable memory, no
allocation of pinned memory per step); only that thread waits.

Device memory held by gathered rows that the capture thread has not taken yet is bounded
(`RowCopier.max_bytes`): past it a step's rows are not gathered, and the step is counted
(`steps_skipped`); its requests are then sent incomplete, never wrong. On the CPU the gather is
the copy, and the rows are on the host at once.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from codraft.server.device_ring import DeviceRing, aligned, slot_bytes
from codraft.server.host_stage import HostStage


@dataclass
class StagedRows:
    """One step's gathered rows: `ids` [M] int32, `positions` [M] int64, `taps` [M, T * H] (the
    T tap layers side by side, as a message carries them) and `last` [M, H] (the final hidden
    state), both in the wire dtype. On the device until `to_host()` (capture thread) has run.

    The gather (RowCopier) makes two tensors, not four: `ints` [2, M] (the ids and the
    positions, int64) and `feats` [M, T * H + H] (the taps and the final state side by side), so
    that the engine step launches two copies and the host copy is two DMAs; `taps` and `last`
    are column views of `feats` (rows strided, each row contiguous)."""

    ids: torch.Tensor
    positions: torch.Tensor
    taps: torch.Tensor
    last: torch.Tensor
    ready: Any = None  # a CUDA event recorded after the gather, or None (on the host already)
    stage: HostStage | None = None  # where to_host copies to
    slot: Any = None  # the DeviceRing slot holding the rows (codraft.server.device_ring)
    _release: Any = field(default=None, repr=False)
    _packed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def packed(
        cls,
        ints: torch.Tensor,
        feats: torch.Tensor,
        tap_width: int,
        ready: Any = None,
        stage: HostStage | None = None,
    ) -> StagedRows:
        """Rows from the gather's `ints` [2, M] and `feats` [M, tap_width + H]."""
        rows = cls(ints[0], ints[1], feats[:, :tap_width], feats[:, tap_width:], ready, stage)
        if ready is None:
            rows.ids = rows.ids.to(torch.int32)
        else:
            rows._packed = (ints, feats)
        return rows

    def to_host(self) -> None:
        """Copy the rows to host memory (blocks the calling thread, never the engine's). On a
        GPU the host tensors are the stage's pinned buffers: valid until the stage's next
        copy, so copy out what is kept before the next `to_host` of the same stage."""
        if self.ready is None:
            return
        ints, feats = self.stage.copy(self.ready, self._packed)  # set by packed() with ready
        width = self.taps.shape[-1]
        self.ids, self.positions = ints[0].to(torch.int32), ints[1]
        self.taps, self.last = feats[:, :width], feats[:, width:]
        self._packed = None
        self.ready = None
        if self._release is not None:
            self._release()


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [start, end) ranges joined. The usual step captures every request, whose rows
    lie one after another: one range, which the gather copies as a slice (no index to build
    and send to the device)."""
    out: list[tuple[int, int]] = []
    for s, e in ranges:
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def row_index(ranges: list[tuple[int, int]]) -> np.ndarray:
    """The flat row numbers of `ranges` ([start, end) pairs), in order."""
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in ranges])


class RowCopier:
    """Gathers rows on the engine's stream; the capture thread copies them to the host."""

    def __init__(
        self,
        device: torch.device,
        wire_dtype: torch.dtype,
        max_bytes: int,
        ring: DeviceRing | None = None,
    ) -> None:
        """`ring`: where the rows go once the tap process has it (its slots bound the device
        memory instead of `max_bytes`)."""
        self.device = torch.device(device)
        self.ring = ring
        self.wire_dtype = wire_dtype
        self.cuda = self.device.type == "cuda"
        self.stage = HostStage(self.device) if self.cuda else None  # the capture thread's
        self.max_bytes = max_bytes
        self.held_bytes = 0  # gathered on the device, not yet on the host
        self.steps_skipped = 0
        self._lock = threading.Lock()

    def copy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        taps: list[torch.Tensor],
        hidden: torch.Tensor,
        ranges: list[tuple[int, int]],
    ) -> StagedRows | None:
        """Rows `ranges` ([start, end) into the flat batch) of the ids, the positions, the tap
        layers (each [N, H]; side by side: [M, T * H]) and the final hidden state ([N, H]); None
        when the rows would exceed the device memory bound."""
        ranges = merge_ranges(ranges)
        rows = sum(e - s for s, e in ranges)
        width = sum(t.shape[-1] for t in taps) + hidden.shape[-1]
        ring = self.ring if self.ring is not None and self.ring.usable else None
        ints = feats = slot = None
        nbytes = rows * (width * self.wire_dtype.itemsize + 16)
        if ring is not None:
            slot = ring.alloc(slot_bytes(rows, width, self.wire_dtype))
            if slot is None:
                self.steps_skipped += 1
                return None
            ints = ring.view(slot, 0, torch.int64, (2, rows))
            feats = ring.view(slot, aligned(16 * rows), self.wire_dtype, (rows, width))
        elif self.cuda:
            with self._lock:
                if self.held_bytes + nbytes > self.max_bytes:
                    self.steps_skipped += 1
                    return None
                self.held_bytes += nbytes
        parts = [*taps, hidden]
        same = all(t.dtype == self.wire_dtype for t in parts)
        # Two launches on the engine's stream (each torch call also hands the interpreter
        # lock over, and the engine thread then waits to get it back): the ids and positions
        # stacked (int64), the taps and the final state side by side; into the ring's slot
        # when there is one.
        if len(ranges) == 1:
            s, e = ranges[0]
            pair, parts = (input_ids[s:e], positions[s:e]), [t[s:e] for t in parts]
            if ints is None:
                ints = torch.stack(pair)
            else:
                torch.stack(pair, out=ints)
            if feats is None:
                feats = torch.cat(parts, dim=-1)
            elif same:
                torch.cat(parts, dim=-1, out=feats)
            else:
                feats.copy_(torch.cat(parts, dim=-1))
        else:
            index = torch.from_numpy(row_index(ranges))
            if self.cuda:
                index = index.pin_memory().to(self.device, non_blocking=True)
            both = torch.stack((input_ids, positions))
            side = torch.cat(parts, dim=-1)
            if ints is None:
                ints, feats = both[:, index], side.index_select(0, index)
            else:
                torch.index_select(both, 1, index, out=ints)
                torch.index_select(side if same else side.to(self.wire_dtype), 0, index, out=feats)
        if feats.dtype != self.wire_dtype:
            feats = feats.to(self.wire_dtype)
        tap_width = feats.shape[-1] - hidden.shape[-1]
        if slot is not None:
            staged = StagedRows.packed(ints, feats, tap_width, ring.record(slot), self.stage)
            staged.slot = slot
            staged._release = weakref.finalize(staged, ring.release, slot)
            return staged
        if not self.cuda:
            return StagedRows.packed(ints, feats, tap_width)
        ready = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, never spins
        ready.record(torch.cuda.current_stream(self.device))
        staged = StagedRows.packed(ints, feats, tap_width, ready, self.stage)
        # the bound is given back once the rows are on the host, or when they are dropped
        staged._release = weakref.finalize(staged, self._give_back, nbytes)
        return staged

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes
