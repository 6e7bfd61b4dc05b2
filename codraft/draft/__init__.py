"""The EAGLE-3 draft: config, model, draft vocabulary and checkpoint format."""

from codraft.draft.checkpoint import (
    DraftCheckpointError,
    DraftContract,
    DraftMeta,
    check_draft,
    load_draft,
    read_meta,
    save_draft,
    sha256_file,
)
from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft, causal_attention
from codraft.draft.vocab import build_draft_vocab, check_vocab_maps, count_tokens

__all__ = [
    "DraftCheckpointError",
    "DraftConfig",
    "DraftContract",
    "DraftMeta",
    "Eagle3Draft",
    "build_draft_vocab",
    "causal_attention",
    "check_draft",
    "check_vocab_maps",
    "count_tokens",
    "load_draft",
    "read_meta",
    "save_draft",
    "sha256_file",
]
