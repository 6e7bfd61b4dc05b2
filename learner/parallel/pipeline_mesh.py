"""A rank's pipeline inside the learner mesh, and the process groups of its TapChannel.

The mesh (`codraft.learner.parallel.mesh`, pp x dp x cp) already has one "pp" group per pipeline:
the stages that pass activations to each other. TapChannel must not share it (see
`codraft.learner.parallel.tapchannel`), so every pipeline gets two more groups over the same ranks:
one for tap data, one for credits. `PipelineGroups.build` creates them; like every `new_group` it is
collective: all ranks call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from codraft.learner.parallel.mesh import ParallelMesh
from codraft.learner.parallel.stage import taps_by_stage
from codraft.learner.parallel.tapchannel import TapChannel, TapChannelConfig


@dataclass
class PipelineGroups:
    """This rank's place in its pipeline and the groups it talks over."""

    stage: int  # this rank's stage index
    stage_ranks: list[int]  # global rank of every stage of this pipeline, in stage order
    pp_group: dist.ProcessGroup | None  # activations (the mesh's "pp" group)
    tap_group: dist.ProcessGroup | None  # TapChannel puts
    credit_group: dist.ProcessGroup | None  # TapChannel credits

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def build(cls, mesh: ParallelMesh, tap_timeout_s: float | None = None) -> PipelineGroups:
        """The pipeline of `mesh.rank`, with two new groups per pipeline for TapChannel.
        Collective. `tap_timeout_s` sets those groups' watchdog (default: torch's)."""
        dims = mesh.dims
        pipelines = dims.groups("pp")
        timeout = None if tap_timeout_s is None else timedelta(seconds=tap_timeout_s)
        mine: dict[str, dist.ProcessGroup | None] = {"tap": None, "credit": None}
        if dims.pp > 1:
            for kind in ("tap", "credit"):  # same order on every rank
                for ranks in pipelines:
                    g = dist.new_group(ranks, timeout=timeout)
                    if mesh.rank in ranks:
                        mine[kind] = g
        stage_ranks = dims.group_of("pp", mesh.rank)
        return cls(
            stage=stage_ranks.index(mesh.rank),
            stage_ranks=stage_ranks,
            pp_group=mesh.pp_group,
            tap_group=mine["tap"],
            credit_group=mine["credit"],
        )

    def names(self) -> dict[int, str]:
        return {r: f"stage {s} (rank {r})" for s, r in enumerate(self.stage_ranks)}

    def tap_sources(self, tap_layers: Sequence[int], ranges: Sequence[range]) -> list[int]:
        """Global ranks of the stages other than the last that make taps of `tap_layers`."""
        per_stage = taps_by_stage(tap_layers, ranges)
        return [self.stage_ranks[s] for s, taps in enumerate(per_stage[:-1]) if taps]

    def tap_channel(
        self,
        tap_layers: Sequence[int],
        ranges: Sequence[range],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        config: TapChannelConfig | None = None,
        channel_cls: type[TapChannel] = TapChannel,
    ) -> TapChannel | None:
        """TapChannel from the tap-making stages to the last stage (None when no tap is made
        before the last stage). Every stage of the pipeline builds it; only sources and the
        receiver use it."""
        sources = self.tap_sources(tap_layers, ranges)
        if not sources:
            return None
        if self.tap_group is None or self.credit_group is None:
            raise RuntimeError("TapChannel needs the pipeline's tap groups: build with pp > 1")
        return channel_cls(
            self.tap_group,
            self.credit_group,
            sources,
            self.stage_ranks[-1],
            dtype=dtype,
            device=device,
            config=config,
            names=self.names(),
        )
