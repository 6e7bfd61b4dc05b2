"""Per-document left rolls of zigzag-sharded tensors, exchanging only chunk-boundary rows.

TTT pass d reads token ``x[i + d]`` at anchor i, counts anchor i where ``loss_mask[i + d]``
holds, and takes its teacher row from position ``i + d``: a left roll by ``shift`` inside each
document (``y[i] = x[i + shift]`` while ``i + shift`` is in i's document, else ``fill``). Under
context parallelism the rows a chunk needs past its end are the first ``shift`` rows of the
document's next chunk, which usually lives on another rank:

* the next chunk of front chunk ``r`` is front chunk ``r + 1`` of rank ``r + 1`` (for the last
  rank, ``r = cp - 1``, it is its own back chunk ``cp``);
* the next chunk of back chunk ``2cp - 1 - r`` is back chunk ``2cp - r`` of rank ``r - 1``
  (rank 0's back chunk is the document's last: nothing follows).

So one exchange moves ``shift`` rows per document and chunk between neighbours only: front
heads to the left, back heads to the right. When ``shift`` exceeds a document's chunk size (a
short document: the minimum is one token per chunk), the halo spans several chunks; each extra
round passes on the first ``shift`` rows of (chunk + halo received so far), so
``ceil(shift / smallest chunk)`` rounds suffice. No gradient flows (ids, masks, teacher rows).

:class:`~codraft.learner.ttt.LocalRoll` is the same interface on one device
(``codraft.learner.ttt.roll_left``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from codraft.learner.parallel.ring_comm import Ring
from codraft.learner.parallel.zigzag import ZigzagLayout
from codraft.learner.ttt import LocalRoll, Roll, doc_ends, roll_left  # noqa: F401 (re-exported)


class BoundaryRoll:
    """Rolls of this CP rank's zigzag shard (collective over the ring's group: every CP rank
    calls each method in step, with the same ``shift``)."""

    def __init__(self, layout: ZigzagLayout, ring: Ring) -> None:
        if ring.size != layout.cp_size or ring.rank != layout.cp_rank:
            raise ValueError(
                f"the ring (rank {ring.rank} of {ring.size}) and the layout (rank "
                f"{layout.cp_rank} of {layout.cp_size}) disagree"
            )
        self.lay, self.ring = layout, ring
        dev = layout.index.device
        cp, r = layout.cp_size, layout.cp_rank
        c = torch.tensor(layout.chunks, dtype=torch.int64)
        n_chunks = 2 * len(layout.chunks)
        self.chunk_c = c.repeat_interleave(2)  # [2B]: front, back of doc 0, then doc 1, ...
        self.chunk_start = torch.stack([c, c], 1).flatten().cumsum(0) - self.chunk_c
        local_chunk = torch.repeat_interleave(torch.arange(n_chunks), self.chunk_c)
        offset = torch.arange(layout.num_local) - self.chunk_start[local_chunk]
        global_chunk = torch.where(local_chunk % 2 == 0, r, 2 * cp - 1 - r)
        row_c = self.chunk_c[local_chunk]
        # rows after this one inside its (padded) document
        self.row_room = (2 * cp * row_c - (global_chunk * row_c + offset) - 1).to(dev)
        self.row_chunk, self.row_offset, self.row_c = (
            local_chunk.to(dev),
            offset.to(dev),
            row_c.to(dev),
        )
        self.chunk_c, self.chunk_start = self.chunk_c.to(dev), self.chunk_start.to(dev)
        self.min_chunk = min(layout.chunks)

    # ------------------------------------------------------------------ halo exchange
    def _heads(self, x: Tensor, halo: Tensor, shift: int) -> Tensor:
        """[2B, shift, ...]: the first ``shift`` rows of (each local chunk + its halo)."""
        t = torch.arange(shift, device=x.device).unsqueeze(0)
        c = self.chunk_c.unsqueeze(1)
        from_x = t < c
        xi = self.chunk_start.unsqueeze(1) + torch.minimum(t, c - 1)
        hi = torch.arange(len(self.chunk_c), device=x.device).unsqueeze(1) * shift
        hi = hi + (t - c).clamp(min=0)
        hx = x[xi.flatten()].unflatten(0, xi.shape)
        hh = halo.flatten(0, 1)[hi.flatten()].unflatten(0, hi.shape)
        return torch.where(from_x.view(*from_x.shape, *([1] * (x.dim() - 1))), hx, hh)

    def halo(self, x: Tensor, shift: int) -> Tensor:
        """[2B, shift, ...]: the ``shift`` rows that follow each local chunk in its document
        (rows past the document's end are left as zeros)."""
        cp, r = self.ring.size, self.ring.rank
        halo = x.new_zeros((len(self.chunk_c), shift, *x.shape[1:]))
        for _ in range(math.ceil(shift / self.min_chunk)):
            heads = self._heads(x, halo, shift)
            front, back = heads[0::2].contiguous(), heads[1::2].contiguous()
            new_front, new_back = torch.empty_like(front), torch.zeros_like(back)
            sends, recvs = [], []
            if r > 0:  # my front chunk r follows chunk r - 1 (front, rank r - 1)
                sends.append((front, r - 1))
                recvs.append((new_back, r - 1))  # chunk 2cp - r follows my back chunk
            if r < cp - 1:
                sends.append((back, r + 1))
                recvs.append((new_front, r + 1))
            self.ring.exchange(sends, recvs).wait()
            if r == cp - 1:  # chunk cp follows chunk cp - 1: both are mine
                new_front = back
            halo[0::2] = new_front
            halo[1::2] = new_back
        return halo

    # ------------------------------------------------------------------ rolls
    def _ahead(self, x: Tensor, shift: int, rows: Tensor, halo: Tensor) -> Tensor:
        target = self.row_offset[rows] + shift
        c = self.row_c[rows]
        local = target < c
        xi = (rows + shift).clamp(max=x.shape[0] - 1)
        hi = self.row_chunk[rows] * shift + (target - c).clamp(min=0, max=shift - 1)
        mask = local.view(-1, *([1] * (x.dim() - 1)))
        return torch.where(mask, x[xi], halo.flatten(0, 1)[hi])

    def roll_left(self, x: Tensor, shift: int, fill: float | int = 0) -> Tensor:
        if shift == 0:
            return x
        is_bool = x.dtype == torch.bool
        xs = x.to(torch.uint8) if is_bool else x  # gloo and NCCL both move uint8
        rows = torch.arange(x.shape[0], device=x.device)
        y = self._ahead(xs, shift, rows, self.halo(xs, shift))
        inside = (self.row_room >= shift).view(-1, *([1] * (x.dim() - 1)))
        y = torch.where(inside, y, torch.as_tensor(fill, dtype=y.dtype, device=y.device))
        return y.bool() if is_bool else y

    def ahead_index(self, shift: int, rows: Tensor) -> Tensor | None:
        return rows if shift == 0 else None  # a shard's rows ahead may lie on another rank

    def gather_ahead(self, x: Tensor, shift: int, rows: Tensor) -> Tensor:
        if shift == 0:
            return x[rows]
        is_bool = x.dtype == torch.bool
        xs = x.to(torch.uint8) if is_bool else x
        y = self._ahead(xs, shift, rows, self.halo(xs, shift))
        return y.bool() if is_bool else y
