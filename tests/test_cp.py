"""Context parallelism on real gloo process groups against the single-device computation.

One ``torch.multiprocessing.spawn`` per world size (2 and 4) runs every case below in the same
processes; each case's error is all-reduced (max over ranks) and rank 0 writes them to a JSON
file that the tests read. CP = world size, except the dp x cp case (world 4: dp 2 x cp 2).

* attention: ring + branch (codraft.learner.attention.ring) for pass d = 1..4 (K = d - 1 = 0..3
  branch keys; d = 1 is the trunk alone): output, lse and the gradients of q and every key/value
  against the dense masked reference (codraft.learner.attention.reference), on one sequence, one
  sequence of the minimum length 2 x CP and packed uneven documents; fp64 within 1e-10, fp32 within
  1e-4;
* TTT: the full loss and the draft's gradients (summed over ranks) of ContextParallel against
  codraft.learner.ttt.ttt_forward with pass_attention on the whole batch, K = 1..4 passes;
* rolls, the inverse gather, the mesh's groups, and planted bugs that each must fail.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist
from gloo import max_over_ranks
from planted_bugs import planted

from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.attention.reference import dense_masked_attention
from codraft.learner.attention.ring import ring_pass_attention, ring_pass_forward
from codraft.learner.data.packing import PackedBatch, Sample, pack
from codraft.learner.parallel.context import ContextParallel
from codraft.learner.parallel.mesh import ParallelDims, ParallelMesh
from codraft.learner.parallel.ring_comm import Ring
from codraft.learner.parallel.roll import BoundaryRoll
from codraft.learner.parallel.zigzag import shard, unshard, zigzag_layout
from codraft.learner.ttt import TTTConfig, doc_ends, roll_left, ttt_forward

WORLDS = (2, 4)
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
TOL = {"fp64": 1e-10, "fp32": 1e-4}
PASSES = (1, 2, 3, 4)
V, H, NDRAFT, HQ, HKV, HD = 96, 64, 40, 4, 2, 16

# padded document lengths for attention, as multiples of cp
ATTN_LAYOUTS = {"single": [16], "min": [2], "packed": [2, 6, 2, 10, 4]}
# raw document lengths for TTT: (a * cp + b) tokens each, padded to 2 x cp by pack()
TTT_LAYOUTS = {
    "single": [(12, -1)],
    "min": [(2, 0)],
    "packed": [(0, 5), (2, 0), (0, 1), (0, 17), (3, 1)],
}
MUTATIONS = ("causal_off_by_one", "wrong_half", "branch_own_lse", "dropped_lse_grad")
SHIFTS = (1, 2, 3, 5)

ATTN_CASES = [
    f"attn/{lay}/pass{d}/{dt}" for lay in ATTN_LAYOUTS for d in PASSES for dt in DTYPES
] + [f"attn/packed/pass4/{dt}/math" for dt in DTYPES]
TTT_CASES = [f"ttt/{lay}/K{k}/{dt}" for lay in TTT_LAYOUTS for k in PASSES for dt in DTYPES] + [
    "ttt/packed/K3/fp64/hard"
]
EXACT_CASES = [f"roll/{lay}/shift{s}" for lay in TTT_LAYOUTS for s in SHIFTS] + [
    "unshard/packed",
    "mesh/groups",
]


# ------------------------------------------------------------------------------ inputs
def _draft(dtype: torch.dtype) -> Eagle3Draft:
    cfg = DraftConfig(
        hidden_size=H, intermediate_size=96, num_attention_heads=HQ, num_key_value_heads=HKV,
        head_dim=HD, vocab_size=V, draft_vocab_size=NDRAFT, target_hidden_size=H,
        tap_layers=(1, 2, 3), max_position_embeddings=512, dtype="float32",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.set_vocab(*build_draft_vocab(torch.randint(0, 100, (V,), generator=g), NDRAFT))
    model.set_embedding(torch.randn(V, H, generator=g))
    return model.to(dtype)


def _samples(lengths: list[int], dtype: torch.dtype, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        logits = torch.randn(n, NDRAFT, generator=g, dtype=torch.float64) * 2
        out.append(
            Sample(
                token_ids=torch.randint(0, V, (n,), generator=g),
                loss_mask=(torch.rand(n, generator=g) > 0.2).to(torch.uint8),
                taps=torch.randn(n, 3 * H, generator=g, dtype=torch.float64).to(dtype),
                teacher_logits=logits.to(dtype),
            )
        )
    return out


def _ttt_lengths(name: str, cp: int) -> list[int]:
    return [a * cp + b for a, b in TTT_LAYOUTS[name]]


def _dense_pass(q, ks, vs, cu):
    """Pass len(ks): trunk causal within documents + own-anchor branch, explicit mask."""
    n = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    i = torch.arange(n)
    trunk = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    mask = torch.cat([trunk] + [torch.eye(n, dtype=torch.bool)] * (len(ks) - 1), 1)
    return dense_masked_attention(q, torch.cat(ks), torch.cat(vs), mask)


# ------------------------------------------------------------------------------ cases
def _attn_error(ring: Ring, lengths: list[int], passes: int, dtype, backend="auto") -> float:
    cp = ring.size
    cu = torch.tensor([0, *torch.tensor(lengths).mul(cp).cumsum(0).tolist()], dtype=torch.int32)
    n = int(cu[-1])
    g = torch.Generator().manual_seed(7 + passes)
    q = torch.randn(n, HQ, HD, generator=g, dtype=torch.float64)
    ks = [torch.randn(n, HKV, HD, generator=g, dtype=torch.float64) for _ in range(passes)]
    vs = [torch.randn(n, HKV, HD, generator=g, dtype=torch.float64) for _ in range(passes)]
    dout = torch.randn(n, HQ, HD, generator=g, dtype=torch.float64)
    full = [x.to(dtype).double().requires_grad_(True) for x in (q, *ks, *vs)]
    out_ref, lse_ref = _dense_pass(full[0], full[1 : 1 + passes], full[1 + passes :], cu)
    g_ref = torch.autograd.grad(out_ref, full, dout)

    lay = zigzag_layout(cu, cp, ring.rank)
    loc = [shard(x, lay).to(dtype).requires_grad_(True) for x in (q, *ks, *vs)]
    lq, lks, lvs = loc[0], loc[1 : 1 + passes], loc[1 + passes :]
    out = ring_pass_attention(lq, lks, lvs, lay, ring, backend=backend)
    with torch.no_grad():
        _, lse = ring_pass_forward(lq, lks, lvs, lay, ring, 1.0 / HD**0.5, backend)
    grads = torch.autograd.grad(out, loc, shard(dout, lay).to(dtype))
    out, out_ref, lse_ref = out.detach(), out_ref.detach(), lse_ref.detach()
    errs = [(out.double() - shard(out_ref, lay)).abs().max()]
    errs.append((lse.double() - shard(lse_ref.t(), lay)).abs().max())
    errs += [(a.double() - shard(b, lay)).abs().max() for a, b in zip(grads, g_ref, strict=True)]
    return max(float(e) for e in errs)


def _ttt_error(cp: ContextParallel, batches: list[list[Sample]], passes: int, dtype, hard: bool):
    """CP loss/grads of this replica's batch vs one device on all replicas' documents."""
    draft = _draft(dtype)
    params = list(draft.parameters())
    cfg = TTTConfig(num_passes=passes)
    whole = pack([s for b in batches for s in b], pad_multiple=cp.pad_multiple)
    teacher = None if hard else whole.teacher_logits
    ref = ttt_forward(draft, whole.input_ids, whole.positions, whole.cu_seqlens, whole.taps,
                      whole.loss_mask, pass_attention, cfg, teacher)  # fmt: skip
    g_ref = torch.autograd.grad(ref.loss, params)

    mine: PackedBatch = pack(batches[cp.mesh.dp_rank], pad_multiple=cp.pad_multiple)
    sh = cp.shard(mine)
    out = cp.ttt_forward(draft, sh, None if hard else sh.batch.teacher_logits, cfg)
    draft.zero_grad()
    out.loss.backward()
    cp.reduce_gradients(params)
    metrics = cp.reduce_metrics(out)
    errs = [abs(metrics["loss"] - float(ref.loss.detach()))]
    errs += [float((p.grad - g).abs().max()) for p, g in zip(params, g_ref, strict=True)]
    errs += [
        float((a - b).abs())
        for a, b in zip(out.pass_global_valid, ref.pass_global_valid, strict=True)
    ]
    return max(errs)


def _roll_mismatch(ring: Ring, lengths: list[int], shift: int) -> float:
    whole = pack(_samples(lengths, torch.float64, 3), pad_multiple=2 * ring.size)
    n, cu = whole.num_tokens, whole.cu_seqlens
    lay = zigzag_layout(cu, ring.size, ring.rank)
    roll, ends = BoundaryRoll(lay, ring), doc_ends(cu, n)
    x = torch.arange(n) * 7 + 3
    bad = roll.roll_left(shard(x, lay), shift, -1) != shard(roll_left(x, shift, ends, -1), lay)
    mask = whole.loss_mask.bool()
    bad_b = roll.roll_left(shard(mask, lay), shift, False) != shard(
        roll_left(mask, shift, ends, False), lay
    )
    rows = torch.nonzero(shard(torch.arange(n) + shift < ends, lay)).squeeze(1)
    feats = whole.teacher_logits
    got = roll.gather_ahead(shard(feats, lay), shift, rows)
    want = feats[shard(torch.arange(n), lay)[rows] + shift]
    return float(bad.sum() + bad_b.sum() + (got != want).sum())


def _cases(rank: int, world: int) -> dict[str, float]:
    res: dict[str, float] = {}
    mesh = ParallelMesh.build(ParallelDims(world, cp=world))
    cp = ContextParallel(mesh)
    ring = cp.ring
    for name in ATTN_CASES:
        _, lay, d, dt, *backend = name.split("/")
        lengths = ATTN_LAYOUTS[lay]
        res[name] = _attn_error(ring, lengths, int(d[4:]), DTYPES[dt], *backend)
    for bug in MUTATIONS:  # planted here, in every rank (tests/planted_bugs.py)
        with planted(bug):
            res[f"mut/{bug}"] = _attn_error(ring, ATTN_LAYOUTS["packed"], 4, torch.float64)
    for name in TTT_CASES:
        _, lay, k, dt, *hard = name.split("/")
        batch = _samples(_ttt_lengths(lay, world), DTYPES[dt], 11)
        res[name] = _ttt_error(cp, [batch], int(k[1:]), DTYPES[dt], bool(hard))
    for lay in TTT_LAYOUTS:
        for s in SHIFTS:
            res[f"roll/{lay}/shift{s}"] = _roll_mismatch(ring, _ttt_lengths(lay, world), s)
    cu = pack(_samples([3, 9, 1], torch.float64, 5), pad_multiple=2 * world).cu_seqlens
    x = torch.randn(int(cu[-1]), 3, generator=torch.Generator().manual_seed(5))
    lay = zigzag_layout(cu, world, rank)
    res["unshard/packed"] = float((unshard(shard(x, lay), lay, cu, mesh.cp_group) != x).sum())
    # the mesh's groups, and (world 4) dp 2 x cp 2 against one device on both replicas' data
    mesh2 = ParallelMesh.build(ParallelDims(world, cp=2)) if world == 4 else mesh
    wrong = 0
    for kind, group in mesh2.groups.items():
        ranks = dist.get_process_group_ranks(group) if group is not None else [rank]
        wrong += sorted(ranks) != mesh2.dims.group_of(kind, rank)
    res["mesh/groups"] = float(wrong)
    if world == 4:
        cp2 = ContextParallel(mesh2)
        batches = [_samples([5, 4, 1, 11], torch.float64, 21), _samples([2, 13], torch.float64, 22)]
        res["dpcp/K3/fp64"] = _ttt_error(cp2, batches, 3, torch.float64, False)
    return res


@cache
def _run(world: int) -> dict[str, float]:
    return max_over_ranks(_cases, world)


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ATTN_CASES + TTT_CASES)
def test_matches_single_device(world: int, case: str) -> None:
    err = _run(world)[case]
    tol = TOL[case.split("/")[3]]
    assert err <= tol, f"world {world}, {case}: max error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", EXACT_CASES)
def test_exact(world: int, case: str) -> None:
    assert _run(world)[case] == 0, f"world {world}, {case}: {_run(world)[case]:.0f} mismatches"


def test_dp_by_cp_matches_single_device() -> None:
    err = _run(4)["dpcp/K3/fp64"]
    assert err <= TOL["fp64"], f"dp 2 x cp 2: max error {err:.3e}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("bug", MUTATIONS)
def test_planted_bugs_are_caught(world: int, bug: str) -> None:
    err = _run(world)[f"mut/{bug}"]
    assert err > 1e-6, f"world {world}: planted bug {bug} went unnoticed (max error {err:.1e})"
