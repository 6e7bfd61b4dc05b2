"""Attention for the learner: flash-style blocks with log-sum-exp, and TTT branch attention.

- :mod:`learner.attention.block`: ``block_forward`` / ``block_backward`` / ``merge_lse``, the
  block interface (packed THD, ``lse`` as ``[Hq, Tq]``) used by branch and ring attention; its
  backends are :mod:`~learner.attention.block_cpu`, :mod:`~learner.attention.block_cuda` and
  :mod:`~learner.attention.block_math` (what they share: :mod:`~learner.attention.block_common`).
- :mod:`learner.attention.branch`: ``branch_attention`` (one autograd Function, trunk + branch).
- :mod:`learner.attention.reference`: dense references, for tests only.
"""

from learner.attention.block import (
    BlockAttentionFn,
    block_attention,
    block_backward,
    block_forward,
    merge_lse,
)
from learner.attention.branch import BranchAttentionFn, branch_attention

__all__ = [
    "BlockAttentionFn",
    "BranchAttentionFn",
    "block_attention",
    "block_backward",
    "block_forward",
    "branch_attention",
    "merge_lse",
]
