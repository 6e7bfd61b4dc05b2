"""What :mod:`codraft.learner.attention.block` and its backends share: document boundaries and lse
dtype.

A leaf module (it imports no other attention module), so that the dispatcher
(:mod:`codraft.learner.attention.block`) can import the backends
(:mod:`~codraft.learner.attention.block_cpu`, :mod:`~codraft.learner.attention.block_cuda`,
:mod:`~codraft.learner.attention.block_math`) and they can import this without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Segments:
    """Host copy of the document boundaries of one block."""

    q: list[int]  # cu_seqlens_q as Python ints, length B + 1
    k: list[int]  # cu_seqlens_k as Python ints, length B + 1

    def docs(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_end, k_start, k_end) per document."""
        return [
            (self.q[b], self.q[b + 1], self.k[b], self.k[b + 1]) for b in range(len(self.q) - 1)
        ]

    @property
    def max_q(self) -> int:
        return max((self.q[b + 1] - self.q[b] for b in range(len(self.q) - 1)), default=0)

    @property
    def max_k(self) -> int:
        return max((self.k[b + 1] - self.k[b] for b in range(len(self.k) - 1)), default=0)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The lse dtype of a block: float64 for fp64 inputs, float32 for fp32/bf16/fp16."""
    return torch.float64 if dtype == torch.float64 else torch.float32
