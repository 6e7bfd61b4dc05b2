"""Point-to-point exchanges inside one CP group: the ring shift and neighbour swaps.

Every exchange is ONE ``torch.distributed.batch_isend_irecv`` over one process group (NCCL
batches such a list into one group call; gloo runs the ops one by one). Peers are named by
their rank inside the group; no tags and no any-source receives are used (NCCL honours neither),
so matching relies only on every rank posting its exchanges in the same order.

:class:`LoopbackRing` stands in for a real group in single-GPU benchmarks: it pretends that every
other rank holds the same tensors as this one, so one rank's compute, buffers and peak memory
are reproduced exactly with no second GPU (the values are meaningless).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


class Pending:
    """Exchanges in flight; :meth:`wait` returns the received tensors once they have landed."""

    def __init__(self, works: list, received: list[Tensor]) -> None:
        self._works = works
        self._received = received

    def wait(self) -> list[Tensor]:
        for w in self._works:
            w.wait()
        self._works = []
        return self._received


class Ring:
    """A CP group seen as a ring: rank r sends to r + 1 and receives from r - 1 (mod size)."""

    def __init__(self, group: ProcessGroup | None, size: int, rank: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"ring rank must be in 0..{size - 1}, got {rank}")
        if size > 1 and group is None and not isinstance(self, LoopbackRing):
            raise ValueError(f"a ring of {size} ranks needs a process group, got None")
        self.group, self.size, self.rank = group, size, rank

    @classmethod
    def of(cls, group: ProcessGroup | None) -> Ring:
        """The ring of a process group (None: a ring of one)."""
        if group is None:
            return cls(None, 1, 0)
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def exchange(
        self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]]
    ) -> Pending:
        """Post sends (tensor, to group rank) and receives (buffer, from group rank) as one
        batch. Every peer must post the matching operations in the same order."""
        ops = [dist.P2POp(dist.isend, t, self._global(p), self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, self._global(p), self.group) for t, p in recvs]
        works = dist.batch_isend_irecv(ops) if ops else []
        return Pending(works, [t for t, _ in recvs])

    def shift(self, *xs: Tensor) -> Pending:
        """Send every tensor of ``xs`` to the next rank and receive the previous rank's tensors
        of the same shapes, as one batch; ``wait()`` returns the received list."""
        if self.size == 1:
            return Pending([], list(xs))
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        sends = [(x.contiguous(), nxt) for x in xs]
        return self.exchange(sends, [(torch.empty_like(x), prev) for x, _ in sends])


class LoopbackRing(Ring):
    """A ring of ``size`` ranks simulated on one device (benchmarks only): :meth:`shift`
    "receives" a copy of what it sends, as if the neighbour held identical tensors."""

    def __init__(self, size: int, rank: int) -> None:
        super().__init__(None, size, rank)

    def exchange(
        self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]]
    ) -> Pending:
        raise NotImplementedError("LoopbackRing simulates ring shifts only (benchmarks)")

    def shift(self, *xs: Tensor) -> Pending:
        return Pending([], [x.clone() for x in xs])
