"""Context-parallel pieces that need no second process: zigzag layouts, the mesh's arithmetic,
the ring code at CP = 1 (against the single-device pass attention), the loopback ring used by
the benchmark, and the TTT loss with pluggable rolls (against codraft.learner.ttt.ttt_forward)."""

from __future__ import annotations

import pytest
import torch

from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.attention.ring import ring_pass_attention
from codraft.learner.data.packing import Sample, pack
from codraft.learner.parallel.context import ContextParallel
from codraft.learner.parallel.launch import ParallelConfig, init_distributed
from codraft.learner.parallel.mesh import ParallelDims, ParallelMesh
from codraft.learner.parallel.ring_comm import LoopbackRing, Ring
from codraft.learner.parallel.roll import BoundaryRoll
from codraft.learner.parallel.zigzag import shard, shard_batch, unshard_parts, zigzag_layout
from codraft.learner.ttt import LocalRoll, TTTConfig, doc_ends, roll_left, ttt_forward


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------------------ zigzag
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_holds_chunks_r_and_mirror(cp: int) -> None:
    lengths = [2 * cp, 6 * cp, 4 * cp]
    cu = _cu(lengths)
    seen = []
    for r in range(cp):
        lay = zigzag_layout(cu, cp, r)
        assert lay.local_cu.tolist() == (cu // cp).tolist()
        assert lay.half_cu.tolist() == (cu // (2 * cp)).tolist()
        want, front, back = [], [], []
        for start, n in zip(cu[:-1].tolist(), lengths, strict=True):
            c = n // (2 * cp)
            front += list(range(start + r * c, start + (r + 1) * c))  # chunk r
            back += list(range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c))
            want += front[-c:] + back[-c:]
        assert lay.index.tolist() == want
        assert lay.index[lay.front].tolist() == front
        assert lay.index[lay.back].tolist() == back
        seen += want
    assert sorted(seen) == list(range(int(cu[-1])))


def test_shard_batch_and_inverse() -> None:
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(torch.randint(0, 50, (n,), generator=g), taps=torch.randn(n, 6, generator=g))
        for n in (5, 1, 13)
    ]
    batch = pack(samples, pad_multiple=6)  # cp = 3
    parts = []
    for r in range(3):
        local, lay = shard_batch(batch, 3, r)
        assert local.cu_seqlens.tolist() == (batch.cu_seqlens // 3).tolist()
        assert torch.equal(local.positions, shard(batch.positions, lay))
        assert torch.equal(local.valid, shard(batch.valid, lay))  # padding stays padding
        parts.append(local.taps)
    assert torch.equal(unshard_parts(parts, batch.cu_seqlens), batch.taps)


def test_layout_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="pad_multiple=4"):
        zigzag_layout(_cu([4, 6]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank must be in 0..1"):
        zigzag_layout(_cu([4]), 2, 2)


# ------------------------------------------------------------------------------ mesh
def test_dims_infer_dp_and_order_ranks_cp_innermost() -> None:
    dims = ParallelDims(16, cp=4, pp=2)
    assert dims.dp == 2
    assert dims.groups("cp")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.group_of("dp", 5) == [1, 5]
    assert dims.group_of("dp_cp", 9) == list(range(8, 16))
    assert dims.group_of("pp", 3) == [3, 11]
    assert dims.coords(13) == (1, 1, 1) and dims.rank_of(1, 1, 1) == 13
    for kind in ("cp", "dp", "dp_cp", "pp"):
        flat = sorted(r for g in dims.groups(kind) for r in g)
        assert flat == list(range(16)), kind


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"world_size": 6, "cp": 4}, "not divisible by cp x pp"),
        ({"world_size": 8, "cp": 2, "dp": 3}, "expected dp x cp x pp = world size"),
        ({"world_size": 4, "cp": 0}, "cp: expected an integer >= 1"),
    ],
)
def test_dims_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_mesh_needs_a_process_group_above_one_rank() -> None:
    with pytest.raises(RuntimeError, match="torchrun"):
        ParallelMesh.build(ParallelDims(2, cp=2))
    mesh = ParallelMesh.build(ParallelDims(1))
    assert mesh.cp_group is None and mesh.cp_size == 1 and mesh.is_main


def test_launch_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 4"):
        init_distributed(ParallelConfig(cp=4, device="cpu"))
    mesh, device = init_distributed(ParallelConfig(cp=1, device="cpu"))
    assert mesh.dims.world_size == 1 and device.type == "cpu"


