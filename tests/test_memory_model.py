"""The whole TTT step's memory model (codraft.learner.parallel.memory.step_saved_bytes_per_token)
against what autograd actually keeps for backward.

Measured with `torch.autograd.graph.saved_tensors_hooks` over the step as the Trainer runs it
(`ttt_forward` with `pass_attention` and the teacher's bf16 logits): every tensor saved for
backward is counted once (by storage), parameters, buffers and the step's own inputs left out,
and the per-token figure is the difference between two batch sizes (so the constant part, the
weights' autocast copies, drops out). In fp32 and under CPU bf16 autocast (the GPU trainer's
autocast casts the same operations), K = 1 and 3, with and without `recompute_mlp`, taps in
fp32 and in bf16.

The step's peak model (`step_peak_bytes`: what is kept, the teacher's logits and the working
set where the peak falls) is checked against the peaks `scripts/bench_cp_train.py` measured on
the H200 (docs/bench/train_step_memory_h200.json).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import codraft.learner.ttt as ttt
from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.parallel.memory import (
    GIB,
    StepShape,
    step_peak_bytes,
    step_saved_bytes_per_token,
)

SHAPE = StepShape(hidden=64, intermediate=160, heads=4, kv_heads=2, head_dim=16,
                  taps_width=3 * 64, draft_vocab=120)  # fmt: skip
VOCAB = 300


def _draft() -> Eagle3Draft:
    s = SHAPE
    cfg = DraftConfig(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=VOCAB,
        draft_vocab_size=s.draft_vocab, target_hidden_size=s.taps_width // 3,
        tap_layers=(1, 2, 3), max_position_embeddings=4096, dtype="float32",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    model = Eagle3Draft(cfg)
    model.set_vocab(*build_draft_vocab(torch.randint(0, 100, (VOCAB,), generator=g), s.draft_vocab))
    model.set_embedding(torch.randn(VOCAB, s.hidden, generator=g))
    return model


def saved_bytes(
    n: int, passes: int, autocast: bool, recompute_mlp: bool, taps_dtype: torch.dtype
) -> int:
    """Bytes autograd keeps for backward over one document of n tokens (see module doc)."""
    model = _draft()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    positions = torch.arange(n)
    cu = torch.tensor([0, n], dtype=torch.int32)
    taps = torch.randn(n, SHAPE.taps_width, generator=g).to(taps_dtype)
    mask = torch.ones(n, dtype=torch.uint8)
    logits = torch.randn(n, SHAPE.draft_vocab, generator=g).bfloat16()  # the teacher's
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    skip |= {t.untyped_storage().data_ptr() for t in (ids, positions, cu, taps, mask, logits)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    cfg = ttt.TTTConfig(num_passes=passes, recompute_mlp=recompute_mlp, loss_chunk_tokens=64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ttt.ttt_forward(
                model, ids, positions, cu, taps, mask, pass_attention, cfg, logits
            )
    out.loss.backward()  # the graph is whole: what was kept is what backward uses
    return sum(kept.values())


def per_token(
    passes: int, autocast: bool, recompute_mlp: bool, taps_dtype: torch.dtype = torch.float32
) -> float:
    args = (passes, autocast, recompute_mlp, taps_dtype)
    return (saved_bytes(512, *args) - saved_bytes(256, *args)) / 256


@pytest.mark.parametrize("taps_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute_mlp", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("passes", [1, 3])
def test_the_model_is_what_autograd_keeps(
    passes: int, autocast: bool, recompute_mlp: bool, taps_dtype: torch.dtype
) -> None:
    measured = per_token(passes, autocast, recompute_mlp, taps_dtype)
    shape = replace(SHAPE, taps_bytes=taps_dtype.itemsize)
    model = step_saved_bytes_per_token(
        passes, shape, autocast=autocast, recompute_mlp=recompute_mlp
    )
    assert measured == model, (measured, model)  # to the byte


def test_mutation_recompute_ignored_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted from here: recompute_mlp's checkpoint replaced by a plain call (everything kept)."""
    monkeypatch.setattr(ttt, "checkpoint", lambda fn, *args, **kw: fn(*args))
    measured = per_token(3, True, True)
    model = step_saved_bytes_per_token(
        3, replace(SHAPE, taps_bytes=4), autocast=True, recompute_mlp=True
    )
    assert abs(measured - model) > 0.1 * model, (measured, model)


