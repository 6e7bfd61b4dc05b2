"""The EAGLE-3 draft: vocab builder, model step, checkpoint format, atomic writes."""

from __future__ import annotations

import copy
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import codraft.draft.checkpoint as ckpt_mod
from codraft.atomic import (
    atomic_write_bytes,
    atomic_write_dir,
    atomic_write_json,
    remove_stale_temps,
)
from codraft.draft import (
    DraftCheckpointError,
    DraftConfig,
    DraftContract,
    DraftMeta,
    Eagle3Draft,
    build_draft_vocab,
    check_draft,
    check_vocab_maps,
    count_tokens,
    load_draft,
    read_meta,
    save_draft,
    sha256_file,
)
from codraft.draft.checkpoint import MAX_HEADER_BYTES


def tiny_cfg(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        draft_vocab_size=40,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        target_hidden_size=32,
        tap_layers=(1, 3, 5),
        dtype="float32",
    )
    base.update(kw)
    return DraftConfig(**base)


def random_draft(cfg: DraftConfig, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norms too, so a swapped norm weight is visible
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    if not cfg.full_vocab:
        counts = torch.randint(0, 50, (cfg.vocab_size,))
        model.set_vocab(*build_draft_vocab(counts, cfg.draft_vocab_size))
    return model


# ---------------------------------------------------------------------------- vocab
def test_draft_builds_under_another_default_device() -> None:
    """`with torch.device(...)` (how bench_cp_train builds on CUDA): every tensor of the draft,
    its vocab maps included, lands on that device. The meta device stands in for CUDA here."""
    with torch.device("meta"):
        draft = Eagle3Draft(tiny_cfg())
    assert {t.device.type for t in [*draft.parameters(), *draft.buffers()]} == {"meta"}


def test_count_tokens_matches_counter() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, 30, (n,), generator=g) for n in (0, 5, 17)] + [
        torch.randint(0, 30, (3, 4), generator=g, dtype=torch.int32)
    ]
    counts = count_tokens(parts, 30)
    want = Counter(int(x) for p in parts for x in p.flatten())
    assert counts.dtype == torch.int64 and counts.shape == (30,)
    assert counts.tolist() == [want.get(i, 0) for i in range(30)]
    with pytest.raises(ValueError, match="token id 30 .* outside the target vocab 0..29"):
        count_tokens([torch.tensor([1, 30])], 30)
    with pytest.raises(TypeError, match="integer"):
        count_tokens([torch.tensor([1.0])], 30)


def test_build_draft_vocab_ties_and_sorting() -> None:
    counts = torch.tensor([5, 9, 5, 0, 9, 5, 1])
    d2t, t2d = build_draft_vocab(counts, 4)
    # top: ids 1, 4 (count 9), then ties at 5 broken by lower id: 0, 2 -> sorted [0, 1, 2, 4]
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.tolist() == [True, True, True, False, True, False, False]
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1..7 .* got 8"):
        build_draft_vocab(counts, 8)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in 1..7 .* got 0"):
        build_draft_vocab(counts, 0)


@pytest.mark.parametrize("seed", range(5))
def test_build_draft_vocab_brute_force(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    V = 200
    counts = torch.randint(0, 6, (V,), generator=g)  # many ties
    n = int(torch.randint(1, V + 1, (1,), generator=g))
    d2t, t2d = build_draft_vocab(counts, n)
    ranked = sorted(range(V), key=lambda i: (-int(counts[i]), i))
    chosen = sorted(ranked[:n])
    assert [i + int(d2t[i]) for i in range(n)] == chosen
    assert [i for i in range(V) if t2d[i]] == chosen
    check_vocab_maps(d2t, t2d, V, n)


def test_check_vocab_maps_names_the_problem() -> None:
    d2t, t2d = build_draft_vocab(torch.arange(10), 4)  # targets 6, 7, 8, 9
    bad = d2t.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match="draft id 3 to target id 10, outside"):
        check_vocab_maps(bad, t2d, 10)
    bad = d2t.clone()
    bad[1] = -1  # target 0 after 6
    with pytest.raises(ValueError, match="strictly increasing"):
        check_vocab_maps(bad, t2d, 10)
    more = t2d.clone()
    more[0] = True
    with pytest.raises(ValueError, match="t2d marks 5 target ids, expected draft_vocab_size 4"):
        check_vocab_maps(d2t, more, 10)
    moved = t2d.clone()
    moved[9], moved[0] = False, True
    with pytest.raises(ValueError, match="t2d positions differ from d2t targets"):
        check_vocab_maps(d2t, moved, 10)