# ------------------------------------------------------------------------------ ring at CP = 1
def _qkv(n: int, passes: int, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(passes)
    q = torch.randn(n, 4, 8, generator=g, dtype=dtype).requires_grad_(True)
    ks = [
        torch.randn(n, 2, 8, generator=g, dtype=dtype).requires_grad_(True) for _ in range(passes)
    ]
    vs = [
        torch.randn(n, 2, 8, generator=g, dtype=dtype).requires_grad_(True) for _ in range(passes)
    ]
    return q, ks, vs


@pytest.mark.parametrize("passes", [1, 2, 3, 4])
def test_ring_at_cp1_is_pass_attention(passes: int) -> None:
    cu = _cu([2, 10, 4, 8])
    q, ks, vs = _qkv(24, passes)
    lay = zigzag_layout(cu, 1, 0)
    got = ring_pass_attention(q, ks, vs, lay, Ring.of(None))
    want = pass_attention(q, ks, vs, cu)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    g_got = torch.autograd.grad(got, [q, *ks, *vs], dout)
    g_want = torch.autograd.grad(want, [q, *ks, *vs], dout)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_branch_chunks_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The branch runs in row chunks (bounded temporaries): chunk edges change nothing."""
    import codraft.learner.attention.ring_branch as rb

    monkeypatch.setattr(rb, "CHUNK", 5)
    cu = _cu([2, 10, 4, 8])
    q, ks, vs = _qkv(24, 4)
    got = ring_pass_attention(q, ks, vs, zigzag_layout(cu, 1, 0), Ring.of(None))
    want = pass_attention(q, ks, vs, cu)
    g_got = torch.autograd.grad(got.sum(), [q, *ks, *vs])
    g_want = torch.autograd.grad(want.sum(), [q, *ks, *vs])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_loopback_ring_runs_one_ranks_work(cp: int) -> None:
    """The benchmark's stand-in for CP > 1 on one device: shapes and gradients flow."""
    cu = _cu([4 * cp, 8 * cp])
    for r in (0, cp - 1):
        lay = zigzag_layout(cu, cp, r)
        q, ks, vs = _qkv(lay.num_local, 3, torch.float32)
        out = ring_pass_attention(q, ks, vs, lay, LoopbackRing(cp, r))
        out.sum().backward()
        assert out.shape == q.shape and all(k.grad is not None for k in ks)


def test_ring_rejects_a_foreign_shard() -> None:
    lay = zigzag_layout(_cu([8]), 2, 0)
    q, ks, vs = _qkv(8, 1)
    with pytest.raises(ValueError, match="expected 4 local rows"):
        ring_pass_attention(q, ks, vs, lay, LoopbackRing(2, 0))
    with pytest.raises(ValueError, match="disagree"):
        ring_pass_attention(q[:4], [k[:4] for k in ks], [v[:4] for v in vs], lay, Ring.of(None))


# ------------------------------------------------------------------------------ rolls and TTT
@pytest.mark.parametrize("shift", [0, 1, 2, 3, 7])
def test_boundary_roll_at_cp1_is_roll_left(shift: int) -> None:
    cu = _cu([2, 6, 2, 10])
    x = torch.arange(20) * 3 + 1
    roll = BoundaryRoll(zigzag_layout(cu, 1, 0), Ring.of(None))
    assert torch.equal(roll.roll_left(x, shift, -1), roll_left(x, shift, doc_ends(cu, 20), -1))


def _draft() -> Eagle3Draft:
    cfg = DraftConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, draft_vocab_size=24, target_hidden_size=32,
        tap_layers=(1, 2, 3), max_position_embeddings=256, dtype="float32",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.set_vocab(*build_draft_vocab(torch.randint(0, 50, (64,), generator=g), 24))
    model.set_embedding(torch.randn(64, 32, generator=g))
    return model.double()


@pytest.mark.parametrize("hard", [False, True])
def test_rolled_ttt_equals_ttt_forward(hard: bool) -> None:
    """ttt_forward with an explicit LocalRoll (and through
    the CP = 1 ContextParallel path) it must give the same loss and gradients."""
    g = torch.Generator().manual_seed(2)
    samples = [
        Sample(
            torch.randint(0, 64, (n,), generator=g),
            taps=torch.randn(n, 96, generator=g, dtype=torch.float64),
            teacher_logits=torch.softmax(torch.randn(n, 24, generator=g, dtype=torch.float64), -1),
        )
        for n in (7, 1, 12)
    ]
    b = pack(samples, pad_multiple=2)
    draft = _draft()
    params = list(draft.parameters())
    cfg = TTTConfig(num_passes=3)
    teacher = None if hard else b.teacher_logits
    args = (draft, b.input_ids, b.positions, b.cu_seqlens, b.taps, b.loss_mask)
    want = ttt_forward(*args, pass_attention, cfg, teacher)
    g_want = torch.autograd.grad(want.loss, params)
    local = ttt_forward(
        *args, pass_attention, cfg, teacher, roll=LocalRoll(b.cu_seqlens, b.num_tokens)
    )
    cp = ContextParallel(ParallelMesh.single())
    sh = cp.shard(b)
    via_cp = cp.ttt_forward(draft, sh, None if hard else sh.batch.teacher_logits, cfg)
    for got in (local, via_cp):
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-12)
        for a, b_ in zip(torch.autograd.grad(got.loss, params), g_want, strict=True):
            torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)
        assert [int(v) for v in got.pass_valid] == [int(v) for v in want.pass_valid]


# ------------------------------------------------------------------------------ memory model
@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (4, 3)])
def test_saved_activations_match_the_memory_model(cp: int, rank: int) -> None:
    """What K ring Functions keep for backward is the model's S exactly (fp32 here: lse fp32)."""
    from codraft.learner.parallel import memory

    tokens, passes = 64, 3
    shape = memory.AttnShape(heads=4, kv_heads=2, head_dim=8, dtype_bytes=4)
    lay = zigzag_layout(_cu([tokens]), cp, rank)
    ring = LoopbackRing(cp, rank) if cp > 1 else Ring.of(None)
    q, ks, vs = _qkv(lay.num_local, passes, torch.float32)
    qs = [q.detach().clone().requires_grad_(True) for _ in range(passes)]
    saved: dict[int, int] = {}

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        for d in range(passes):
            ring_pass_attention(qs[d], ks[: d + 1], vs[: d + 1], lay, ring)
    assert sum(saved.values()) == memory.saved_bytes(tokens, cp, passes, shape)


def test_my_batches_splits_runs_over_replicas() -> None:
    from types import SimpleNamespace

    from codraft.learner.parallel.launch import my_batches

    batches = [SimpleNamespace(cursor=i) for i in range(7)]
    for dp_rank in range(3):
        mesh = SimpleNamespace(dp_size=3, dp_rank=dp_rank)
        got = [(b.cursor, c) for b, c in my_batches(batches, mesh)]
        assert got == [(dp_rank, 2), (3 + dp_rank, 5)]  # batch 6 (a partial run) is dropped
