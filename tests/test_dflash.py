"""The DFlash block drafter: its config.json as vLLM reads it, its forward against a block
computed the way vLLM serves it, the learner's attention inside it, and stock vLLM loading a
codraft DFlash checkpoint with greedy output unchanged."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from codraft.draft.checkpoint import (
    DraftCheckpointError,
    DraftContract,
    DraftMeta,
    check_draft,
    load_draft,
    save_draft,
    sha256_file,
)
from codraft.draft.config import DraftConfig
from codraft.draft.dflash import DFlashDraft, rows_and_slots
from codraft.draft.dflash_config import DFlashConfig, dflash_tap_layers
from codraft.learner.attention.block_draft import block_draft_attention
from codraft.models.config import TargetConfig
from codraft.models.layers import apply_rope
from codraft.testing import CONSTANT_TOKEN, make_constant_target


def _tiny(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, target_hidden_size=32,
        tap_layers=(1, 3), block_size=4, mask_token_id=7, dtype="float64", rope_theta=1000.0,
    )  # fmt: skip
    base.update(kw)
    return DFlashConfig(**base)


def _draft(cfg: DFlashConfig, seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():  # norms away from 1, so a missing norm shows
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (p.dim() == 1))
    draft.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64))
    return draft


def test_config_round_trips_and_speaks_vllms_layer_ids():
    cfg = _tiny()
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["model_type"] == "qwen3"
    assert hf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [0, 2]}
    assert DFlashConfig.from_hf_dict(json.loads(json.dumps(hf))) == cfg
    # SGLang checks the ids against the target's layer count (without it, the draft's own 2)
    assert hf["num_target_layers"] == 30
    old = {k: v for k, v in hf.items() if k != "num_target_layers"}  # a draft saved before it
    assert DFlashConfig.from_hf_dict(old).num_target_layers is None
    assert dflash_tap_layers(30) == (2, 9, 15, 21, 28)  # ids 1, 8, 14, 20, 27 as DFlash picks
    assert dflash_tap_layers(36) == (2, 10, 18, 26, 34)  # Qwen3-8B's [1, 9, 17, 25, 33]


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(tap_layers=(0, 2)), "tap 0"),
        (dict(tap_layers=(3, 1)), "strictly increasing"),
        (dict(mask_token_id=50), "outside the target vocabulary"),
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(hidden_size=16), "must equal target_hidden_size"),
        (dict(num_target_layers=2), "reach past the target's 2 layers"),
    ],
)
def test_config_refuses_what_vllm_would_misread(bad, match):
    with pytest.raises(ValueError, match=match):
        _tiny(**bad)


def _served_block(
    draft: DFlashDraft, ids: torch.Tensor, taps: torch.Tensor, a: int
) -> torch.Tensor:
    """Logits [S, vocab] of the block anchored at position a of one document, computed as vLLM
    serves it: context K/V from the taps of positions 0..a-1 only, queries [ids[a], mask...] at
    positions a..a+S-1, one non-causal softmax over context and block. Shares no masking code
    with the product."""
    cfg = draft.config
    s_, hq, hkv, d = cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    block = torch.full((s_,), cfg.mask_token_id)
    block[0] = ids[a]
    h = draft.embed(block)
    ctx = draft.hidden_norm(draft.fc(taps[:a]))
    pos_b, pos_c = torch.arange(a, a + s_), torch.arange(a)
    for layer in draft.layers:
        at = layer.self_attn
        x = layer.input_layernorm(h)
        q = at.q_norm(at.q_proj(x).view(s_, hq, d))
        k = torch.cat(
            [at.k_norm(at.k_proj(ctx).view(a, hkv, d)), at.k_norm(at.k_proj(x).view(s_, hkv, d))]
        )
        v = torch.cat([at.v_proj(ctx).view(a, hkv, d), at.v_proj(x).view(s_, hkv, d)])
        cos, sin = draft.rotary(pos_b, q.dtype)
        q = apply_rope(q, cos, sin)
        cos, sin = draft.rotary(torch.cat([pos_c, pos_b]), k.dtype)
        k = apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        h = h + at.o_proj(out.reshape(s_, hq * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return F.linear(draft.norm(h), draft.__dict__["_head"].value)


def _plant_block_one_position_late(mp: pytest.MonkeyPatch) -> None:
    import codraft.draft.dflash as dflash

    rows = dflash.rows_and_slots
    mp.setattr(
        dflash, "rows_and_slots", lambda cu, s: (lambda c, b, src: (c, b + 1, src))(*rows(cu, s))
    )


def _plant_context_sees_the_anchor(mp: pytest.MonkeyPatch) -> None:
    import codraft.draft.dflash as dflash

    dense = dflash.dense_block_attention_fn

    def leaky(cu):  # row i's block also sees the context at position i + 1 (its anchor)
        ref = dense(cu)

        def attn(q, kc, vc, kb, vb):
            shifted = torch.cat([kc[1:], kc[-1:]]), torch.cat([vc[1:], vc[-1:]])
            return 0.5 * (ref(q, kc, vc, kb, vb) + ref(q, *shifted, kb, vb))

        return attn

    mp.setattr(dflash, "dense_block_attention_fn", leaky)


@pytest.mark.parametrize(
    "bug", [None, _plant_block_one_position_late, _plant_context_sees_the_anchor]
)
def test_every_row_is_the_block_vllm_would_serve_at_its_anchor(bug, monkeypatch):
    if bug is not None:
        bug(monkeypatch)
        with pytest.raises(AssertionError):
            _rows_match_served_blocks()
    else:
        _rows_match_served_blocks()


def _rows_match_served_blocks() -> None:
    cfg = _tiny()
    draft = _draft(cfg)
    lengths = [9, 3, 12]
    cu = torch.tensor([0, 9, 12, 24], dtype=torch.int32)
    ids = torch.randint(0, cfg.vocab_size, (24,))
    taps = torch.randn(24, cfg.num_taps * cfg.target_hidden_size, dtype=torch.float64)
    with torch.no_grad():
        logits, source = draft(ids, taps, cu)
        checked = 0
        for doc, start in enumerate(cu[:-1].tolist()):
            for a in range(1, lengths[doc]):  # anchor a of the document is row a - 1
                want = _served_block(
                    draft, ids[start : start + lengths[doc]], taps[start : start + lengths[doc]], a
                )  # noqa: E501
                got = logits[:, start + a - 1]
                assert torch.allclose(got, want, atol=1e-10), (doc, a, (got - want).abs().max())
                checked += 1
    assert checked == 8 + 2 + 11
    _, _, src = rows_and_slots(cu, cfg.block_size)
    assert torch.equal(source, src)
    # row i's slot s stands for packed token i + 1 + s, -1 past its document (doc 0 is 0..8)
    assert source[0, 0].item() == 1 and source[3, 0].item() == 4 and source[0, 7].item() == 8
    assert source[1, 7].item() == -1 and source[0, 8].item() == -1 and source[0, 9].item() == 10


def test_the_learners_attention_gives_the_same_logits_and_gradients():
    cfg = _tiny()
    cu = torch.tensor([0, 5, 16, 20], dtype=torch.int32)
    ids = torch.randint(0, cfg.vocab_size, (20,))
    taps = torch.randn(20, cfg.num_taps * cfg.target_hidden_size, dtype=torch.float64)
    grads = []
    outs = []
    for attn in (None, lambda q, kc, vc, kb, vb: block_draft_attention(q, kc, vc, kb, vb, cu)):
        draft = _draft(cfg)
        logits, _ = draft(ids, taps, cu, attn=attn)
        logits.square().mean().backward()
        outs.append(logits.detach())
        grads.append(torch.cat([p.grad.flatten() for p in draft.parameters()]))
    assert torch.allclose(outs[0], outs[1], atol=1e-10)
    assert torch.allclose(grads[0], grads[1], atol=1e-10)


def test_target_head_shapes_are_checked():
    draft = DFlashDraft(_tiny())
    with pytest.raises(ValueError, match="expected \\[50, 32\\]"):
        draft.set_target_head(torch.zeros(49, 32))
    with pytest.raises(RuntimeError, match="set_target_head"):
        draft.embed(torch.zeros(2, dtype=torch.long))


# --------------------------------------------------------------------------------------------
# stock vLLM
# --------------------------------------------------------------------------------------------


def test_checkpoints_round_trip_and_are_checked_like_eagle3_drafts(tmp_path: Path):
    cfg = _tiny(dtype="float32")
    draft = _draft(cfg).float()
    path = save_draft(tmp_path / "d", draft, DraftMeta(version=3))
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    got_cfg, meta = check_draft(path, DraftContract.of(cfg))
    assert got_cfg == cfg and meta.version == 3 and meta.tap_layers == cfg.tap_layers
    loaded, _ = load_draft(path)
    assert isinstance(loaded, DFlashDraft)
    want = draft.state_dict()
    assert loaded.state_dict().keys() == want.keys()
    for name, a in loaded.state_dict().items():
        assert torch.equal(a, want[name]), name
    eagle = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=50,
                        target_hidden_size=32, tap_layers=(1, 3))  # fmt: skip
    with pytest.raises(DraftCheckpointError, match="drafter kind: expected eagle3, found dflash"):
        check_draft(path, DraftContract.of(eagle))

    def damaged(name: str, edit) -> Path:
        bad = tmp_path / name
        shutil.copytree(path, bad)
        edit(bad)
        return bad

    def extra_lm_head(p: Path) -> None:
        t = dict(draft.state_dict()) | {"lm_head.weight": torch.zeros(50, 32)}
        save_file({k: v.contiguous() for k, v in t.items()}, p / "model.safetensors")
        meta = json.loads((p / "codraft.json").read_text())
        meta["weights_sha256"] = sha256_file(p / "model.safetensors")
        (p / "codraft.json").write_text(json.dumps(meta))

    def nan(p: Path) -> None:
        t = {k: v.clone().contiguous() for k, v in draft.state_dict().items()}
        t["layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
        save_file(t, p / "model.safetensors")
        meta = json.loads((p / "codraft.json").read_text())
        meta["weights_sha256"] = sha256_file(p / "model.safetensors")
        (p / "codraft.json").write_text(json.dumps(meta))

    def config(p: Path, **kw) -> None:
        hf = json.loads((p / "config.json").read_text())
        hf["dflash_config"].update(kw)
        (p / "config.json").write_text(json.dumps(hf))

    cases = {
        "truncated": (lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:-100]), "truncated"),
        "lm_head stored": (extra_lm_head, "unexpected tensor"),
        "NaN": (nan, "NaN"),
        "causal": (lambda p: config(p, causal=True), "causal"),
        "no mask token": (lambda p: (lambda hf: (hf["dflash_config"].pop("mask_token_id"),
            (p / "config.json").write_text(json.dumps(hf))))(
            json.loads((p / "config.json").read_text())), "mask_token_id"),
        "taps disagree": (lambda p: config(p, target_layer_ids=[0, 1]), "tap layers disagree"),
    }  # fmt: skip
    for name, (edit, match) in cases.items():
        bad = damaged(name.replace(" ", "-"), edit)
        with pytest.raises(DraftCheckpointError, match=match):
            load_draft(bad)


def _agreeing_dflash(target: Path, out: Path, *, misplace: bool = False) -> Path:
    """A DFlash draft that proposes CONSTANT_TOKEN at every slot for make_constant_target's
    target: its o_proj and down_proj are zero, so each slot's output is its own embedding (+4 in
    dimension 0, the target's), which the target's lm_head reads as CONSTANT_TOKEN. `misplace`
    flips the final norm's dimension 0, so the same draft never proposes it. Only a vLLM that
    shares the target's lm_head and samples the mask slots' outputs accepts the first."""
    tcfg = TargetConfig.from_pretrained(target)
    cfg = DFlashConfig.from_target(
        tcfg, mask_token_id=5, num_hidden_layers=2, block_size=4, tap_layers=(1, 2, 4),
        dtype="float32",
    )  # fmt: skip
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        if misplace:
            draft.norm.weight[0] = -1.0
    return save_draft(out, draft, DraftMeta())


@pytest.mark.vllm
def test_stock_vllm_serves_a_codraft_dflash_draft_losslessly(tiny_llama_dir: Path, tmp_path: Path):
    from codraft.server.offline import ArmSpec, run_arm_subprocess

    target = TargetConfig.from_pretrained(tiny_llama_dir)
    cfg = DFlashConfig.from_target(
        target, mask_token_id=3, tap_layers=(1, 2, 4), block_size=4, dtype="float32"
    )
    folder = save_draft(tmp_path / "dflash", DFlashDraft(cfg), DraftMeta())
    prompts = ["The quick brown fox", "def add(a, b):", "Once upon a time", "12 + 30 ="]

    def arm(target: Path, d: Path | None):
        spec = ArmSpec(
            target=str(target), draft=str(d) if d else None, prompts=prompts,
            num_speculative_tokens=3, max_tokens=24, ignore_eos=True, max_model_len=256,
            method="dflash",
        )  # fmt: skip
        return run_arm_subprocess(spec, tmp_path / "arms", timeout=600)

    base, spec = arm(tiny_llama_dir, None), arm(tiny_llama_dir, folder)
    assert spec.num_drafts > 0, "vLLM ran no speculative steps: the DFlash draft was not used"
    assert spec.token_ids == base.token_ids

    constant = make_constant_target(tiny_llama_dir, tmp_path / "constant-target")
    base = arm(constant, None)
    assert all(t == [CONSTANT_TOKEN] * 24 for t in base.token_ids), "the target is not constant"
    good = arm(constant, _agreeing_dflash(constant, tmp_path / "good"))
    assert good.token_ids == base.token_ids
    rate = good.num_accepted_tokens / good.num_draft_tokens
    assert rate > 0.9, f"the agreeing DFlash draft had {rate:.0%} of its proposals accepted"
    bad = arm(constant, _agreeing_dflash(constant, tmp_path / "bad", misplace=True))
    assert bad.token_ids == base.token_ids
    assert bad.num_accepted_tokens / bad.num_draft_tokens < 0.1


# --------------------------------------------------------------------------------------------
# the training objective
# --------------------------------------------------------------------------------------------


def _dense_loss(logits, ids, loss_mask, lengths, teacher, gamma, rows):
    """The objective stated by positions: the block anchored at a (row a - 1) has slot s >= 1
    predict the token at a + s, counted inside the document, on loss tokens."""
    total, weights = 0.0, 0.0
    start = 0
    for n in lengths:
        for a in range(1, n):
            row = start + a - 1
            if rows is not None and not rows[row]:
                continue
            for s in range(1, logits.shape[0]):
                p = a + s
                if p >= n or not loss_mask[start + p]:
                    continue
                logp = logits[s, row].log_softmax(-1)
                if teacher is None:
                    ce = -logp[ids[start + p]]
                else:  # the target's logits at p - 1 predict the token at p
                    ce = -(teacher[start + p - 1].softmax(-1) * logp).sum()
                w = 1.0 if gamma is None else math.exp(-(s - 1) / gamma)
                total = total + w * ce
                weights += w
        start += n
    return total / weights


@pytest.mark.parametrize("teacher", [False, True], ids=["labels", "teacher"])
@pytest.mark.parametrize("gamma", [None, 2.0])
def test_block_loss_matches_the_dense_objective(teacher, gamma, monkeypatch):
    from codraft.learner.block_draft_loss import block_draft_loss

    cfg = _tiny()
    lengths = [7, 2, 11]
    cu = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=gen)
    loss_mask = torch.rand(20, generator=gen) > 0.3
    rows = torch.rand(20, generator=gen) > 0.4
    taps = torch.randn(20, cfg.num_taps * cfg.target_hidden_size, dtype=torch.float64)
    t_logits = torch.randn(20, cfg.vocab_size, dtype=torch.float64) * 2 if teacher else None

    def both():
        out = []
        for product in (True, False):
            draft = _draft(cfg)
            if product:
                h, predicted = draft.proposals(*draft.hidden(ids, taps, cu), cu)
                got = block_draft_loss(
                    h, draft.norm, draft.head_weight(), predicted, ids, loss_mask,
                    teacher_logits=t_logits, gamma=gamma, rows=rows, chunk=3,
                )  # fmt: skip
                loss = got.loss
            else:
                logits, _ = draft(ids, taps, cu)
                loss = _dense_loss(logits, ids, loss_mask, lengths, t_logits, gamma, rows)
            loss.backward()
            out.append((loss.detach(), torch.cat([p.grad.flatten() for p in draft.parameters()])))
        return out

    (lp, gp), (lr, gr) = both()
    assert torch.allclose(lp, lr, atol=1e-12), (lp, lr)
    assert torch.allclose(gp, gr, atol=1e-10), (gp - gr).abs().max()

    import codraft.learner.block_draft_loss as bdl

    # planted: the targets read one position late (the teacher at the label's own position,
    # or the label of the next position, as an autoregressive draft would be trained)
    ce = bdl.cross_entropy
    monkeypatch.setattr(
        bdl, "cross_entropy",
        lambda h, w, t, *, index, **kw: ce(h, w, t, index=(index + 1).clamp(max=19), **kw),
    )  # fmt: skip
    (lp, _), (lr, _) = both()
    assert not torch.allclose(lp, lr, atol=1e-6)


def test_a_batch_without_loss_tokens_gives_a_zero_loss_with_gradients():
    from codraft.learner.block_draft_loss import block_draft_loss

    cfg = _tiny()
    draft = _draft(cfg)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    ids = torch.randint(0, cfg.vocab_size, (6,))
    taps = torch.randn(6, cfg.num_taps * cfg.target_hidden_size, dtype=torch.float64)
    h, predicted = draft.proposals(*draft.hidden(ids, taps, cu), cu)
    out = block_draft_loss(
        h, draft.norm, draft.head_weight(), predicted, ids, torch.zeros(6, dtype=torch.bool)
    )
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and out.tokens == [0, 0, 0]
    assert all(p.grad is not None and not p.grad.any() for p in draft.parameters())


# --------------------------------------------------------------------------------------------
# the acceptance estimate the online learner gates publishes on
# --------------------------------------------------------------------------------------------
def greedy_walk(cfg, k: int, propose) -> tuple[list, tuple[int, int, list[int]]]:
    """Two documents built step by step the way greedy verification goes: at each anchor a
    `propose(ids, taps, anchor)` gives the draft's k proposals (made as vLLM makes them), the
    next r tokens are set to the first r of them and the one after to something else, r drawn
    at random. -> (Samples, the (steps, emitted, accepted per position) that walk must give)."""
    from codraft.learner.data.packing import Sample

    g = torch.Generator().manual_seed(11)
    samples, want_steps, want_emitted, want_pos = [], 0, 0, [0] * k
    for length, prompt in ((40, 5), (33, 9)):
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=g)
        taps = torch.randn(length, cfg.num_taps * cfg.hidden_size, generator=g, dtype=torch.float64)
        i = prompt - 1
        while i + 2 <= length - 1:
            with torch.no_grad():
                props = torch.as_tensor(propose(ids, taps, i + 1), dtype=ids.dtype)
            remaining = length - 1 - (i + 1)
            r = min(int(torch.randint(0, k + 1, (), generator=g)), remaining)
            ids[i + 2 : i + 2 + r] = props[:r]
            if r < min(k, remaining):  # the proposal after the accepted ones must lose
                ids[i + 2 + r] = (props[r] + 1) % cfg.vocab_size
            for d in range(r):
                want_pos[d] += 1
            want_steps += 1
            want_emitted += min(r + 1, remaining)
            i += min(r + 1, remaining)
        mask = torch.zeros(length, dtype=torch.uint8)
        mask[prompt:] = 1
        samples.append(Sample(ids, mask, taps=taps, last_hidden=torch.zeros(length, 32)))
    return samples, (want_steps, want_emitted, want_pos)


@pytest.mark.parametrize("bug", [None, "slot_shift"])
def test_acceptance_estimate_walks_the_blocks_vllm_would_draft(bug, monkeypatch):
    """Sequences are built step by step the way greedy verification goes: at each anchor the
    block is computed as vLLM serves it (`_served_block`), the next r tokens are set to its
    first r proposals and the one after to something else, r drawn at random. The estimate must
    find exactly those accepted lengths. Planted: slots read one position off."""
    from codraft.learner import acceptance

    cfg, k = _tiny(), 3
    draft = _draft(cfg, seed=5)
    if bug == "slot_shift":
        real = acceptance._block_hits

        def shifted(d, packed, kk, chunk=1024):
            return torch.roll(real(d, packed, kk, chunk), 1, dims=0)

        monkeypatch.setattr(acceptance, "_block_hits", shifted)
    samples, (want_steps, want_emitted, want_pos) = greedy_walk(
        cfg, k, lambda ids, taps, a: _served_block(draft, ids, taps, a).argmax(-1)[1 : k + 1]
    )
    report = acceptance.estimate_acceptance(draft, None, samples, k=k)
    got = (report.steps, report.emitted, report.accepted_per_pos)
    if bug is None:
        assert got == (want_steps, want_emitted, want_pos)
        assert report.acceptance_length > 1.5  # both hits and misses were exercised
    else:
        assert got != (want_steps, want_emitted, want_pos)
