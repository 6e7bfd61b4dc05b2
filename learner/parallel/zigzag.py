"""Zigzag sharding of packed THD batches for context parallelism, and its inverse.

Every document (padded length ``L``, a multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of
``c = L / (2 * cp)`` tokens; CP rank ``r`` holds chunk ``r`` (its *front* half) and chunk
``2 * cp - 1 - r`` (its *back* half) of every document. Causal attention then costs every rank
the same: the early chunk sees little, the late chunk much.

A rank's local batch keeps the packed layout: per document its front chunk then its back chunk,
documents back to back, so the local ``cu_seqlens`` is the global one divided by ``cp`` and local
order is global order within each document (the local diagonal block is exactly causal). RoPE
positions travel with their tokens: a local row's position is its global position.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from codraft.learner.data.packing import PackedBatch


@dataclass(frozen=True)
class ZigzagLayout:
    """Where one CP rank's rows come from. Tensors live on the batch's device.

    index: int64 [N / cp], the global row of each local row.
    local_cu: int32 [B + 1], local document boundaries (= global / cp).
    half_cu: int32 [B + 1], boundaries of one half (= global / (2 cp)): front or back rows only.
    front, back: int64 [N / (2 cp)], local rows of the front / back chunks, in order.
    chunks: chunk size c of every document (host ints).
    """

    cp_size: int
    cp_rank: int
    index: Tensor
    local_cu: Tensor
    half_cu: Tensor
    front: Tensor
    back: Tensor
    chunks: tuple[int, ...]

    @property
    def num_local(self) -> int:
        return int(self.index.numel())

    @property
    def num_docs(self) -> int:
        return len(self.chunks)

    # Halves of a local tensor along its token dim (default 0). One document: plain slices
    # (views, no copy); several: index_select / index_add_ / index_copy_.
    def take_front(self, x: Tensor, dim: int = 0) -> Tensor:
        if self.num_docs == 1:
            return x.narrow(dim, 0, self.chunks[0])
        return x.index_select(dim, self.front)

    def take_back(self, x: Tensor, dim: int = 0) -> Tensor:
        if self.num_docs == 1:
            return x.narrow(dim, self.chunks[0], self.chunks[0])
        return x.index_select(dim, self.back)

    def put_back(self, dst: Tensor, src: Tensor, dim: int = 0) -> None:
        """dst[back rows] = src (in place)."""
        if self.num_docs == 1:
            dst.narrow(dim, self.chunks[0], self.chunks[0]).copy_(src)
        else:
            dst.index_copy_(dim, self.back, src.to(dst.dtype))

    def add_front(self, dst: Tensor, src: Tensor, dim: int = 0) -> None:
        """dst[front rows] += src (in place)."""
        if self.num_docs == 1:
            dst.narrow(dim, 0, self.chunks[0]).add_(src)
        else:
            dst.index_add_(dim, self.front, src.to(dst.dtype))

    def add_back(self, dst: Tensor, src: Tensor, dim: int = 0) -> None:
        """dst[back rows] += src (in place)."""
        if self.num_docs == 1:
            dst.narrow(dim, self.chunks[0], self.chunks[0]).add_(src)
        else:
            dst.index_add_(dim, self.back, src.to(dst.dtype))


def _doc_lengths(cu_seqlens: Tensor, cp_size: int) -> list[int]:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"cu_seqlens: expected a 1-D integer tensor [B + 1], got {cu_seqlens.dtype} "
            f"{list(cu_seqlens.shape)}"
        )
    cu = [int(x) for x in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    if cu[0] != 0 or any(n <= 0 for n in lengths):
        raise ValueError(f"cu_seqlens: expected 0, then strictly increasing boundaries, got {cu}")
    bad = [n for n in lengths if n % (2 * cp_size)]
    if bad:
        raise ValueError(
            f"context parallelism over {cp_size} ranks needs every document's padded length to "
            f"be a multiple of 2 x cp = {2 * cp_size}; got lengths {bad}. Pack with "
            f"pad_multiple={2 * cp_size} (codraft.learner.data.packing.pack / Packer)"
        )
    return lengths


def zigzag_layout(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> ZigzagLayout:
    """The layout of CP rank ``cp_rank`` of ``cp_size`` for a packed batch's ``cu_seqlens``."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in 0..{cp_size - 1}, got {cp_rank}")
    lengths = _doc_lengths(cu_seqlens, cp_size)
    device = cu_seqlens.device
    lens = torch.tensor(lengths, dtype=torch.int64)
    c = lens // (2 * cp_size)
    starts = torch.cumsum(lens, 0) - lens
    local_cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    local_cu[1:] = torch.cumsum(2 * c, 0)
    n_local = int(local_cu[-1])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), 2 * c, output_size=n_local)
    offset = torch.arange(n_local) - local_cu[doc]
    is_back = offset >= c[doc]
    chunk = torch.where(is_back, 2 * cp_size - 1 - cp_rank, cp_rank)
    index = starts[doc] + chunk * c[doc] + offset - is_back.long() * c[doc]
    rows = torch.arange(n_local)
    half_cu = torch.zeros_like(local_cu)
    half_cu[1:] = torch.cumsum(c, 0)
    return ZigzagLayout(
        cp_size=cp_size,
        cp_rank=cp_rank,
        index=index.to(device),
        local_cu=local_cu.to(torch.int32).to(device),
        half_cu=half_cu.to(torch.int32).to(device),
        front=rows[~is_back].to(device),
        back=rows[is_back].to(device),
        chunks=tuple(int(x) for x in c.tolist()),
    )


def shard(x: Tensor, layout: ZigzagLayout) -> Tensor:
    """This rank's rows of a global per-token tensor [N, ...] -> [N / cp, ...]."""
    return x.index_select(0, layout.index.to(x.device))


def shard_batch(batch: PackedBatch, cp_size: int, cp_rank: int) -> tuple[PackedBatch, ZigzagLayout]:
    """This CP rank's part of a packed batch, and its layout.

    Every per-token field is sharded; ``cu_seqlens`` becomes the local boundaries; ``doc_lens``
    (lengths before padding) and ``positions`` (global, per document) are kept, so
    ``PackedBatch.valid`` still marks real tokens and RoPE sees true positions.
    """
    layout = zigzag_layout(batch.cu_seqlens, cp_size, cp_rank)
    per_token = {"input_ids", "positions", "loss_mask", "taps", "last_hidden", "teacher_logits"}
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if f.name in per_token and value is not None:
            moved[f.name] = shard(value, layout)
    return replace(batch, cu_seqlens=layout.local_cu, **moved), layout


def all_indices(cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """int64 [N]: rank 0's global rows, then rank 1's, ... (the order of an all_gather)."""
    return torch.cat([zigzag_layout(cu_seqlens, cp_size, r).index for r in range(cp_size)])


def unshard_parts(parts: list[Tensor], cu_seqlens: Tensor) -> Tensor:
    """Inverse of :func:`shard` given every rank's local tensor (``parts[r]`` from rank r)."""
    index = all_indices(cu_seqlens, len(parts))
    stacked = torch.cat(parts)
    out = torch.empty_like(stacked)
    out[index.to(stacked.device)] = stacked
    return out


def unshard(
    x: Tensor, layout: ZigzagLayout, cu_seqlens: Tensor, group: ProcessGroup | None
) -> Tensor:
    """Gather every CP rank's local [N / cp, ...] tensor into the global [N, ...] (collective
    over ``group``; no gradient). ``cu_seqlens`` is the global one."""
    if layout.cp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_parts(parts, cu_seqlens)
