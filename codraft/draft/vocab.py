"""The draft vocabulary: the N most frequent target tokens, and the d2t / t2d maps between them.

Draft id i stands for target id `i + d2t[i]` (d2t int64 [N], EAGLE-3's offset encoding, which is
what vLLM and SGLang read); `t2d` is a bool mask over the target vocab marking the tokens the
draft can propose. Draft ids are the chosen target ids in ascending order, so
`target_logits[..., t2d]` lists the teacher's logits in draft-id order.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(token_id_tensors: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs across the given tensors: int64 [vocab_size]."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i, ids in enumerate(token_id_tensors):
        ids = torch.as_tensor(ids)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {ids.dtype} (tensor {i})")
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        if flat.numel() == 0:
            continue
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} in tensor {i} is outside the target vocab 0..{vocab_size - 1}"
            )
        counts += torch.bincount(flat, minlength=vocab_size)
    return counts


def build_draft_vocab(
    counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent ids (ties: lower id first), sorted by id.

    Returns (d2t int64 [N], t2d bool [V]) with d2t[i] = target_id(i) - i.
    """
    if counts.dim() != 1:
        raise ValueError(f"counts must be 1-D [vocab_size], got shape {list(counts.shape)}")
    vocab_size = counts.numel()
    n = int(draft_vocab_size)
    if not 1 <= n <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target vocab size), got {n}"
        )
    counts = counts.to(device="cpu", dtype=torch.int64)
    # A stable ascending sort of -count keeps equal counts in ascending id order.
    order = torch.argsort(-counts, stable=True)
    target_ids = order[:n].sort().values
    return ids_to_maps(target_ids, vocab_size)


def ids_to_maps(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for strictly increasing target ids (draft id i -> target_ids[i])."""
    target_ids = target_ids.to(device="cpu", dtype=torch.int64)
    d2t = target_ids - torch.arange(target_ids.numel(), dtype=torch.int64, device="cpu")
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")  # whatever the default device
    t2d[target_ids] = True
    check_vocab_maps(d2t, t2d, vocab_size)
    return d2t, t2d


def identity_maps(draft_vocab_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft id i -> target id i: the maps of a full-vocab draft (or an untrained vocab)."""
    return ids_to_maps(torch.arange(draft_vocab_size, device="cpu"), vocab_size)


def check_vocab_maps(
    d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int | None = None
) -> None:
    """Raise ValueError naming the first inconsistency between d2t, t2d and the vocab sizes."""
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise ValueError(f"d2t must be int64 [N], got {d2t.dtype} {list(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"t2d must be bool [V], got {t2d.dtype} {list(t2d.shape)}")
    n = d2t.numel()
    if draft_vocab_size is not None and n != draft_vocab_size:
        raise ValueError(f"d2t has {n} entries, expected draft_vocab_size {draft_vocab_size}")
    if t2d.numel() != vocab_size:
        raise ValueError(f"t2d has {t2d.numel()} entries, expected target vocab {vocab_size}")
    targets = torch.arange(n, dtype=torch.int64, device=d2t.device) + d2t
    if n and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        bad = int(((targets < 0) | (targets >= vocab_size)).nonzero()[0])
        raise ValueError(
            f"d2t maps draft id {bad} to target id {int(targets[bad])}, outside the target "
            f"vocab 0..{vocab_size - 1}"
        )
    if n > 1 and not bool((targets[1:] > targets[:-1]).all()):
        bad = int((targets[1:] <= targets[:-1]).nonzero()[0]) + 1
        raise ValueError(
            f"d2t targets must be strictly increasing (draft ids are the chosen target ids in "
            f"ascending order), but draft id {bad} maps to {int(targets[bad])} after "
            f"{int(targets[bad - 1])}"
        )
    marked = int(t2d.sum())
    if marked != n:
        raise ValueError(f"t2d marks {marked} target ids, expected draft_vocab_size {n}")
    where = t2d.nonzero().flatten().to(targets.device)
    if not torch.equal(where, targets):
        bad = int((where != targets).nonzero()[0])
        raise ValueError(
            f"t2d positions differ from d2t targets: draft id {bad} maps to target "
            f"{int(targets[bad])} by d2t, but the {bad}-th id marked in t2d is {int(where[bad])}"
        )
