"""codraft's TargetModel against transformers on the same tiny random weights (fp32, CPU).

transformers (checked on 5.x, and checked again by the test for every variant): with
`output_hidden_states` it gives L + 1 entries; entries 0..L-1 are the residual stream after k
layers (codraft tap k), but the LAST entry, hidden_states[L], is taken AFTER the final norm
(lm_head(hidden_states[L]) == logits). That is codraft's `last_hidden`. codraft's tap L is the
last layer's output BEFORE the final norm, which transformers does not return: the test takes it
from a forward hook on the reference's last decoder layer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from codraft.models.config import TargetConfig, default_tap_layers
from codraft.models.llama import TargetModel, load_target
from codraft.testing import STAMP_FILE, make_tiny_target

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama_gqa": dict(arch="llama"),  # defaults: 2 query heads per KV head, head_dim 32
    "llama_tied": dict(arch="llama", num_kv_heads=2, tie_word_embeddings=True),  # no GQA
    "qwen2_bias": dict(arch="qwen2"),
    # head_dim (32) != hidden_size / num_heads (16), 5 layers
    "qwen3_qknorm": dict(arch="qwen3", num_layers=5, num_heads=4, num_kv_heads=2, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def _reference(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _last_layer_output(ref: torch.nn.Module) -> tuple[list[torch.Tensor], object]:
    """A hook that keeps what the reference's last decoder layer returns (before the norm)."""
    seen: list[torch.Tensor] = []

    def keep(_module, _args, output) -> None:
        seen.append(output[0] if isinstance(output, tuple) else output)

    return seen, ref.model.layers[-1].register_forward_hook(keep)


@torch.no_grad()
def test_matches_transformers(variant_dir: Path) -> None:
    ours, ref = load_target(variant_dir), _reference(variant_dir)
    L, H = ours.config.num_layers, ours.config.hidden_size
    ids = torch.randint(
        0, ours.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0)
    )
    taps = (0, 1, 2, L)
    out = ours(ids, tap_layers=taps)
    seen, hook = _last_layer_output(ref)
    want = ref(ids, output_hidden_states=True)
    hook.remove()
    (ref_prenorm,) = seen

    # The reference itself: its last hidden_states entry is post-norm, the lm_head's input.
    assert len(want.hidden_states) == L + 1
    assert torch.allclose(ref.model.norm(ref_prenorm), want.hidden_states[L], atol=1e-6)
    assert torch.allclose(ref.lm_head(want.hidden_states[L]), want.logits, atol=1e-5)
    assert (ref_prenorm - want.hidden_states[L]).abs().max() > 1e-2  # the two really differ

    assert out.logits.shape == (2, 11, ours.config.vocab_size)
    assert (out.logits - want.logits).abs().max() < 1e-4
    assert out.taps.shape == (2, 11, len(taps) * H)
    got = out.taps.split(H, dim=-1)
    for k, tap in zip(taps[:-1], got[:-1], strict=True):
        assert torch.allclose(tap, want.hidden_states[k], atol=1e-5), f"tap {k}"
    assert torch.allclose(got[-1], ref_prenorm, atol=1e-5)  # tap L: before the final norm
    # last_hidden: after the final norm, transformers' hidden_states[-1]; logits are its head
    assert out.last_hidden.shape == (2, 11, H)
    assert torch.allclose(out.last_hidden, want.hidden_states[-1], atol=1e-5)
    assert not torch.allclose(out.last_hidden, got[-1], atol=1e-2)
    assert torch.equal(ours.norm(got[-1]), out.last_hidden)
    assert torch.equal(ours.head(out.last_hidden), out.logits)
    assert torch.equal(ours.lm_head(out.last_hidden), out.logits)

    # explicit, shifted positions (what a continuation chunk uses)
    pos = torch.arange(3, 14).expand(2, 11)
    shifted = ours(ids, positions=pos)
    assert (shifted.logits - ref(ids, position_ids=pos).logits).abs().max() < 1e-4


def test_tied_embeddings_share_storage(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = make_tiny_target(tmp_path_factory.mktemp("tied"), **VARIANTS["llama_tied"])
    model = load_target(path)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())


