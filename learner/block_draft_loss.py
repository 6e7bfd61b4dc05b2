"""The training objective of a block drafter (DFlash, DSpark).

Every row i of a packed document is a block anchored at position i + 1 (see
:mod:`codraft.learner.attention.block_draft`). The draft says which of its slots propose which
token (`proposals`): DFlash's slot s >= 1 the token at its own position i + 1 + s, DSpark's
slot s >= 0 the one after it. Proposal d (1-based) of row i predicts the packed index
``predicted[d - 1, i]``, and its loss is the cross-entropy against

* the target's distribution at that position (its logits one position earlier, which predict
  it), when the tap stream carries the target's logits or the learner computes them (the
  teacher), or
* the token itself (hard labels) when not,

counted where the position lies inside the document and is a loss token (the completion, not
the prompt), and where the row is one of the anchors in use (`rows`, all by default). Proposal d
is weighted ``exp(-(d - 1) / gamma)`` (DFlash's position decay; 1 everywhere without gamma): an
early proposal's mistake ends the accepted prefix, a late one only counts when all before it
were right. The loss is the weighted mean over the counted tokens. Logits are computed a chunk
of rows at a time (:func:`codraft.learner.chunked_loss.cross_entropy`), never [D, T, V] at once.

A draft with a sequential stage (DSpark's Markov head) adds a bias from the token before each
proposed one (the true token: teacher forcing); `markov` gives it as extra features and head
columns, so the chunked loss computes ``cat(norm(h), e) @ cat(lm_head, w2).T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from codraft.learner.chunked_loss import cross_entropy


@dataclass
class BlockDraftLoss:
    loss: Tensor  # the weighted mean, differentiable
    tokens: list[int]  # counted tokens per proposal 1..D
    correct: list[int]  # of them, how many the draft's argmax got right (its acceptance proxy)


def slot_weight(proposal: int, gamma: float | None) -> float:
    """exp(-(proposal - 1) / gamma), 1.0 without gamma (proposals count from 1)."""
    return 1.0 if gamma is None else math.exp(-(proposal - 1) / gamma)


def counted_rows(predicted: Tensor, loss_mask: Tensor, rows: Tensor | None) -> Tensor:
    """bool [D, T]: proposals whose position is in the document, is a loss token, and whose
    row is an anchor in use."""
    counted = (predicted >= 0) & loss_mask[predicted.clamp(min=0)]
    if rows is not None:
        counted &= rows.unsqueeze(0)
    return counted


Markov = Callable[[Tensor], "tuple[Tensor, Tensor] | None"]


def block_draft_loss(
    h: Tensor,
    norm: torch.nn.Module,
    head: Tensor,
    predicted: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    teacher_logits: Tensor | None = None,
    gamma: float | None = None,
    rows: Tensor | None = None,
    chunk: int = 1024,
    markov: Markov | None = None,
) -> BlockDraftLoss:
    """h [D, T, H] the draft's last layer (before its final `norm`) at each proposal, head
    [V, H] the target's lm_head, predicted [D, T] the packed index each proposal predicts (-1
    for none; both from the draft's `proposals`), input_ids [T], loss_mask bool [T],
    teacher_logits [T, V] (the target's logits at every packed position) or None; markov:
    previous token ids [n] -> (features [n, r], head columns [V, r]), or None."""
    acc = torch.promote_types(h.dtype, torch.float32)
    counted = counted_rows(predicted, loss_mask.bool(), rows)
    total = h.new_zeros((), dtype=acc)
    weight_sum = 0.0
    tokens, correct = [], []
    head_and_markov = None  # cat(lm_head, w2): built once, read by every proposal
    for d in range(h.shape[0]):
        at = counted[d].nonzero().squeeze(1)
        tokens.append(int(at.numel()))
        if at.numel() == 0:
            correct.append(0)
            continue
        index = predicted[d, at]
        x, w = norm(h[d, at]), head
        extra = markov(input_ids[index - 1]) if markov is not None else None
        if extra is not None:
            e, w2 = extra
            x = torch.cat([x, e.to(x.dtype)], dim=-1)
            if head_and_markov is None:
                head_and_markov = torch.cat([head.to(w2.dtype), w2], dim=1)
            w = head_and_markov
        if teacher_logits is None:
            ce, right = cross_entropy(x, w, input_ids, hard=True, chunk=chunk, acc=acc, index=index)
        else:
            ce, right = cross_entropy(
                x, w, teacher_logits, hard=False, chunk=chunk, acc=acc, index=index - 1
            )
        wd = slot_weight(d + 1, gamma)
        total = total + wd * ce
        weight_sum += wd * at.numel()
        correct.append(int(right))
    # nothing counted (a batch of prompts only): a zero that still reaches every parameter
    loss = total / weight_sum if weight_sum else norm(h).sum() * 0.0
    if not weight_sum and markov is not None:
        extra = markov(input_ids[:1])
        if extra is not None:
            loss = loss + sum(t.sum() for t in extra) * 0.0
    return BlockDraftLoss(loss=loss, tokens=tokens, correct=correct)