# ---------------------------------------------------------------------------- config
def test_config_hf_round_trip_and_engines() -> None:
    cfg = tiny_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert hf["num_hidden_layers"] == 1 and hf["tie_word_embeddings"] is False
    assert hf["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
        "use_aux_hidden_state": True,
    }
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # where vLLM's V2 runner reads
    assert DraftConfig.from_hf_dict(json.loads(json.dumps(hf))) == cfg
    sg = cfg.to_hf_dict(engine="sglang")
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert DraftConfig.from_hf_dict(sg, engine="sglang") == cfg
    # transformers-5 spelling of rotary settings
    v5 = dict(hf, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    del v5["rope_theta"], v5["rope_scaling"]
    assert DraftConfig.from_hf_dict(v5) == cfg


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        tiny_cfg(tap_layers=(3, 1, 5))
    with pytest.raises(ValueError, match="must equal target_hidden_size"):
        tiny_cfg(target_hidden_size=64)
    with pytest.raises(ValueError, match="cannot exceed the target vocab_size"):
        tiny_cfg(draft_vocab_size=101)
    hf = tiny_cfg().to_hf_dict()
    del hf["eagle_config"], hf["eagle_aux_hidden_state_layer_ids"]
    with pytest.raises(ValueError, match="never defaulted"):
        DraftConfig.from_hf_dict(hf)
    hf = tiny_cfg().to_hf_dict()
    hf["eagle_aux_hidden_state_layer_ids"] = [1, 2, 5]
    with pytest.raises(ValueError, match="make them equal"):
        DraftConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match="norm_before_residual"):
        DraftConfig.from_hf_dict(dict(tiny_cfg().to_hf_dict(), norm_before_residual=True))


def test_from_target_mirrors_geometry() -> None:
    tc_mod = pytest.importorskip("codraft.models.config")
    target = tc_mod.TargetConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=5e5,
        max_position_embeddings=1024,
    )
    cfg = DraftConfig.from_target(target, dtype="float32")
    assert cfg.tap_layers == target.default_tap_layers()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.draft_vocab_size) == (32, 512, 512)
    assert cfg.rope_theta == 5e5 and cfg.target_hidden_size == 64
    with pytest.raises(ValueError, match="out of range"):
        DraftConfig.from_target(target, tap_layers=(1, 2, 9))