@torch.no_grad()
def test_mistral_sliding_window(tmp_path: Path) -> None:
    cfg = transformers.MistralConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=5,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    transformers.MistralForCausalLM(cfg).save_pretrained(tmp_path)
    ours, ref = load_target(tmp_path), _reference(tmp_path)
    assert ours.config.layer_window(0) == 5
    ids = torch.randint(0, 300, (1, 13))
    assert (ours(ids).logits - ref(ids).logits).abs().max() < 1e-4


@torch.no_grad()
def test_packed_documents_equal_separate_runs(tiny_llama_dir: Path) -> None:
    model = load_target(tiny_llama_dir)
    L = model.config.num_layers
    a = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(1))
    b = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = model(torch.cat([a, b]), cu_seqlens=cu, tap_layers=(1, L))
    assert packed.logits.shape == (12, 512) and packed.last_hidden.shape == (12, 64)
    for doc, sl in ((a, slice(0, 5)), (b, slice(5, 12))):
        alone = model(doc[None], tap_layers=(1, L))
        assert torch.allclose(packed.logits[sl], alone.logits[0], atol=1e-5)
        assert torch.allclose(packed.taps[sl], alone.taps[0], atol=1e-5)
        assert torch.allclose(packed.last_hidden[sl], alone.last_hidden[0], atol=1e-5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.cat([a, b]), cu_seqlens=torch.tensor([0, 5, 11]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(a[None], cu_seqlens=torch.tensor([0, 5]))


def test_bad_tap_indices(tiny_llama_dir: Path) -> None:
    model = load_target(tiny_llama_dir)
    ids = torch.zeros(1, 3, dtype=torch.long)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=rf"tap layer {bad} is out of range.*0 .*\.\. 4"):
            model(ids, tap_layers=(1, bad))
    with pytest.raises(TypeError, match="integers"):
        model(ids, tap_layers=(1.5,))


def test_missing_and_unexpected_tensors_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensors: layers.1.mlp.up_proj.weight") as e:
        load_target(broken)
    assert "model.layers.9.extra.weight" in str(e.value)

    (broken / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_target(broken)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path / "nowhere")


def test_config_reading() -> None:
    base = dict(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=32,
        num_attention_heads=4,
    )
    old = TargetConfig.from_dict({**base, "model_type": "llama", "rope_theta": 5e5})
    new = TargetConfig.from_dict(
        {
            **base,
            "model_type": "llama",
            "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
        }
    )
    assert old.rope_theta == new.rope_theta == 5e5 and new.rope_scaling is None
    assert new.head_dim == 16 and new.num_key_value_heads == 4
    q2 = TargetConfig.from_dict({**base, "model_type": "qwen2"})
    assert q2.attention_bias and not q2.o_proj_bias and q2.sliding_window is None
    q3 = TargetConfig.from_dict({**base, "model_type": "qwen3", "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32
    with pytest.raises(ValueError, match="llama, qwen2, qwen3, mistral"):
        TargetConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        TargetConfig.from_dict({**base, "model_type": "llama", "rope_scaling": {"type": "yarn"}})
    assert new.default_tap_layers() == (2, 16, 29)
    assert default_tap_layers(30) == (2, 15, 27) and default_tap_layers(8) == (2, 4, 5)
    assert default_tap_layers(4) == (1, 2, 3) and default_tap_layers(6) == (1, 3, 5)
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_tap_layers(3)


def test_tiny_target_folder_and_cache(tiny_llama_dir: Path) -> None:
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert len(tok) == 512 and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    stamp = tiny_llama_dir / STAMP_FILE
    before = stamp.stat().st_mtime_ns, (tiny_llama_dir / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_target(tiny_llama_dir, arch="llama") == tiny_llama_dir
    after = stamp.stat().st_mtime_ns, (tiny_llama_dir / "model.safetensors").stat().st_mtime_ns
    assert before == after


def test_random_init_model_runs() -> None:
    cfg = TargetConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
    )
    out = TargetModel(cfg)(torch.randint(0, 50, (1, 6)), return_logits=False)
    assert out.logits is None and out.taps is None and out.last_hidden.shape == (1, 6, 32)
