"""Block attention and TTT branch attention against dense references (CPU).

fp64 must match within 1e-10, fp32 (against the fp64 reference on the upcast inputs) within
1e-4. Planted bugs (tests/planted_bugs.py) must each break a comparison by more than its
tolerance.
"""

from __future__ import annotations

import pytest
import torch
from planted_bugs import plant
from torch.utils._python_dispatch import TorchDispatchMode

from codraft.learner.attention import (
    block_attention,
    block_backward,
    block_cuda,
    block_forward,
    block_math,
    branch_attention,
    merge_lse,
)
from codraft.learner.attention.reference import (
    dense_block_attention,
    dense_masked_attention,
    dense_ttt_attention,
)

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
BACKENDS = ["cpu_flash", "math"]
HEADS = [(4, 2), (2, 2)]  # (Hq, Hkv): GQA and MHA
HEAD_DIM = 8


def _cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference in fp64; -inf entries must coincide (then count as 0)."""
    a, b = a.detach().double(), b.detach().double()
    a_inf, b_inf = torch.isneginf(a), torch.isneginf(b)
    if not torch.equal(a_inf, b_inf):
        return float("inf")
    if a.isnan().any() or b.isnan().any():
        return float("inf")
    diff = (a - b).masked_fill(a_inf, 0.0).abs()
    return float(diff.max()) if diff.numel() else 0.0


# --------------------------------------------------------------------------------------------
# block_forward / block_backward
# --------------------------------------------------------------------------------------------

Q_LENS = [1, 5, 17, 3]
K_LENS_FULL = [4, 1, 9, 6]
K_LENS_WITH_EMPTY = [3, 0, 7, 1]


def _block_errors(
    backend: str, causal: bool, k_lens: list[int], dtype: torch.dtype, heads: tuple[int, int]
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    hq, hkv = heads
    cu_q = _cu(Q_LENS)
    cu_k = cu_q if causal else _cu(k_lens)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = _randn(tq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    k = _randn(tk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    v = _randn(tk, hkv, HEAD_DIM, dtype=dtype, gen=gen)
    g = _randn(tq, hq, HEAD_DIM, dtype=dtype, gen=gen)

    out, lse = block_forward(q, k, v, cu_q, cu_k, causal=causal, scale=0.4, backend=backend)
    dq, dk, dv = block_backward(
        g, q, k, v, out, lse, cu_q, cu_k, causal=causal, scale=0.4, backend=backend
    )

    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = dense_block_attention(q64, k64, v64, cu_q, cu_k, causal=causal, scale=0.4)
    rdq, rdk, rdv = torch.autograd.grad(ref_out, (q64, k64, v64), g.double())
    return {
        "out": _max_err(out, ref_out),
        "lse": _max_err(lse, ref_lse),
        "dq": _max_err(dq, rdq),
        "dk": _max_err(dk, rdk),
        "dv": _max_err(dv, rdv),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mha"])
@pytest.mark.parametrize(
    "causal,k_lens",
    [(True, None), (False, K_LENS_FULL), (False, K_LENS_WITH_EMPTY)],
    ids=["causal", "full", "full-empty-doc"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_matches_dense(backend, causal, k_lens, heads, dtype):
    errs = _block_errors(backend, causal, k_lens, dtype, heads)
    assert max(errs.values()) < TOL[dtype], errs


def test_block_lse_layout_and_empty_rows():
    cu_q, cu_k = _cu([2, 3]), _cu([0, 4])
    q, k = torch.randn(5, 4, 8), torch.randn(4, 2, 8)
    out, lse = block_forward(q, k, k, cu_q, cu_k, causal=False)
    assert lse.shape == (4, 5) and lse.dtype == torch.float32
    assert torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2:]).all()
    assert (out[:2] == 0).all()
    _, lse64 = block_forward(q.double(), k.double(), k.double(), cu_q, cu_k, causal=False)
    assert lse64.dtype == torch.float64


def test_block_bf16_runs_close():
    gen = torch.Generator().manual_seed(3)
    cu = _cu(Q_LENS)
    q = _randn(26, 4, 16, dtype=torch.bfloat16, gen=gen)
    k = _randn(26, 2, 16, dtype=torch.bfloat16, gen=gen)
    out, lse = block_forward(q, k, k, cu, cu, causal=True)
    ref, ref_lse = dense_block_attention(q.double(), k.double(), k.double(), cu, cu, causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert _max_err(out, ref) < 3e-2 and _max_err(lse, ref_lse) < 1e-3


def test_block_errors_are_explicit():
    q, k = torch.randn(5, 4, 8), torch.randn(5, 3, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        block_forward(q, k, k, _cu([5]), _cu([5]), causal=True)
    k = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="diagonal block"):
        block_forward(q, k, k, _cu([5]), _cu([6]), causal=True)
    with pytest.raises(ValueError, match="int32"):
        block_forward(q, k, k, _cu([5]).long(), _cu([6]), causal=False)
    with pytest.raises(ValueError, match="end at the token count"):
        block_forward(q, k, k, _cu([4]), _cu([6]), causal=False)
    with pytest.raises(ValueError, match="cuda_flash"):
        block_forward(q, k, k, _cu([5]), _cu([6]), causal=False, backend="cuda_flash")


def test_block_attention_gradcheck():
    gen = torch.Generator().manual_seed(4)
    cu = _cu([1, 3])
    q, k, v = (_randn(4, h, 2, dtype=torch.float64, gen=gen).requires_grad_() for h in (2, 1, 1))
    fn = lambda q, k, v: block_attention(q, k, v, cu, cu, causal=True)[0]
    assert torch.autograd.gradcheck(fn, (q, k, v))


# --------------------------------------------------------------------------------------------
# merging blocks with a joint replay (what CP ring attention does)
# --------------------------------------------------------------------------------------------


def _ring_errors(backend: str, dtype: torch.dtype) -> dict[str, float]:
    """Queries see a full 'past' shard (some documents have none) plus their causal diagonal."""
    gen = torch.Generator().manual_seed(2)
    hq, hkv = 4, 2
    cu_q, cu_p = _cu(Q_LENS), _cu(K_LENS_WITH_EMPTY)
    tq, tp = int(cu_q[-1]), int(cu_p[-1])
    q = _randn(tq, hq, HEAD_DIM, dtype=dtype, gen=gen)
    kc, vc = (_randn(tq, hkv, HEAD_DIM, dtype=dtype, gen=gen) for _ in range(2))
    kp, vp = (_randn(tp, hkv, HEAD_DIM, dtype=dtype, gen=gen) for _ in range(2))
    g = _randn(tq, hq, HEAD_DIM, dtype=dtype, gen=gen)

    o1, l1 = block_forward(q, kc, vc, cu_q, cu_q, causal=True, backend=backend)
    o2, l2 = block_forward(q, kp, vp, cu_q, cu_p, causal=False, backend=backend)
    out, lse_t = merge_lse(o1, l1.transpose(0, 1), o2, l2.transpose(0, 1))
    out, lse = out.to(dtype), lse_t.transpose(0, 1)
    dq1, dkc, dvc = block_backward(g, q, kc, vc, out, lse, cu_q, cu_q, causal=True, backend=backend)
    dq2, dkp, dvp = block_backward(
        g, q, kp, vp, out, lse, cu_q, cu_p, causal=False, backend=backend
    )

    # dense: keys = [diagonal shard; past shard] with the union mask
    x64 = [t.double().requires_grad_() for t in (q, kc, vc, kp, vp)]
    q64, kc64, vc64, kp64, vp64 = x64
    doc_q = torch.repeat_interleave(torch.arange(4), torch.tensor(Q_LENS))
    doc_p = torch.repeat_interleave(torch.arange(4), torch.tensor(K_LENS_WITH_EMPTY))
    pos = torch.arange(tq) - cu_q.long()[doc_q]
    diag = (doc_q[:, None] == doc_q[None, :]) & (pos[None, :] <= pos[:, None])
    past = doc_q[:, None] == doc_p[None, :]
    mask = torch.cat([diag, past], dim=1)
    ref_out, ref_lse = dense_masked_attention(
        q64, torch.cat([kc64, kp64]), torch.cat([vc64, vp64]), mask
    )
    grads = torch.autograd.grad(ref_out, x64, g.double())
    return {
        "out": _max_err(out, ref_out),
        "lse": _max_err(lse, ref_lse),
        "dq": _max_err(dq1.double() + dq2.double(), grads[0]),
        "dk_diag": _max_err(dkc, grads[1]),
        "dv_diag": _max_err(dvc, grads[2]),
        "dk_past": _max_err(dkp, grads[3]),
        "dv_past": _max_err(dvp, grads[4]),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_blocks_joint_replay_matches_dense(backend, dtype):
    errs = _ring_errors(backend, dtype)
    assert max(errs.values()) < TOL[dtype], errs


def test_merge_lse_both_empty_gives_zero_and_neg_inf():
    out = torch.randn(3, 2, 4)
    ninf = torch.full((3, 2), float("-inf"))
    merged, lse = merge_lse(out, ninf, out, ninf)
    assert (merged == 0).all() and torch.isneginf(lse).all()


# --------------------------------------------------------------------------------------------
# branch attention
# --------------------------------------------------------------------------------------------

PACKINGS = [[1, 5, 17, 3], [2, 1, 1, 9]]


def _branch_errors(
    num_passes: int,
    lengths: list[int],
    dtype: torch.dtype,
    heads: tuple[int, int],
    backend: str = "auto",
    seed: int = 0,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    cu = _cu(lengths)
    t = int(cu[-1])
    q = _randn(num_passes, t, hq, HEAD_DIM, dtype=dtype, gen=gen).requires_grad_()
    k = _randn(num_passes, t, hkv, HEAD_DIM, dtype=dtype, gen=gen).requires_grad_()
    v = _randn(num_passes, t, hkv, HEAD_DIM, dtype=dtype, gen=gen).requires_grad_()
    g = _randn(num_passes, t, hq, HEAD_DIM, dtype=dtype, gen=gen)

    out = branch_attention(q, k, v, cu, backend=backend)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)

    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_ttt_attention(*x64, cu)
    rdq, rdk, rdv = torch.autograd.grad(ref, x64, g.double())
    assert out.dtype == dtype and dq.dtype == dtype and dk.dtype == dtype
    return {
        "out": _max_err(out, ref),
        "dq": _max_err(dq, rdq),
        "dk": _max_err(dk, rdk),
        "dv": _max_err(dv, rdv),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mha"])
@pytest.mark.parametrize("lengths", PACKINGS, ids=["1-5-17-3", "2-1-1-9"])
@pytest.mark.parametrize("num_passes", [1, 2, 3, 4])
def test_branch_matches_dense(num_passes, lengths, heads, dtype):
    errs = _branch_errors(num_passes, lengths, dtype, heads)
    assert max(errs.values()) < TOL[dtype], errs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_branch_math_backend_matches_dense(dtype):
    errs = _branch_errors(3, PACKINGS[0], dtype, (4, 2), backend="math")
    assert max(errs.values()) < TOL[dtype], errs


def test_branch_gradcheck():
    gen = torch.Generator().manual_seed(5)
    cu = _cu([1, 2])
    q = _randn(3, 3, 2, 2, dtype=torch.float64, gen=gen).requires_grad_()
    k = _randn(3, 3, 1, 2, dtype=torch.float64, gen=gen).requires_grad_()
    v = _randn(3, 3, 1, 2, dtype=torch.float64, gen=gen).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v: branch_attention(q, k, v, cu), (q, k, v))


def test_branch_shape_errors():
    q, k = torch.randn(3, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with pytest.raises(ValueError, match="one K, T and D"):
        branch_attention(q, k, k, _cu([5]))
    with pytest.raises(ValueError, match=r"q \[K, T, Hq, D\]"):
        branch_attention(q[0], k[0], k[0], _cu([5]))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for r in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(r, torch.Tensor):
                self.largest = max(self.largest, r.numel())
        return result


@pytest.mark.parametrize("backend,t", [("cpu_flash", 2048), ("math", 512)])
def test_branch_never_materialises_t_by_t(backend, t, monkeypatch):
    monkeypatch.setattr(block_math, "_MATH_CHUNK", 16)
    cu = _cu([1, 3 * t // 4, t - 1 - 3 * t // 4])
    q = torch.randn(3, t, 2, 8, requires_grad=True)
    k = torch.randn(3, t, 1, 8, requires_grad=True)
    v = torch.randn(3, t, 1, 8, requires_grad=True)
    with _LargestTensor() as probe:
        out = branch_attention(q, k, v, cu, backend=backend)
        out.backward(torch.randn_like(out))
    # Largest legitimate tensors: [K, T, Hq, D] = 48 T elements; the math backend's query-chunk
    # scores [K * Hq, chunk, longest doc] = 6 * 16 * 3T/4 = 72 T. T x T would be T^2 (>= 512 T).
    assert probe.largest < t * t // 4, probe.largest


# --------------------------------------------------------------------------------------------
# planted bugs: each must break a comparison by more than the tolerance
# --------------------------------------------------------------------------------------------


def _run_branch_fp64(backend: str = "cpu_flash") -> dict[str, float]:
    return _branch_errors(4, PACKINGS[0], torch.float64, (4, 2), backend=backend, seed=7)


MUTANTS = [
    ("causal_off_by_one", lambda: _run_branch_fp64("cpu_flash")),
    ("causal_off_by_one", lambda: _run_branch_fp64("math")),
    ("causal_off_by_one", lambda: _block_errors("cpu_flash", True, None, torch.float64, (4, 2))),
    ("branch_diag_only", _run_branch_fp64),
    ("branch_skip_own", _run_branch_fp64),
    ("own_lse_replay", _run_branch_fp64),
    ("empty_row_lse_zero", _run_branch_fp64),
    ("empty_row_lse_zero", lambda: _ring_errors("cpu_flash", torch.float64)),
    ("empty_row_lse_zero", lambda: _ring_errors("math", torch.float64)),
]


@pytest.mark.parametrize(
    "mutation,run",
    MUTANTS,
    ids=[
        "off-by-one-branch-cpu",
        "off-by-one-branch-math",
        "off-by-one-block",
        "branch-diag-only",
        "branch-skip-own",
        "own-lse-replay",
        "empty-row-lse-0-branch",
        "empty-row-lse-0-ring-cpu",
        "empty-row-lse-0-ring-math",
    ],
)
def test_planted_bug_is_caught(mutation, run, monkeypatch):
    assert max(run().values()) < TOL[torch.float64]  # clean run passes
    plant(mutation, monkeypatch)
    errs = run()
    assert max(errs.values()) > 1e3 * TOL[torch.float64], errs
    if mutation == "own_lse_replay":  # forward untouched, only gradients move
        assert errs["out"] < TOL[torch.float64] and max(errs["dq"], errs["dk"]) > 1e-6, errs


# --------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU): flash varlen in bf16, the math fallback in fp32/fp64
# --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_LENS = [1, 5, 17, 3, 130]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (over finite entries of b); inf if the -inf pattern differs."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)) or a.isnan().any():
        return float("inf")
    keep = torch.isfinite(b)
    return float((a[keep] - b[keep]).norm() / b[keep].norm().clamp_min(1e-30))


@cuda
@pytest.mark.parametrize(
    "heads_per_call", [None, 4, 1], ids=["one-call", "per-kv-head", "split-group"]
)
@pytest.mark.parametrize("k_lens", [None, [4, 0, 9, 6, 200]], ids=["causal", "full-empty-doc"])
def test_cuda_flash_block_matches_dense(k_lens, heads_per_call, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    dev, dt = torch.device("cuda"), torch.bfloat16
    causal = k_lens is None
    cu_q = _cu(CUDA_LENS)
    cu_k = cu_q if causal else _cu(k_lens)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    if heads_per_call is not None:  # force the head-chunked path (8 query heads, 2 kv heads)
        rows = max(tq, tk) + 128 * len(CUDA_LENS)
        monkeypatch.setattr(block_cuda, "_FLASH_MAX_ELEMENTS", heads_per_call * rows * 64)
        assert len(block_cuda._flash_head_chunks(rows, 8, 2, 64)) == 8 // heads_per_call
    q, g = (_randn(tq, 8, 64, dtype=dt, gen=gen).to(dev) for _ in range(2))
    k, v = (_randn(tk, 2, 64, dtype=dt, gen=gen).to(dev) for _ in range(2))
    cq, ck = cu_q.to(dev), cu_k.to(dev)
    out, lse = block_forward(q, k, v, cq, ck, causal=causal, backend="cuda_flash")
    grads = block_backward(g, q, k, v, out, lse, cq, ck, causal=causal, backend="cuda_flash")
    x64 = [x.double().cpu().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_block_attention(*x64, cu_q, cu_k, causal=causal)
    ref_grads = torch.autograd.grad(ref_out, x64, g.double().cpu())
    errs = {"out": _rel_err(out, ref_out), "lse": _rel_err(lse, ref_lse)}
    errs.update({c: _rel_err(a, b) for c, a, b in zip("qkv", grads, ref_grads, strict=True)})
    assert lse.shape == (8, tq) and lse.dtype == torch.float32
    assert max(errs.values()) < 2e-2, errs


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_cuda_branch_matches_dense(dtype):
    gen = torch.Generator().manual_seed(12)
    dev, n = torch.device("cuda"), 3
    cu = _cu(CUDA_LENS)
    t = int(cu[-1])
    q = _randn(n, t, 8, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    k = _randn(n, t, 2, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    v = _randn(n, t, 2, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    g = _randn(n, t, 8, 64, dtype=dtype, gen=gen).to(dev)
    out = branch_attention(q, k, v, cu.to(dev))
    grads = torch.autograd.grad(out, (q, k, v), g)
    x64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref = dense_ttt_attention(*x64, cu)
    ref_grads = torch.autograd.grad(ref, x64, g.double().cpu())
    if dtype == torch.bfloat16:
        errs = {"out": _rel_err(out, ref)}
        errs.update({c: _rel_err(a, b) for c, a, b in zip("qkv", grads, ref_grads, strict=True)})
        assert max(errs.values()) < 2e-2, errs
    else:
        errs = {"out": _max_err(out.cpu(), ref)}
        errs.update(
            {c: _max_err(a.cpu(), b) for c, a, b in zip("qkv", grads, ref_grads, strict=True)}
        )
        assert max(errs.values()) < TOL[dtype], errs


@cuda
@pytest.mark.parametrize("kernel", ["triton", "compile", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_pass_attention_matches_dense(dtype, kernel, monkeypatch):
    """The trainer's per-pass op on CUDA (branch rows as Triton kernels, compiled or eager),
    every pass of a 4-pass TTT step, against the dense fp64 reference on CPU."""
    from codraft.learner.attention.pass_attention import pass_attention

    monkeypatch.setenv("CODRAFT_BRANCH_KERNEL", kernel)
    gen = torch.Generator().manual_seed(13)
    dev, n = torch.device("cuda"), 4
    cu = _cu(CUDA_LENS)
    t = int(cu[-1])
    q = _randn(n, t, 8, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    k = _randn(n, t, 2, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    v = _randn(n, t, 2, 64, dtype=dtype, gen=gen).to(dev).requires_grad_()
    g = _randn(n, t, 8, 64, dtype=dtype, gen=gen).to(dev)
    ks, vs = list(k.unbind(0)), list(v.unbind(0))
    out = torch.stack(
        [pass_attention(q[p], ks[: p + 1], vs[: p + 1], cu.to(dev)) for p in range(n)]
    )
    grads = torch.autograd.grad(out, (q, k, v), g)
    x64 = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref = dense_ttt_attention(*x64, cu)
    ref_grads = torch.autograd.grad(ref, x64, g.double().cpu())
    errs = {"out": _rel_err(out, ref)}
    errs.update({c: _rel_err(a, b) for c, a, b in zip("qkv", grads, ref_grads, strict=True)})
    assert max(errs.values()) < (2e-2 if dtype == torch.bfloat16 else 1e-5), errs