# ---------------------------------------------------------------------------- model
def reference_step(
    params: dict[str, torch.Tensor],
    cfg: DraftConfig,
    embeds: torch.Tensor,
    h: torch.Tensor,
    positions: torch.Tensor,
    norm_before_residual: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One EAGLE-3 draft pass for one sequence, written out longhand: [T, H] -> logits, h.

    norm_before_residual=True is vLLM's other variant (residual = hidden_norm(h)), which
    codraft does not implement: the test uses it to show the comparison can fail."""

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # normalised in at least fp32 and cast back (the transformers/vLLM convention; fp64
        # inputs stay fp64 so that fp64 checks are exact)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        return w * (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(
            x.dtype
        )

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ params[name + ".weight"].T

    T, nh, nkv, hd = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.cat(
        [
            rms(embeds, params["midlayer.input_layernorm.weight"]),
            rms(h, params["midlayer.hidden_norm.weight"]),
        ],
        dim=-1,
    )
    q = lin(x, "midlayer.self_attn.q_proj").view(T, nh, hd)
    k = lin(x, "midlayer.self_attn.k_proj").view(T, nkv, hd)
    v = lin(x, "midlayer.self_attn.v_proj").view(T, nkv, hd)
    half = hd // 2
    # rotary angles in fp64 here (codraft computes them in fp32 for fp32/bf16 models, in fp64 for
    # fp64 ones)
    freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = positions.double()[:, None] * freq[None, :]  # [T, half]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    q, k = rope(q), rope(k)
    out = torch.empty(T, nh, hd, dtype=torch.float64)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for head in range(nh):
        kvh = head // (nh // nkv)
        s = q[:, head] @ k[:, kvh].T / math.sqrt(hd)
        s = s.masked_fill(~mask, -math.inf)
        out[:, head] = torch.softmax(s, dim=-1) @ v[:, kvh]
    skip = rms(h, params["midlayer.hidden_norm.weight"]) if norm_before_residual else h
    residual = lin(out.reshape(T, nh * hd), "midlayer.self_attn.o_proj") + skip
    y = rms(residual, params["midlayer.post_attention_layernorm.weight"])
    gate, up = lin(y, "midlayer.mlp.gate_proj"), lin(y, "midlayer.mlp.up_proj")
    prenorm = lin(gate * torch.sigmoid(gate) * up, "midlayer.mlp.down_proj") + residual
    return lin(rms(prenorm, params["norm.weight"]), "lm_head"), prenorm


def test_forward_matches_longhand_reference_fp64() -> None:
    cfg = tiny_cfg(dtype="float64", rope_theta=500.0)
    model = random_draft(cfg)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64)
    model.set_embedding(embed)
    params = {k: v for k, v in model.state_dict().items()}
    T = 9
    ids = torch.randint(0, cfg.vocab_size, (T,))
    taps = torch.randn(T, cfg.num_taps * cfg.target_hidden_size, dtype=torch.float64)
    positions = torch.arange(T) + 3
    h0 = model.fuse(taps)
    torch.testing.assert_close(h0, taps @ params["fc.weight"].T, rtol=0, atol=1e-12)
    logits, prenorm = model(ids, h0, positions)
    ref_logits, ref_prenorm = reference_step(params, cfg, embed[ids], h0, positions)
    torch.testing.assert_close(prenorm, ref_prenorm, rtol=0, atol=1e-10)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    # second pass feeds the prenorm back, as in TTT / vLLM's multi-token drafting
    logits2, _ = model(ids, prenorm, positions + 1)
    ref2, _ = reference_step(params, cfg, embed[ids], ref_prenorm, positions + 1)
    torch.testing.assert_close(logits2, ref2, rtol=0, atol=1e-10)
    wrong, _ = reference_step(params, cfg, embed[ids], h0, positions, norm_before_residual=True)
    assert (wrong - logits).abs().max() > 1e-2


def test_pieces_compose_to_forward_batched_and_thd() -> None:
    cfg = tiny_cfg()
    model = random_draft(cfg, seed=3)
    model.set_embedding(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size))
    B, T = 3, 6
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    taps = torch.randn(B, T, cfg.num_taps * cfg.target_hidden_size)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        logits, prenorm = model(ids, model.fuse(taps), pos)
        q, k, v, res = model.qkv(model.embed(ids), model.fuse(taps), pos)
        assert q.shape == (B, T, 4, 8) and k.shape == v.shape == (B, T, 2, 8)
        # a hand-written GQA causal attention in place of the built-in one
        kk, vv = k.repeat_interleave(2, dim=-2), v.repeat_interleave(2, dim=-2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(8)
        s = s.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), -math.inf)
        attn = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
        pre = model.finish(attn, res)
        torch.testing.assert_close(pre, prenorm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.logits(pre), logits, rtol=1e-5, atol=1e-5)
        # THD: 1-D tokens of one sequence give row 1 of the batch
        l1, p1 = model(ids[1], model.fuse(taps[1]), torch.arange(T))
        torch.testing.assert_close(l1, logits[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p1, prenorm[1], rtol=1e-5, atol=1e-5)


def test_target_id_mapping() -> None:
    cfg = tiny_cfg()
    model = random_draft(cfg)
    targets = model.draft_to_target_ids()
    assert model.t2d.nonzero().flatten().tolist() == targets.tolist()
    ids = torch.tensor([[0, 5], [39, 7]])
    assert model.map_to_target(ids).tolist() == [[int(targets[i]) for i in r] for r in ids]
    dl = torch.randn(2, cfg.draft_vocab_size)
    tl = model.target_logits(dl)
    assert tl.shape == (2, cfg.vocab_size)
    assert torch.equal(tl[:, targets], dl) and torch.isinf(tl[:, ~model.t2d]).all()
    assert torch.equal(model.map_to_target(dl.argmax(-1)), tl.argmax(-1))


def test_embedding_is_shared_not_a_parameter() -> None:
    cfg = tiny_cfg()
    model = Eagle3Draft(cfg)
    with pytest.raises(RuntimeError, match="set_embedding"):
        model.embed(torch.tensor([1]))
    with pytest.raises(ValueError, match=r"expected \[100, 32\]"):
        model.set_embedding(torch.zeros(100, 16))
    w = torch.nn.Parameter(torch.randn(100, 32))
    model.set_embedding(w)
    assert "embed" not in " ".join(model.state_dict())
    assert not any(p is w for p in model.parameters())
    assert not model.embed(torch.tensor([3])).requires_grad
    twin = copy.deepcopy(model)
    assert twin.__dict__["_embed"].value.data_ptr() == w.data_ptr()  # shared, not copied
    assert twin.fc.weight.data_ptr() != model.fc.weight.data_ptr()


# ---------------------------------------------------------------------------- checkpoint
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bit_exact(tmp_path: Path, dtype: str) -> None:
    cfg = tiny_cfg(dtype=dtype)
    model = random_draft(cfg)
    meta = DraftMeta(
        version=7,
        parent_version=6,
        policy_version=3,
        target_fingerprint="abc",
        counters={"steps": 120, "loss": 1.25},
    )
    out = save_draft(tmp_path / "v7", model, meta)
    assert sorted(p.name for p in out.iterdir()) == [
        "codraft.json",
        "config.json",
        "model.safetensors",
    ]
    stored = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in stored and {"d2t", "t2d"} <= set(stored)
    assert all(t.is_contiguous() for t in stored.values())
    loaded, lmeta = load_draft(out, expect=DraftContract.of(cfg))
    assert loaded.config == cfg
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(bits(a[name]), bits(b[name])), name
    assert lmeta == replace(
        meta,
        tap_layers=cfg.tap_layers,
        weights_sha256=sha256_file(out / "model.safetensors"),
        created_at=lmeta.created_at,
    )
    assert lmeta.created_at and read_meta(out) == lmeta
    assert check_draft(out, DraftContract.of(cfg)) == (cfg, lmeta)
    assert all(p.requires_grad for p in loaded.parameters())


def test_save_casts_to_requested_dtype(tmp_path: Path) -> None:
    model = random_draft(tiny_cfg())
    out = save_draft(tmp_path / "bf16", model, DraftMeta(version=1), dtype=torch.bfloat16)
    loaded, _ = load_draft(out)
    assert loaded.config.dtype == "bfloat16" and loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.fc.weight, model.fc.weight.to(torch.bfloat16))


def test_full_vocab_draft_has_no_d2t(tmp_path: Path) -> None:
    cfg = tiny_cfg(draft_vocab_size=100)
    out = save_draft(tmp_path / "full", random_draft(cfg), DraftMeta(version=1))
    assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors"))
    loaded, _ = load_draft(out)
    assert torch.equal(loaded.draft_to_target_ids(), torch.arange(100))


def test_write_new_draft_takes_the_config_already_read(tiny_llama_dir: Path, tmp_path) -> None:
    """A caller that parsed the target's config.json hands it on; the draft is the same."""
    from codraft.draft.init import write_new_draft
    from codraft.models.config import TargetConfig

    read = write_new_draft(tmp_path / "read", tiny_llama_dir, draft_vocab_size=64, seed=2)
    cfg = TargetConfig.from_pretrained(tiny_llama_dir)
    nowhere = tmp_path / "no-target-here"  # nothing is read from the folder
    given = write_new_draft(
        tmp_path / "given", nowhere, draft_vocab_size=64, seed=2, target_config=cfg
    )
    assert (read / "config.json").read_text() == (given / "config.json").read_text()
    assert sha256_file(read / "model.safetensors") == sha256_file(given / "model.safetensors")


def test_transformers_reads_the_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = save_draft(tmp_path / "c", random_draft(tiny_cfg()), DraftMeta(version=1))
    hf = transformers.AutoConfig.from_pretrained(out)
    assert hf.num_hidden_layers == 1 and hf.draft_vocab_size == 40 and hf.head_dim == 8
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


# ---------------------------------------------------------------------------- corruptions
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_draft(tmp_path / "ck", random_draft(tiny_cfg()), DraftMeta(version=2))


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _rewrite_weights(root: Path, edit) -> None:
    """Change the tensors and re-record the sha256, so only the tensor problem remains."""
    tensors = load_file(root / "model.safetensors")
    edit(tensors)
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    _edit_json(root / "codraft.json", weights_sha256=sha256_file(root / "model.safetensors"))


def _set(name: str, value: torch.Tensor):
    return lambda t: t.__setitem__(name, value)


def _d2t_out_of_vocab(t: dict) -> None:
    t["d2t"][-1] = 100 - 39  # last draft id -> target 100


def _t2d_extra(t: dict) -> None:
    t["t2d"][(~t["t2d"]).nonzero()[0]] = True


def _t2d_moved(t: dict) -> None:
    on, off = t["t2d"].nonzero()[0], (~t["t2d"]).nonzero()[0]
    t["t2d"][on], t["t2d"][off] = False, True


CORRUPTIONS = {
    "wrong shape": (
        lambda r: _rewrite_weights(r, _set("lm_head.weight", torch.zeros(41, 32))),
        r"tensor lm_head.weight has shape \[41, 32\], expected \[40, 32\]",
    ),
    "missing tensor": (
        lambda r: _rewrite_weights(r, lambda t: t.pop("norm.weight")),
        r"missing tensor\(s\) \['norm.weight'\]",
    ),
    "unexpected tensor": (
        lambda r: _rewrite_weights(r, _set("embed_tokens.weight", torch.zeros(100, 32))),
        r"unexpected tensor\(s\) \['embed_tokens.weight'\]",
    ),
    "wrong dtype": (
        lambda r: _rewrite_weights(r, _set("norm.weight", torch.ones(32, dtype=torch.float16))),
        r"weights must share one float dtype, found \['F16', 'F32'\]",
    ),
    "d2t outside vocab": (
        lambda r: _rewrite_weights(r, _d2t_out_of_vocab),
        r"d2t/t2d inconsistent: d2t maps draft id 39 to target id 100, outside",
    ),
    "t2d count": (
        lambda r: _rewrite_weights(r, _t2d_extra),
        r"d2t/t2d inconsistent: t2d marks 41 target ids, expected draft_vocab_size 40",
    ),
    "t2d positions": (
        lambda r: _rewrite_weights(r, _t2d_moved),
        r"d2t/t2d inconsistent: t2d positions differ from d2t targets",
    ),
    "checksum": (
        lambda r: _flip_last_byte(r / "model.safetensors"),
        r"sha256 mismatch: codraft.json records [0-9a-f]{64}, model.safetensors hashes to "
        r"[0-9a-f]{64}",
    ),
    "truncated": (
        lambda r: _truncate(r / "model.safetensors", 100),
        r"truncated: the header describes \d+ bytes, the file has \d+",
    ),
    "garbage weights": (
        lambda r: (r / "model.safetensors").write_bytes(b"not a safetensors file"),
        r"truncated or not a safetensors file",
    ),
    "missing weights": (
        lambda r: (r / "model.safetensors").unlink(),
        r"missing file model.safetensors",
    ),
    "missing config": (lambda r: (r / "config.json").unlink(), r"missing file config.json"),
    "missing meta": (lambda r: (r / "codraft.json").unlink(), r"missing file codraft.json"),
    "config tap layers": (
        lambda r: _edit_json(
            r / "config.json",
            eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 3, 5]},
            eagle_aux_hidden_state_layer_ids=[2, 3, 5],
        ),
        r"tap layers disagree: config.json has \[2, 3, 5\], codraft.json has \[1, 3, 5\]",
    ),
    "config vocab": (
        lambda r: _edit_json(r / "config.json", vocab_size=120),
        r"tensor t2d has shape \[100\], expected \[120\]",
    ),
    "config dtype": (
        lambda r: _edit_json(r / "config.json", torch_dtype="bfloat16"),
        r"tensors are torch.float32 but config.json says torch_dtype bfloat16",
    ),
    "bad config json": (
        lambda r: (r / "config.json").write_text("{"),
        r"config.json: unreadable JSON",
    ),
    "version not int": (
        lambda r: _edit_json(r / "codraft.json", version="3"),
        r"codraft.json: version must be a non-negative int, found '3'",
    ),
    "version bool": (
        lambda r: _edit_json(r / "codraft.json", version=True),
        r"version must be a non-negative int, found True",
    ),
    "meta sha not hex": (
        lambda r: _edit_json(r / "codraft.json", weights_sha256="xyz"),
        r"weights_sha256 must be 64 lowercase hex digits, found 'xyz'",
    ),
}


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path, n: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-n])


