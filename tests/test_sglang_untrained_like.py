"""scripts/gpu_sglang/untrained_like.py: the starting draft a GPU check needs to swap in a draft
trained elsewhere (SGLang keeps the starting draft's vocabulary map for good)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from codraft.draft.checkpoint import load_draft, read_meta
from codraft.draft.init import write_new_draft

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "gpu_sglang"))
from untrained_like import untrained_like  # noqa: E402


def test_the_untrained_draft_keeps_the_trained_ones_map_and_nothing_else(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    counts = torch.zeros(512, dtype=torch.long)
    counts[300:364] = 10  # a map other than the first ids: what a learner may pick
    trained = write_new_draft(tmp_path / "t", tiny_llama_dir, counts, draft_vocab_size=64,
                              version=7, seed=3)  # fmt: skip
    default = write_new_draft(tmp_path / "d", tiny_llama_dir, draft_vocab_size=64)
    out = untrained_like(trained, tmp_path / "v0", tiny_llama_dir)
    a, meta = load_draft(out)
    t, _ = load_draft(trained)
    d, _ = load_draft(default)
    assert torch.equal(a.d2t, t.d2t) and torch.equal(a.t2d, t.t2d)
    assert not torch.equal(a.d2t, d.d2t)  # the map is the trained one's, not a fresh one's
    assert a.config == t.config
    assert meta.version == 0 and meta.counters == {"step": 0}
    assert read_meta(trained).version == 7
    assert not torch.equal(a.fc.weight, t.fc.weight)  # the weights are not the trained ones
