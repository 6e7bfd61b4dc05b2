"""EAGLE-3 training-time test (TTT): K unrolled draft passes over a packed THD batch, and the loss.

Conventions (docs/architecture.md, Training), with passes numbered d = 1..K:

* pass 1 at anchor i reads ``cat(e(x[i+1]), fc(taps[i]))``; pass d > 1 reads
  ``cat(e(x[i+d]), h[d-1][i])`` where ``h[d-1]`` is pass d-1's output before the final norm
  (not detached);
* the RoPE position of pass d at anchor i is ``pos[i] + d - 1``;
* pass d predicts ``x[i+d+1]``; its teacher is the target's distribution at position ``i+d``
  restricted to the draft vocab; it counts where ``i+d`` lies in the same document and
  ``loss_mask[i+d] == 1`` (the mask marks positions whose next token the draft should learn);
* attention: pass d's query at i sees pass 1's keys at 0..i of its document (the trunk) and its
  own anchor's keys from passes 2..d (the branch) — see codraft.learner.attention.branch.

The loss of pass d is the soft cross-entropy summed over its valid anchors and divided by the
*global* count of valid anchors of that pass (``reduce_counts`` all-reduces it across data/context
parallel ranks); the total is the weighted sum over passes. Logits and loss are computed
``loss_chunk_tokens`` anchors at a time and never kept for backward
(codraft.learner.chunked_loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from codraft.draft.model import Eagle3Draft
from codraft.learner.chunked_loss import cross_entropy

# attn(q_d [T, Hq, D], ks [k_1..k_d] each [T, Hkv, D], vs, cu_seqlens) -> out_d [T, Hq, D]
PassAttention = Callable[[Tensor, Sequence[Tensor], Sequence[Tensor], Tensor], Tensor]
CountReducer = Callable[[Tensor], Tensor]

MAX_PASSES = 8


@dataclass
class TTTConfig:
    num_passes: int = 3
    pass_weights: tuple[float, ...] | None = None  # default 0.8 ** (d - 1)
    loss_chunk_tokens: int = 4096  # anchors whose draft logits exist at once
    recompute_mlp: bool = False  # each pass's o_proj + MLP run again in backward, not kept

    def __post_init__(self) -> None:
        if not 1 <= self.num_passes <= MAX_PASSES:
            raise ValueError(f"num_passes must be in 1..{MAX_PASSES}, got {self.num_passes}")
        if self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")
        if self.pass_weights is not None and len(self.pass_weights) != self.num_passes:
            raise ValueError(
                f"pass_weights has {len(self.pass_weights)} entries, expected one per pass "
                f"({self.num_passes})"
            )

    @property
    def weights(self) -> tuple[float, ...]:
        if self.pass_weights is not None:
            return tuple(float(w) for w in self.pass_weights)
        return tuple(0.8**d for d in range(self.num_passes))


@dataclass
class TTTOutput:
    loss: Tensor  # scalar, weighted sum of per-pass losses
    pass_loss: list[Tensor]  # per pass, already normalised by the global valid count (detached)
    pass_valid: list[Tensor]  # per pass, local count of valid anchors
    pass_correct: list[Tensor]  # per pass, local count of anchors whose argmax matches the teacher
    pass_global_valid: list[Tensor]  # per pass, the denominators used


def doc_ends(cu_seqlens: Tensor, n: int) -> Tensor:
    """For each of the n packed tokens, the (exclusive) end index of its document."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[1:], lengths, output_size=n)


def roll_left(x: Tensor, shift: int, ends: Tensor, fill: float | int = 0) -> Tensor:
    """y[i] = x[i + shift] when i + shift is in i's document, else `fill` (dim 0 is tokens)."""
    if shift == 0:
        return x
    n = x.shape[0]
    idx = torch.arange(n, device=x.device) + shift
    inside = idx < ends
    y = x[idx.clamp(max=n - 1)]
    mask = inside.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, y, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


class Roll(Protocol):
    """Per-document left shifts of per-token tensors: on one device (LocalRoll) or across the
    zigzag shards of context parallelism (codraft.learner.parallel.roll.BoundaryRoll)."""

    def roll_left(self, x: Tensor, shift: int, fill: float | int = 0) -> Tensor:
        """y[i] = x[i + shift] inside i's document, else fill (dim 0 is tokens)."""
        ...

    def gather_ahead(self, x: Tensor, shift: int, rows: Tensor) -> Tensor:
        """x[rows + shift] for rows whose ``row + shift`` is inside their document."""
        ...

    def ahead_index(self, shift: int, rows: Tensor) -> Tensor | None:
        """The local rows `gather_ahead(x, shift, rows)` reads, when it reads only local rows
        (then x[index] is the same); None when some come from other ranks."""
        ...


class LocalRoll:
    """Rolls of a whole packed batch on one device."""

    def __init__(self, cu_seqlens: Tensor, num_tokens: int) -> None:
        self.ends = doc_ends(cu_seqlens, num_tokens)

    def roll_left(self, x: Tensor, shift: int, fill: float | int = 0) -> Tensor:
        return roll_left(x, shift, self.ends, fill)

    def gather_ahead(self, x: Tensor, shift: int, rows: Tensor) -> Tensor:
        return x[rows + shift]

    def ahead_index(self, shift: int, rows: Tensor) -> Tensor | None:
        return rows + shift