def _oversized_header(path: Path) -> None:
    """A valid safetensors file whose header is padded past the draft limit."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    pad = MAX_HEADER_BYTES + 1 - n
    header = data[8 : 8 + n] + b" " * pad
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])


def _link_out(root: Path) -> None:
    """model.safetensors replaced by a link to a copy outside the folder (the sha matches)."""
    outside = root.parent / "elsewhere.safetensors"
    outside.write_bytes((root / "model.safetensors").read_bytes())
    (root / "model.safetensors").unlink()
    (root / "model.safetensors").symlink_to(outside)


def _poison(value: float):
    def edit(t: dict) -> None:
        t["midlayer.mlp.up_proj.weight"][3, 5] = value

    return edit


CORRUPTIONS.update(
    {
        "oversized header": (
            lambda r: _oversized_header(r / "model.safetensors"),
            r"safetensors header of 1048577 bytes; a draft checkpoint's header is at most "
            r"1048576 bytes",
        ),
        "link out of the folder": (
            _link_out,
            r"model.safetensors: is a link to .*elsewhere.safetensors, outside the checkpoint",
        ),
    }
)
# Values are read by load_draft and the server's reader, not by check_draft (header only).
BAD_VALUES = {
    "nan weight": (
        lambda r: _rewrite_weights(r, _poison(float("nan"))),
        r"tensor midlayer.mlp.up_proj.weight holds 1 NaN and 0 infinite values",
    ),
    "inf weight": (
        lambda r: _rewrite_weights(r, _poison(float("-inf"))),
        r"tensor midlayer.mlp.up_proj.weight holds 0 NaN and 1 infinite values",
    ),
}


def _read(root: Path) -> None:
    """The server's reader (codraft.server.draft_read): every check, then the checksum."""
    from codraft.server.draft_read import read_checked

    checked = read_checked(root)
    try:
        checked.verify_sha()
    finally:
        checked.release()


