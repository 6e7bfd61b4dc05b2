"""A new (untrained) draft for a target, geometry from the target: EAGLE-3 (vocab from token
counts), DFlash or DSpark (the target's whole vocabulary)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from codraft.draft.checkpoint import DraftMeta, save_draft
from codraft.draft.config import DraftConfig
from codraft.draft.dflash import DFlashDraft
from codraft.draft.dflash_config import DFlashConfig, dflash_tap_layers
from codraft.draft.dspark import DSparkDraft
from codraft.draft.dspark_config import DSparkConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.drafters import DRAFTERS
from codraft.models.config import TargetConfig


def new_draft(
    target: TargetConfig,
    token_counts: torch.Tensor | None = None,
    *,
    draft_vocab_size: int | None = None,
    tap_layers: Sequence[int] | None = None,
    dtype: str = "float32",
    seed: int = 0,
) -> Eagle3Draft:
    """A freshly initialised draft. With `token_counts` ([target vocab] int) its vocabulary is
    the most frequent tokens; without, the first `draft_vocab_size` ids."""
    cfg = DraftConfig.from_target(
        target, draft_vocab_size=draft_vocab_size, tap_layers=tap_layers, dtype=dtype
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Eagle3Draft(cfg)
    if token_counts is not None:
        model.set_vocab(*build_draft_vocab(token_counts, cfg.draft_vocab_size))
    return model


def new_dflash_draft(
    target: TargetConfig,
    *,
    mask_token_id: int = DFlashConfig.mask_token_id,
    num_hidden_layers: int = DFlashConfig.num_hidden_layers,
    block_size: int = DFlashConfig.block_size,
    tap_layers: Sequence[int] | None = None,
    dtype: str = "float32",
    seed: int = 0,
    markov_rank: int | None = None,
) -> DFlashDraft:
    """A freshly initialised DFlash draft, or with `markov_rank` a DSpark draft (a DFlash
    backbone of `block_size` queries and a Markov head of that rank); taps default to
    `dflash_tap_layers(L)`."""
    cls = DFlashConfig if markov_rank is None else DSparkConfig
    cfg = cls.from_target(
        target, mask_token_id=mask_token_id, num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        tap_layers=tap_layers or dflash_tap_layers(target.num_hidden_layers), dtype=dtype,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if isinstance(cfg, DSparkConfig):
            return DSparkDraft(replace(cfg, markov_rank=markov_rank))
        return DFlashDraft(cfg)


def write_new_draft(
    out_dir: str | Path,
    target_dir: str | Path,
    token_counts: torch.Tensor | None = None,
    *,
    version: int = 0,
    overwrite: bool = False,
    target_config: TargetConfig | None = None,
    drafter: str = "eagle3",
    **kwargs,
) -> Path:
    """`new_draft` (or, with drafter "dflash" or "dspark", `new_dflash_draft`) for the target folder
    `target_dir`, saved as checkpoint `out_dir`. `target_config`: the folder's parsed
    config.json, when the caller has read it already."""
    target = (
        target_config if target_config is not None else TargetConfig.from_pretrained(target_dir)
    )
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if drafter in ("dflash", "dspark"):
        if token_counts is not None:
            raise ValueError(f"a {drafter} draft reads out with the whole vocabulary: no counts")
        if drafter == "dspark":
            kwargs.setdefault("markov_rank", DSparkConfig.markov_rank)
        model: Eagle3Draft | DFlashDraft = new_dflash_draft(target, **kwargs)
    else:
        model = new_draft(target, token_counts, **kwargs)
    # counters step 0: never trained (a learner starts afresh rather than from these weights)
    meta = DraftMeta(version=version, counters={"step": 0})
    return save_draft(out_dir, model, meta, overwrite=overwrite)
