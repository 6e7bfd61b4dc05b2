"""The single-process pieces of the target pipeline: the layer split, tap ownership, microbatch
plans, stages loaded alone from safetensors, and stages chained by hand equal to the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codraft.learner.data.packing import Sample, pack
from codraft.learner.parallel.launch import ParallelConfig
from codraft.learner.parallel.microbatch import plan_microbatches, split_batch
from codraft.learner.parallel.stage import (
    TargetStage,
    load_stage,
    split_layers,
    tap_stage,
    taps_by_stage,
)
from codraft.learner.parallel.tapchannel import TapChannelConfig
from codraft.learner.pipeline_trainer import PipelineTrainConfig
from codraft.models.llama import load_target
from codraft.testing import make_tiny_target


@pytest.mark.parametrize(
    ("layers", "stages", "counts"),
    [(4, 2, [2, 2]), (6, 4, [1, 2, 2, 1]), (7, 4, [2, 2, 2, 1]), (5, 5, [1] * 5), (9, 1, [9])],
)
def test_split_layers_balances_by_count(layers: int, stages: int, counts: list[int]) -> None:
    ranges = split_layers(layers, stages)
    assert [len(r) for r in ranges] == counts
    assert [i for r in ranges for i in r] == list(range(layers))


def test_split_layers_needs_a_layer_per_stage() -> None:
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        split_layers(3, 4)


def test_taps_belong_to_the_stage_that_runs_their_layer() -> None:
    ranges = split_layers(6, 4)  # [0], [1, 2], [3, 4], [5]
    assert [tap_stage(t, ranges) for t in range(7)] == [0, 0, 1, 1, 2, 2, 3]
    assert taps_by_stage((0, 3, 6), ranges) == [[0], [3], [], [6]]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 50])
def test_microbatch_plans_are_contiguous_and_balanced(n: int) -> None:
    tokens = [12, 4, 40, 8, 8, 16, 4]
    plan = plan_microbatches(tokens, n)
    assert len(plan) == min(n, len(tokens))
    assert [d for r in plan for d in r] == list(range(len(tokens)))
    assert all(len(r) for r in plan)
    if n == 2:
        sums = [sum(tokens[d] for d in r) for r in plan]
        assert max(sums) - min(sums) <= max(tokens)


def test_split_batch_is_the_batch_again() -> None:
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 50, (n,), generator=g)) for n in (5, 9, 3, 12)]
    batch = pack(samples, pad_multiple=4)
    parts = split_batch(batch, 3)
    assert len(parts) == 3
    assert torch.equal(torch.cat([p.input_ids for p in parts]), batch.input_ids)
    assert torch.equal(torch.cat([p.positions for p in parts]), batch.positions)
    assert torch.equal(torch.cat([p.valid for p in parts]), batch.valid)
    for p in parts:
        assert int(p.cu_seqlens[0]) == 0 and int(p.cu_seqlens[-1]) == p.num_tokens
    assert parts[-1].cursor is batch.cursor


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_load_stage_reads_exactly_its_slice(
    tiny_llama_dir: Path, tied_dir: Path, tied: bool, stages: int
) -> None:
    path = tied_dir if tied else tiny_llama_dir
    model = load_target(path)
    full = model.state_dict()
    seen: set[str] = set()
    for s in range(stages):
        stage = load_stage(path, s, stages)
        sd = stage.state_dict()
        for name, t in sd.items():
            assert torch.equal(t, full[name]), name
        seen |= set(sd)
        assert (stage.embed_tokens is not None) == (s == 0)
        assert (stage.lm_head is not None) == (s == stages - 1)
        if tied and s == stages - 1:
            assert torch.equal(stage.lm_head.weight, full["embed_tokens.weight"])
        assert not any(p.requires_grad for p in stage.parameters())
    assert seen == set(full)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_stages_chained_by_hand_equal_the_model(tiny_llama_dir: Path, stages: int) -> None:
    """Forward-only fp32: the stages' taps, last hidden and logits equal the model's bit for
    bit on a packed batch (same kernels, same shapes). The last stage hands on the post-norm
    last hidden state, while its tap L stays before the final norm."""
    model = load_target(tiny_llama_dir)
    L = model.config.num_layers
    taps = (*model.config.default_tap_layers(), L)
    g = torch.Generator().manual_seed(1)
    batch = pack([Sample(torch.randint(3, 500, (n,), generator=g)) for n in (7, 13, 4)])
    with torch.no_grad():
        ref = model(batch.input_ids, batch.positions, taps, cu_seqlens=batch.cu_seqlens)
        x: torch.Tensor = batch.input_ids
        got: dict[int, torch.Tensor] = {}
        for s in range(stages):
            stage = TargetStage.from_model(model, s, stages)
            x, made = stage(x, batch.positions, batch.cu_seqlens, taps)
            got.update(made)
        logits = stage.head(x)
    assert torch.equal(torch.cat([got[t] for t in taps], -1), ref.taps)
    assert torch.equal(x, ref.last_hidden)
    assert torch.equal(x, model.norm(got[L])) and not torch.allclose(x, got[L], atol=1e-2)
    assert torch.equal(logits, ref.logits)
    assert torch.equal(logits, stage.lm_head(x))


def test_configs_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one landing slot"):
        TapChannelConfig(slots=0)
    with pytest.raises(ValueError, match="timeout_s"):
        TapChannelConfig(timeout_s=0)
    with pytest.raises(ValueError, match="cp and pp must be >= 1"):
        ParallelConfig(pp=0)
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        PipelineTrainConfig(microbatches=0)
    with pytest.raises(ValueError, match="unknown target dtype"):
        PipelineTrainConfig(target_dtype="float7")
