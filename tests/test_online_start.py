"""Where an online learner with an empty checkpoint folder starts: from the serving draft's
weights when that draft was trained, else from a new draft (its vocabulary from the buffer).

A learner that lost its volume, or joins a server that already serves a good draft, must not
train up to that draft again from random weights (its candidates could not beat the serving
draft for a long time, so nothing would be published). The learner here is the real
OnlineLearner, one process; no server is reached (`_first_draft` is given the draft folder the
server would report)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codraft.draft.checkpoint import DraftMeta, save_draft
from codraft.draft.config import DraftConfig
from codraft.draft.init import write_new_draft
from codraft.draft.model import Eagle3Draft
from codraft.learner.online.daemon import OnlineConfig, OnlineLearner
from codraft.models.config import TargetConfig
from codraft.server.serve import free_port
from codraft.testing import make_tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("start-target"), arch="llama")


def _learner(target: Path, tmp_path: Path, **kw) -> OnlineLearner:
    cfg = OnlineConfig(
        server=f"http://127.0.0.1:{free_port()}",  # nothing listens: no server is reached
        tap=f"tcp://127.0.0.1:{free_port()}",
        target=str(target),
        out=str(tmp_path / "out"),
        http_port=0,
        **kw,
    )
    return OnlineLearner(cfg)


def _served(
    target: Path, out: Path, counters: dict | None
) -> tuple[Path, DraftConfig, Eagle3Draft]:
    """A draft folder as a server serves it: bf16, trained weights (random, seeded)."""
    tcfg = TargetConfig.from_pretrained(target)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=64, dtype="bfloat16")
    torch.manual_seed(7)
    model = Eagle3Draft(cfg)
    meta = DraftMeta(version=5, counters=counters) if counters is not None else DraftMeta(version=5)
    save_draft(out, model, meta)
    return out, cfg, model


def _same(a: Eagle3Draft, b: Eagle3Draft) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].float(), sb[k].float()) for k in sa)


@pytest.mark.parametrize(
    "counters", [{"step": 40, "tokens": 9000}, None], ids=["codraft", "external"]
)
def test_a_trained_serving_draft_is_where_it_starts(target, tmp_path, counters) -> None:
    path, cfg, model = _served(target, tmp_path / "served", counters)
    draft = _learner(target, tmp_path)._first_draft(cfg, path)
    assert _same(draft, model)
    assert all(p.dtype == torch.float32 for p in draft.parameters())  # it trains in fp32


def test_an_untrained_serving_draft_or_fresh_draft_gives_a_new_one(target, tmp_path) -> None:
    path, cfg, model = _served(target, tmp_path / "served", {"step": 40})
    assert not _same(_learner(target, tmp_path, warm_start=False)._first_draft(cfg, path), model)
    new = tmp_path / "new"
    write_new_draft(new, target, version=0, draft_vocab_size=64)
    from codraft.draft.checkpoint import load_draft

    served0, meta0 = load_draft(new)
    assert meta0.counters == {"step": 0}  # what `codraft serve` builds without --draft
    with torch.no_grad():  # weights of its own, so that a start from them would show
        for p in served0.parameters():
            p.add_(1.0)
    save_draft(tmp_path / "untrained", served0, meta0)
    draft = _learner(target, tmp_path / "b")._first_draft(served0.config, tmp_path / "untrained")
    assert not _same(draft, served0)


def test_a_dflash_server_gets_a_dflash_draft(target, tmp_path) -> None:
    """The learner trains the kind the server serves: from a trained DFlash draft's weights,
    or a new DFlash draft of the serving one's shape (block size, taps, mask token)."""
    from codraft.draft.dflash import DFlashDraft
    from codraft.draft.init import new_dflash_draft

    tcfg = TargetConfig.from_pretrained(target)
    served = new_dflash_draft(tcfg, mask_token_id=3, block_size=6, tap_layers=(1, 3), seed=4)
    served = served.to(torch.bfloat16)
    save_draft(tmp_path / "served", served, DraftMeta(version=5, counters={"step": 40}))
    learner = _learner(target, tmp_path)
    draft = learner._first_draft(served.config, tmp_path / "served")
    assert isinstance(draft, DFlashDraft) and _same(draft, served)
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    fresh = _learner(target, tmp_path / "b", warm_start=False)._first_draft(
        served.config, tmp_path / "served"
    )
    assert isinstance(fresh, DFlashDraft) and not _same(fresh, served)
    c = fresh.config
    assert (c.block_size, c.tap_layers, c.mask_token_id) == (6, (1, 3), 3)


def test_a_server_that_keeps_its_vocabulary_map_gets_new_drafts_with_that_map(
    target, tmp_path
) -> None:
    """SGLang samples with the token map (d2t) of the draft it started with and refuses any
    other (GET /v1/draft says `vocab_map_fixed`): a new draft for it keeps the serving draft's
    map, with new weights; for vLLM (no flag) the map comes from the buffer, which here (empty)
    is another map, so the test tells the two apart."""
    from codraft.draft.checkpoint import load_draft
    from codraft.draft.vocab import build_draft_vocab

    tcfg = TargetConfig.from_pretrained(target)
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=64, dtype="bfloat16")
    served = Eagle3Draft(cfg)
    counts = torch.zeros(tcfg.vocab_size, dtype=torch.int64)
    counts[torch.randperm(tcfg.vocab_size, generator=torch.Generator().manual_seed(3))[:64]] = 5
    served.set_vocab(*build_draft_vocab(counts, 64))  # scattered ids, not the first 64
    save_draft(tmp_path / "served", served, DraftMeta(version=0, counters={"step": 0}))
    served, _ = load_draft(tmp_path / "served")

    fixed = _learner(target, tmp_path / "a")
    fixed.serving_vocab_fixed = True  # as _serving_config sets it from the server's answer
    draft = fixed._first_draft(cfg, tmp_path / "served")
    assert torch.equal(draft.d2t, served.d2t) and torch.equal(draft.t2d, served.t2d)
    assert not torch.equal(draft.fc.weight, served.fc.weight.float())  # new weights

    free = _learner(target, tmp_path / "b")._first_draft(cfg, tmp_path / "served")
    assert not torch.equal(free.d2t, served.d2t)

    lost = _learner(target, tmp_path / "c")
    lost.serving_vocab_fixed = True
    with pytest.raises(RuntimeError, match="vocab_map_fixed"):
        lost._first_draft(cfg, None)
