"""Attention for the learner: flash-style blocks with log-sum-exp, and TTT branch attention.

- :mod:`codraft.learner.attention.block`: ``block_forward`` / ``block_backward`` / ``merge_lse``,
  the block interface (packed THD, ``lse`` as ``[Hq, Tq]``) used by branch and ring attention; its
  backends are :mod:`~codraft.learner.attention.block_cpu`,
  :mod:`~codraft.learner.attention.block_cuda` and :mod:`~codraft.learner.attention.block_math`
  (what they share: :mod:`~codraft.learner.attention.block_common`).
- :mod:`codraft.learner.attention.branch`: ``branch_attention`` (one autograd Function, trunk +
  branch).
- :mod:`codraft.learner.attention.reference`: dense references, for tests only.
"""

from codraft.learner.attention.block import (
    BlockAttentionFn,
    block_attention,
    block_backward,
    block_forward,
    merge_lse,
)
from codraft.learner.attention.branch import BranchAttentionFn, branch_attention

__all__ = [
    "BlockAttentionFn",
    "BranchAttentionFn",
    "block_attention",
    "block_backward",
    "block_forward",
    "branch_attention",
    "merge_lse",
]