READERS = {"check": check_draft, "load": load_draft, "read": _read}


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("case", sorted(CORRUPTIONS) + sorted(BAD_VALUES))
def test_corrupt_checkpoint_refused(saved: Path, case: str, reader: str) -> None:
    if case in BAD_VALUES and reader == "check":
        pytest.skip("check_draft reads the header only, not the weights' values")
    corrupt, message = CORRUPTIONS.get(case) or BAD_VALUES[case]
    corrupt(saved)
    with pytest.raises(DraftCheckpointError, match=message):
        READERS[reader](saved)


def test_contract_mismatches_named(saved: Path) -> None:
    cfg = tiny_cfg()
    contract = DraftContract.of(cfg)
    check_draft(saved, contract)
    cases = {
        "tap layers: expected [2, 3, 5], found [1, 3, 5]": replace(contract, tap_layers=(2, 3, 5)),
        "target vocab size: expected 128, found 100": replace(contract, target_vocab_size=128),
        "target hidden size: expected 64, found 32": replace(contract, target_hidden_size=64),
        "draft vocab size: expected 50, found 40": replace(contract, draft_vocab_size=50),
        "head dim: expected 16, found 8": replace(contract, head_dim=16),
    }
    for message, bad in cases.items():
        for fn in (check_draft, lambda p, c: load_draft(p, expect=c)):
            with pytest.raises(DraftCheckpointError, match=re_escape(message)):
                fn(saved, bad)
    loose = DraftContract(target_hidden_size=32, target_vocab_size=100, tap_layers=(1, 3, 5))
    assert load_draft(saved, expect=loose)[1].version == 2


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(DraftCheckpointError, match="checkpoint directory not found"):
        check_draft(tmp_path / "nope")