def _grads(autocast: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list]:
    torch.manual_seed(0)  # the draft's own initialisation
    model = _draft().to(dtype)
    g = torch.Generator().manual_seed(1)
    n = 128
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    cu = torch.tensor([0, n], dtype=torch.int32)
    taps = torch.randn(n, SHAPE.taps_width, generator=g).to(dtype)
    logits = torch.randn(n, SHAPE.draft_vocab, generator=g).to(dtype)
    mask = torch.ones(n, dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ttt.ttt_forward(model, ids, torch.arange(n), cu, taps, mask, pass_attention,
                              ttt.TTTConfig(num_passes=3), logits)  # fmt: skip
    out.loss.backward()
    return out.loss.detach(), [p.grad.double() for p in model.parameters() if p.grad is not None]


def test_one_cast_per_input_keeps_autocasts_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v (and gate/up) read one bf16 copy of their input (codraft.draft.model.
    shared_input_linears): the loss is autocast's to the bit, and every gradient is at least as
    close to the fp64 step's as with autocast's own per-projection casts (which also sum the
    K passes' weight gradients in bf16)."""
    import codraft.draft.model as dm

    ref = _grads(False, torch.float64)[1]
    loss, grads = _grads(True)
    monkeypatch.setattr(
        dm,
        "shared_input_linears",
        lambda x, *ws: tuple(torch.nn.functional.linear(x, w) for w in ws),
    )
    loss_autocast, grads_autocast = _grads(True)
    assert torch.equal(loss, loss_autocast)
    for ours, theirs, want in zip(grads, grads_autocast, ref, strict=True):
        err = float((ours - want).norm() / want.norm())
        assert err <= float((theirs - want).norm() / want.norm()) + 1e-6, err
        assert err < 0.02, err


# ------------------------------------------------------------------ the step's peak, measured
MEASURED = Path(__file__).resolve().parents[1] / "docs" / "bench" / "train_step_memory_h200.json"
PEAK_TOL = 0.05


def _measured_peaks() -> list[tuple[dict, float]]:
    """(record, the model's peak in GiB) for every step the H200 ran at the current code."""
    records = json.loads(MEASURED.read_text())["runs"]["current"]
    out = []
    for r in records:
        assert r["status"] == "ok" and r["passes"] == 3 and r["cp"] == 1, r
        shape = StepShape(teacher_bytes=2 if r["teacher_dtype"] == "bfloat16" else 4)
        model = step_peak_bytes(
            r["tokens"], 3, shape, recompute_mlp=r["recompute_mlp"], loss_chunk=r["loss_chunk"]
        )
        out.append((r, model / GIB))
    return out


def test_the_peak_model_is_the_measured_peak() -> None:
    """The step's peak above its inputs (max_memory_allocated on the H200, scripts/
    bench_cp_train.py) against `step_peak_bytes`: within 5% from 16K to 256K tokens, with
    and without recompute_mlp."""
    got = _measured_peaks()
    assert {(r["tokens"], r["recompute_mlp"]) for r, _ in got} >= {(163840, False), (262144, True)}
    for r, model in got:
        err = model / r["extra_gib"] - 1
        assert abs(err) <= PEAK_TOL, (r["tokens"], r["recompute_mlp"], r["extra_gib"], model)


def test_mutation_a_peak_model_without_the_teacher_or_the_working_set_is_caught() -> None:
    """Planted from here: the model's peak less the teacher's logits, or less the working set
    (what backward keeps and the teacher only), misses some measured peak by more than the
    tolerance."""
    s = StepShape()
    without_teacher, without_working_set = [], []
    for r, model in _measured_peaks():
        t, measured = r["tokens"], r["extra_gib"]
        teacher = t * s.draft_vocab * s.teacher_bytes / GIB
        saved = t * step_saved_bytes_per_token(3, s, recompute_mlp=r["recompute_mlp"]) / GIB
        without_teacher.append(abs((model - teacher) / measured - 1))
        without_working_set.append(abs((saved + teacher) / measured - 1))
    assert max(without_teacher) > PEAK_TOL, without_teacher
    assert max(without_working_set) > PEAK_TOL, without_working_set
