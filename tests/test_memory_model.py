"""The whole TTT step's memory model (codraft.learner.parallel.memory.step_saved_bytes_per_token)
against what autograd actually keeps for backward.

Measured with `torch.autograd.graph.saved_tensors_hooks` over the step as the Trainer runs it
(`ttt_forward` with `pass_attention` and soft teacher targets): every tensor saved for backward
is counted once (by storage), parameters, buffers and the step's own inputs left out, and the
per-token figure is the difference between two batch sizes (so the constant part, the weights'
autocast copies, drops out). In fp32 and under CPU bf16 autocast (the GPU trainer's autocast
casts the same operations), K = 1 and 3, with and without `recompute_mlp`. The GPU's measured
peak (saved + transient) is `scripts/bench_cp_train.py`'s on the H200.
"""

from __future__ import annotations

import pytest
import torch

import codraft.learner.ttt as ttt
from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.parallel.memory import StepShape, step_saved_bytes_per_token

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


def saved_bytes(n: int, passes: int, autocast: bool, recompute_mlp: bool) -> int:
    """Bytes autograd keeps for backward over one document of n tokens (see module doc)."""
    model = _draft()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    positions = torch.arange(n)
    cu = torch.tensor([0, n], dtype=torch.int32)
    taps = torch.randn(n, SHAPE.taps_width, generator=g)
    mask = torch.ones(n, dtype=torch.uint8)
    probs = torch.softmax(torch.randn(n, SHAPE.draft_vocab, generator=g), -1)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    skip |= {t.untyped_storage().data_ptr() for t in (ids, positions, cu, taps, mask, probs)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    cfg = ttt.TTTConfig(num_passes=passes, recompute_mlp=recompute_mlp, loss_chunk_tokens=64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ttt.ttt_forward(model, ids, positions, cu, taps, mask, pass_attention, cfg, probs)
    out.loss.backward()  # the graph is whole: what was kept is what backward uses
    return sum(kept.values())


def per_token(passes: int, autocast: bool, recompute_mlp: bool) -> float:
    return (saved_bytes(512, passes, autocast, recompute_mlp)
            - saved_bytes(256, passes, autocast, recompute_mlp)) / 256  # fmt: skip


@pytest.mark.parametrize("recompute_mlp", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("passes", [1, 3])
def test_the_model_is_what_autograd_keeps(passes: int, autocast: bool, recompute_mlp: bool):
    measured = per_token(passes, autocast, recompute_mlp)
    model = step_saved_bytes_per_token(
        passes, SHAPE, autocast=autocast, recompute_mlp=recompute_mlp
    )
    assert measured == model, (measured, model)  # to the byte


def test_mutation_recompute_ignored_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted from here: recompute_mlp's checkpoint replaced by a plain call (everything kept)."""
    monkeypatch.setattr(ttt, "checkpoint", lambda fn, *args, **kw: fn(*args))
    measured = per_token(3, True, True)
    model = step_saved_bytes_per_token(3, SHAPE, autocast=True, recompute_mlp=True)
    assert abs(measured - model) > 0.1 * model, (measured, model)


def _grads(autocast: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, list]:
    torch.manual_seed(0)  # the draft's own initialisation
    model = _draft().to(dtype)
    g = torch.Generator().manual_seed(1)
    n = 128
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    cu = torch.tensor([0, n], dtype=torch.int32)
    taps = torch.randn(n, SHAPE.taps_width, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(n, SHAPE.draft_vocab, generator=g), -1).to(dtype)
    mask = torch.ones(n, dtype=torch.uint8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = ttt.ttt_forward(model, ids, torch.arange(n), cu, taps, mask, pass_attention,
                              ttt.TTTConfig(num_passes=3), probs)  # fmt: skip
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