def test_full_vocab_with_d2t_refused(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    out = save_draft(tmp_path / "ck", random_draft(cfg), DraftMeta(version=1))
    _edit_json(out / "config.json", draft_vocab_size=100)
    _rewrite_weights(out, _set("lm_head.weight", torch.zeros(100, 32)))
    with pytest.raises(DraftCheckpointError, match="d2t present although draft_vocab_size"):
        check_draft(out)


def test_save_refuses_mismatched_meta_and_existing_dir(tmp_path: Path) -> None:
    model = random_draft(tiny_cfg())
    with pytest.raises(DraftCheckpointError, match=r"meta.tap_layers \[1, 2, 3\] != model"):
        save_draft(tmp_path / "a", model, DraftMeta(version=1, tap_layers=(1, 2, 3)))
    with pytest.raises(DraftCheckpointError, match="version must be a non-negative int"):
        save_draft(tmp_path / "a", model, DraftMeta(version=-1))
    assert not (tmp_path / "a").exists()
    out = save_draft(tmp_path / "a", model, DraftMeta(version=1))
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_draft(out, model, DraftMeta(version=2))
    save_draft(out, model, DraftMeta(version=2), overwrite=True)
    assert read_meta(out).version == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp or trash left


# ---------------------------------------------------------------------------- atomic writes
def test_crash_during_save_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def dying_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)  # half a file, then the writer dies
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "save_file", dying_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_draft(tmp_path / "v1", random_draft(tiny_cfg()), DraftMeta(version=1))
    assert list(tmp_path.iterdir()) == []


