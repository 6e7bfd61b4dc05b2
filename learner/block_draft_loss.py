"""The training objective of a block drafter (DFlash).

Every row i of a packed document is a block anchored at position i + 1 (see
:mod:`codraft.learner.attention.block_draft`); slot s >= 1 proposes the token at position
i + 1 + s, the packed index ``source[s, i]``. Its loss is the cross-entropy against

* the target's distribution at that position (its logits at ``source - 1``, which predict the
  token at ``source``), when the tap stream carries the target's logits or the learner computes
  them (the teacher), or
* the token itself (hard labels) when not,

counted where the position lies inside the document and is a loss token (the completion, not
the prompt), and where the row is one of the anchors in use (`rows`, all by default). Slot s is
weighted ``exp(-(s - 1) / gamma)`` (DFlash's position decay; 1 everywhere without gamma): an
early slot's mistake ends the accepted prefix, a late slot only counts when all before it were
right. The loss is the weighted mean over the counted tokens. Logits are computed a chunk of
rows at a time (:func:`codraft.learner.chunked_loss.cross_entropy`), never [S, T, V] at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from codraft.learner.chunked_loss import cross_entropy


@dataclass
class BlockDraftLoss:
    loss: Tensor  # the weighted mean, differentiable
    tokens: list[int]  # counted tokens per slot 1..S-1
    correct: list[int]  # of them, how many the draft's argmax got right (its acceptance proxy)


def slot_weight(slot: int, gamma: float | None) -> float:
    """exp(-(slot - 1) / gamma), 1.0 without gamma."""
    return 1.0 if gamma is None else math.exp(-(slot - 1) / gamma)


def counted_rows(source: Tensor, loss_mask: Tensor, rows: Tensor | None) -> Tensor:
    """bool [S, T]: slots whose position is in the document, is a loss token, and whose row is
    an anchor in use; slot 0 (the anchor itself) never counts."""
    inside = source >= 0
    counted = inside & loss_mask[source.clamp(min=0)]
    counted[0] = False
    if rows is not None:
        counted &= rows.unsqueeze(0)
    return counted


def block_draft_loss(
    h: Tensor,
    norm: torch.nn.Module,
    head: Tensor,
    source: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    teacher_logits: Tensor | None = None,
    gamma: float | None = None,
    rows: Tensor | None = None,
    chunk: int = 1024,
) -> BlockDraftLoss:
    """h [S, T, H] the draft's last layer (before its final `norm`), head [V, H] the target's
    lm_head, source [S, T] from `rows_and_slots`, input_ids [T], loss_mask bool [T],
    teacher_logits [T, V] (the target's logits at every packed position) or None."""
    acc = torch.promote_types(h.dtype, torch.float32)
    counted = counted_rows(source, loss_mask.bool(), rows)
    total = h.new_zeros((), dtype=acc)
    weight_sum = 0.0
    tokens, correct = [], []
    for s in range(1, h.shape[0]):
        at = counted[s].nonzero().squeeze(1)
        tokens.append(int(at.numel()))
        if at.numel() == 0:
            correct.append(0)
            continue
        index = source[s, at]
        if teacher_logits is None:
            ce, right = cross_entropy(
                norm(h[s, at]), head, input_ids, hard=True, chunk=chunk, acc=acc, index=index
            )
        else:
            ce, right = cross_entropy(
                norm(h[s, at]), head, teacher_logits, hard=False, chunk=chunk, acc=acc,
                index=index - 1,
            )  # fmt: skip
        w = slot_weight(s, gamma)
        total = total + w * ce
        weight_sum += w * at.numel()
        correct.append(int(right))
    # nothing counted (a batch of prompts only): a zero that still reaches every parameter
    loss = total / weight_sum if weight_sum else norm(h).sum() * 0.0
    return BlockDraftLoss(loss=loss, tokens=tokens, correct=correct)
