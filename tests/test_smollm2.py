"""The real model: SmolLM2-135M-Instruct prepared offline from its PyPI package.

The first run converts the GGUF (about half a minute); later runs reuse the cached folder.
codraft's TargetModel must match transformers on it, taps included.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from codraft.models.config import TargetConfig
from codraft.models.llama import load_target
from codraft.prepare import STAMP, prepare_smollm2, sha256_file

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare_smollm2().path


def test_prepared_folder_is_loadable_by_vllm_and_reused(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config, "vLLM refuses a folder that names gguf quant"
    assert config["architectures"] == ["LlamaForCausalLM"]
    stamp = json.loads((smollm2 / STAMP).read_text())
    assert stamp["weights_sha256"] == sha256_file(smollm2 / "model.safetensors")
    again = prepare_smollm2()
    assert not again.converted and again.path == smollm2
    cfg = TargetConfig.from_pretrained(smollm2)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert cfg.default_tap_layers() == (2, 15, 27)


def test_target_matches_transformers_on_smollm2(smollm2: Path) -> None:
    t0 = time.perf_counter()
    ours = load_target(smollm2)
    load_s = time.perf_counter() - t0
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)
    ref.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    ids = tok("What is 17 + 25? Let me think step by step.", return_tensors="pt").input_ids
    taps = (0, 2, 15, 27)
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        got = ours(ids, tap_layers=taps)
    diff = (got.logits - want.logits).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| {diff:.2e} (codraft load took {load_s:.2f}s)"
    h = ours.config.hidden_size
    for i, k in enumerate(taps):
        tap = got.taps[..., i * h : (i + 1) * h]
        torch.testing.assert_close(tap, want.hidden_states[k], rtol=0, atol=1e-4)
