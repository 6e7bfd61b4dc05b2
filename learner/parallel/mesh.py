"""The learner's device mesh: pp x dp x cp ranks from the world size, and their process groups.

Modelled on torchtitan's ``ParallelDims``: one small object says how the world splits, another
holds the groups; parallelism is applied to plain code from outside by handing it a group.

Rank order puts context parallelism innermost, so the ranks of one CP group are neighbours
(the same host, NVLink, when CP <= GPUs per host):

    rank = (pp_index * dp + dp_index) * cp + cp_index

Groups (every rank belongs to exactly one of each kind):

* ``cp``: the ranks that split one batch's tokens (ring attention, boundary rolls);
* ``dp``: the ranks that hold the same tokens of different batches (same cp and pp index);
* ``dp_cp``: all ranks of one pipeline stage; the TTT loss denominators and the gradients are
  reduced over it (every token of every batch counts once);
* ``pp``: the stages of one pipeline (later: recompute mode with TapChannel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

GROUP_KINDS = ("cp", "dp", "dp_cp", "pp")


@dataclass(frozen=True)
class ParallelDims:
    """How ``world_size`` ranks split into pipeline stages x data replicas x context shards.

    ``dp = -1`` (default) takes whatever ``world_size / (cp * pp)`` leaves.
    """

    world_size: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = -1

    def __post_init__(self) -> None:
        for name in ("world_size", "cp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name}: expected an integer >= 1, got {value!r}")
        if self.dp == -1:
            if self.world_size % (self.cp * self.pp):
                raise ValueError(
                    f"world size {self.world_size} is not divisible by cp x pp = "
                    f"{self.cp} x {self.pp}; start torchrun with a multiple of "
                    f"{self.cp * self.pp} processes or change --cp/--pp"
                )
            object.__setattr__(self, "dp", self.world_size // (self.cp * self.pp))
        elif not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"ParallelDims.dp: expected an integer >= 1 or -1, got {self.dp!r}")
        if self.dp * self.cp * self.pp != self.world_size:
            raise ValueError(
                f"expected dp x cp x pp = world size, got {self.dp} x {self.cp} x {self.pp} = "
                f"{self.dp * self.cp * self.pp} for world size {self.world_size}; leave dp at -1 "
                "to infer it"
            )

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_index, dp_index, cp_index) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        return rank // (self.dp * self.cp), (rank // self.cp) % self.dp, rank % self.cp

    def rank_of(self, pp_index: int, dp_index: int, cp_index: int) -> int:
        return (pp_index * self.dp + dp_index) * self.cp + cp_index

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as sorted global rank lists, in a fixed order."""
        pp, dp, cp = self.pp, self.dp, self.cp
        if kind == "cp":
            return [
                [self.rank_of(p, d, c) for c in range(cp)] for p in range(pp) for d in range(dp)
            ]
        if kind == "dp":
            return [
                [self.rank_of(p, d, c) for d in range(dp)] for p in range(pp) for c in range(cp)
            ]
        if kind == "dp_cp":
            return [
                [self.rank_of(p, d, c) for d in range(dp) for c in range(cp)] for p in range(pp)
            ]
        if kind == "pp":
            return [
                [self.rank_of(p, d, c) for p in range(pp)] for d in range(dp) for c in range(cp)
            ]
        raise ValueError(f"expected a group kind in {GROUP_KINDS}, got {kind!r}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group of one kind."""
        return next(g for g in self.groups(kind) if rank in g)


@dataclass
class ParallelMesh:
    """One rank's place in the mesh and its process groups. A group of one rank is None (no
    communicator is built for it; every collective over it is skipped)."""

    dims: ParallelDims
    rank: int
    groups: dict[str, ProcessGroup | None]

    @classmethod
    def build(cls, dims: ParallelDims) -> ParallelMesh:
        """Create every group of every kind. Collective: all ranks must call it, in step."""
        if not dist.is_available() or not dist.is_initialized():
            if dims.world_size != 1:
                raise RuntimeError(
                    f"a mesh of world size {dims.world_size} needs torch.distributed: start "
                    "under torchrun and call codraft.learner.parallel.launch.init_distributed (or "
                    "torch.distributed.init_process_group) first"
                )
            return cls(dims, 0, dict.fromkeys(GROUP_KINDS))
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != dims.world_size:
            raise ValueError(
                f"the process group has {world} ranks but the mesh expects {dims.world_size}; "
                "build ParallelDims with world_size=torch.distributed.get_world_size()"
            )
        mine: dict[str, ProcessGroup | None] = dict.fromkeys(GROUP_KINDS)
        for kind in GROUP_KINDS:  # same order on every rank: new_group is collective
            for ranks in dims.groups(kind):
                if len(ranks) == 1:  # a group of one needs no communicator
                    continue
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = group
        return cls(dims, rank, mine)

    @classmethod
    def single(cls) -> ParallelMesh:
        """World size 1, no process groups."""
        return cls(ParallelDims(1), 0, dict.fromkeys(GROUP_KINDS))

    @property
    def cp_group(self) -> ProcessGroup | None:
        return self.groups["cp"]

    @property
    def dp_group(self) -> ProcessGroup | None:
        return self.groups["dp"]

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        return self.groups["dp_cp"]

    @property
    def pp_group(self) -> ProcessGroup | None:
        return self.groups["pp"]

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one rank that logs, checkpoints and publishes."""
        return self.rank == 0