def teacher_targets(
    teacher_logits: Tensor | None, input_ids: Tensor, t2d: Tensor, roll: Roll
) -> tuple[Tensor, Tensor]:
    """Per-position training targets over the draft vocab, and where they are defined.

    With `teacher_logits` ([N, draft_vocab], the target's logits of the draft vocab) they are
    used as they are: the loss takes their softmax a chunk at a time. Without (hard-label
    fallback) position j's target is the one-hot of the next token x[j+1] in draft-id space,
    defined only where x[j+1] is in the same document and in the draft vocab.
    """
    n = input_ids.shape[0]
    if teacher_logits is not None:
        if teacher_logits.shape[0] != n:
            raise ValueError(
                f"teacher_logits has {teacher_logits.shape[0]} rows, expected one per token ({n})"
            )
        return teacher_logits, torch.ones(n, dtype=torch.bool, device=input_ids.device)
    nxt = roll.roll_left(input_ids, 1, fill=-1)
    in_doc = nxt >= 0
    t2d = t2d.to(input_ids.device)
    draft_index = torch.cumsum(t2d.to(torch.int64), 0) - 1  # target id -> draft id
    safe = nxt.clamp(min=0)
    in_vocab = t2d[safe] & in_doc
    labels = draft_index[safe].clamp(min=0)
    return labels, in_vocab


def ttt_forward(
    draft: Eagle3Draft,
    input_ids: Tensor,
    positions: Tensor,
    cu_seqlens: Tensor,
    taps: Tensor,
    loss_mask: Tensor,
    attn: PassAttention,
    config: TTTConfig | None = None,
    teacher_logits: Tensor | None = None,
    reduce_counts: CountReducer | None = None,
    *,
    roll: Roll | None = None,
) -> TTTOutput:
    """Run K TTT passes over a packed batch and return the loss (see module docstring).

    Shapes: input_ids/positions/loss_mask [N]; cu_seqlens int32 [docs + 1]; taps
    [N, n_taps * target_H] in any float dtype (`Eagle3Draft.fuse` casts them); teacher_logits
    [N, draft_vocab] or None for hard labels. Under context parallelism these are one rank's
    zigzag shard, `attn` is ring attention and `roll` moves chunk-boundary rows between ranks;
    pass_valid/pass_correct are then rank-local.
    """
    config = config or TTTConfig()
    roll = roll or LocalRoll(cu_seqlens, input_ids.shape[0])
    targets, defined = teacher_targets(teacher_logits, input_ids, draft.t2d, roll)
    usable = defined & (loss_mask.to(torch.bool))
    hard = teacher_logits is None

    # Passes' valid anchors: x[i+d] in the document and target position i+d usable.
    valid = [roll.roll_left(usable, d, fill=False) for d in range(1, config.num_passes + 1)]
    local = torch.stack([v.sum() for v in valid]).to(torch.float64)
    global_valid = reduce_counts(local.clone()) if reduce_counts is not None else local

    # the loss in fp32 (fp64 for fp64 checks)
    acc = torch.promote_types(draft.fc.weight.dtype, torch.float32)
    total = taps.new_zeros((), dtype=acc)
    out = TTTOutput(total, [], [], [], [])
    passes = draft_states(
        draft, input_ids, positions, cu_seqlens, taps, attn, config.num_passes, roll=roll,
        recompute_mlp=config.recompute_mlp,
    )  # fmt: skip
    for d, h in passes:
        rows = torch.nonzero(valid[d - 1]).squeeze(1)
        # the teacher rows read where they lie (no per-pass copy kept), unless other ranks hold some
        index = roll.ahead_index(d, rows)
        tgt = roll.gather_ahead(targets, d, rows) if index is None else targets
        ce, correct = cross_entropy(
            draft.norm(h[rows]), draft.lm_head.weight, tgt,
            hard=hard, chunk=config.loss_chunk_tokens, acc=acc, index=index,
        )  # fmt: skip
        denom = global_valid[d - 1].clamp(min=1).to(ce.dtype)
        pass_loss = ce / denom
        total = total + config.weights[d - 1] * pass_loss
        out.pass_loss.append(pass_loss.detach())
        out.pass_valid.append(local[d - 1])
        out.pass_correct.append(correct)
        out.pass_global_valid.append(global_valid[d - 1])
    out.loss = total
    return out


def draft_states(
    draft: Eagle3Draft,
    input_ids: Tensor,
    positions: Tensor,
    cu_seqlens: Tensor,
    taps: Tensor,
    attn: PassAttention,
    num_passes: int,
    *,
    roll: Roll | None = None,
    recompute_mlp: bool = False,
) -> Iterator[tuple[int, Tensor]]:
    """Yield (d, pass d's output before the final norm [N, H]) for passes d = 1..num_passes
    (teacher-forced: pass d at anchor i reads the true token x[i+d], which is the draft's own
    proposal whenever passes 1..d-1 were right: the only case in which pass d matters for chain
    drafting). With `recompute_mlp` each pass keeps only the attention output and the residual
    for backward and runs o_proj and the MLP again there (the attention itself, ring
    collectives included under CP, runs once)."""
    roll = roll or LocalRoll(cu_seqlens, input_ids.shape[0])
    h = draft.fuse(taps)
    ks: list[Tensor] = []
    vs: list[Tensor] = []
    for d in range(1, num_passes + 1):
        ids_d = roll.roll_left(input_ids, d, fill=0)
        q, k, v, residual = draft.qkv(draft.embed(ids_d), h, positions + (d - 1))
        ks.append(k)
        vs.append(v)
        a = attn(q, ks, vs, cu_seqlens)
        if recompute_mlp:
            h = checkpoint(draft.finish, a, residual, use_reentrant=False)
        else:
            h = draft.finish(a, residual)
        yield d, h