def test_crash_during_overwrite_keeps_old_checkpoint(saved: Path, monkeypatch) -> None:
    before = {p.name: p.read_bytes() for p in saved.iterdir()}

    def dying_save_file(tensors, filename, metadata=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "save_file", dying_save_file)
    with pytest.raises(KeyboardInterrupt):
        save_draft(saved, random_draft(tiny_cfg(), seed=9), DraftMeta(version=3), overwrite=True)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]
    check_draft(saved)


def test_killed_writer_never_publishes(tmp_path: Path) -> None:
    """A process killed mid-write (no cleanup runs) leaves only a hidden temp dir."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from codraft.atomic import atomic_write_dir
        with atomic_write_dir(Path({str(tmp_path)!r}) / "ck") as tmp:
            (tmp / "config.json").write_text("{{}}")
            (tmp / "model.safetensors").write_bytes(b"partial")
            os._exit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == 3
    names = [p.name for p in tmp_path.iterdir()]
    assert "ck" not in names and len(names) == 1 and names[0].startswith(".ck.tmp-")
    assert [p.name for p in remove_stale_temps(tmp_path)] == names
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_dir_and_files(tmp_path: Path, monkeypatch) -> None:
    with atomic_write_dir(tmp_path / "d") as tmp:
        (tmp / "a").write_text("1")
        assert not (tmp_path / "d").exists()
    assert (tmp_path / "d" / "a").read_text() == "1"
    with pytest.raises(ValueError), atomic_write_dir(tmp_path / "e") as tmp:
        (tmp / "a").write_text("1")
        raise ValueError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]

    target = tmp_path / "x.json"
    atomic_write_json(target, {"v": 1})
    assert json.loads(target.read_text()) == {"v": 1}

    def failing_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_bytes(target, b"new")
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "x.json"]
