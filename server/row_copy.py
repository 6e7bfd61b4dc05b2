"""A step's captured rows copied off the device without the engine step waiting for them.

The target's forward leaves its outputs in buffers that the next step overwrites: under CUDA
graphs they are the graphs' static output buffers, and `input_ids`/`positions` are views of the
runner's persistent input buffers. So the rows codraft keeps are gathered at once, on the
engine's own stream, into fresh device tensors (one `stack` of the tap layers and the last
hidden state, cast to the wire dtype, plus the ids and positions); a side stream then waits for
that gather and copies the result into pinned host memory (`non_blocking`), and records an
event. Nothing here synchronises with the device: `StagedRows.wait()`, called by the capture
thread, is the only wait, and it is off the engine step.

On the CPU the gather is the copy, and the rows are ready at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class StagedRows:
    """One step's gathered rows: `ids` [M] int32, `positions` [M] int64, `feats` [M, T + 1, H]
    in the wire dtype (T tap layers, then the last hidden state). Host tensors; read them only
    after `wait()`."""

    ids: torch.Tensor
    positions: torch.Tensor
    feats: torch.Tensor
    done: Any = None  # a CUDA event recorded after the copies, or None (ready)
    keep: tuple = ()  # device tensors that must outlive the copies

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        self.keep = ()


def row_index(ranges: list[tuple[int, int]]) -> np.ndarray:
    """The flat row numbers of `ranges` ([start, end) pairs), in order."""
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in ranges])


class RowCopier:
    """Gathers rows on the engine's stream, copies them to pinned host memory on a side one."""

    def __init__(self, device: torch.device, wire_dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        self.wire_dtype = wire_dtype
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def copy(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layers: list[torch.Tensor],
        ranges: list[tuple[int, int]],
    ) -> StagedRows:
        """Rows `ranges` ([start, end) into the flat batch) of the ids, the positions and each
        of `layers` ([N, H] each), stacked as [M, len(layers), H]."""
        if len(ranges) == 1:
            s, e = ranges[0]
            ids, pos = input_ids[s:e], positions[s:e]
            views = [t[s:e] for t in layers]
        else:
            index = torch.from_numpy(row_index(ranges))
            if self.cuda:
                index = index.pin_memory().to(self.device, non_blocking=True)
            ids, pos = input_ids.index_select(0, index), positions.index_select(0, index)
            views = [t.index_select(0, index) for t in layers]
        feats = torch.stack(views, dim=1)
        if feats.dtype != self.wire_dtype:
            feats = feats.to(self.wire_dtype)
        ids = ids.to(torch.int32, copy=True)
        pos = pos.to(torch.int64, copy=True)
        if not self.cuda:
            return StagedRows(ids, pos, feats)
        main = torch.cuda.current_stream(self.device)
        gathered = torch.cuda.Event()
        gathered.record(main)
        h_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        h_pos = torch.empty(pos.shape, dtype=pos.dtype, pin_memory=True)
        h_feats = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
        done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, never spins
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(gathered)
            h_feats.copy_(feats, non_blocking=True)
            h_ids.copy_(ids, non_blocking=True)
            h_pos.copy_(pos, non_blocking=True)
            done.record(self.stream)
        return StagedRows(h_ids, h_pos, h_feats, done, keep=(feats, ids, pos))
