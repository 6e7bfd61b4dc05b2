"""The Triton branch kernels (codraft.learner.attention.branch_triton), run on CPU by Triton's
interpreter, against the fp64 torch rows of codraft.learner.attention.ring_branch and, through
pass_attention, against the dense fp64 reference. Planted bugs must break the comparison.

Triton reads TRITON_INTERPRET=1 when it is first imported, so these cases run in a fresh process
(tests/test_branch_triton.py starts it); on a GPU, tests/test_branch_attention.py runs the
compiled kernels."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_branch_triton.py (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from codraft.learner.attention import branch_triton, branch_triton_kernels  # noqa: E402
from codraft.learner.attention.reference import dense_ttt_attention  # noqa: E402
from codraft.learner.attention.ring_branch import grad_rows, merge_rows  # noqa: E402

TOL = 2e-5  # fp32 kernels against fp64 rows


def _case(t, hq, hkv, d, nb, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)

    q, oa = r(t, hq, d), r(t, hq, d)
    lse_a = r(hq, t).transpose(0, 1)  # the flash layout [Hq, T], seen token-major
    oa[1], lse_a[1] = 0.0, float("-inf")  # a row whose trunk is empty
    kb = [r(t, hkv, d) for _ in range(nb)]
    vb = [r(t, hkv, d) for _ in range(nb)]
    return q, oa, lse_a, kb, vb, r(t, hq, d), r(t, hq, d)


def _errs(t, hq, hkv, d, nb, seed=0):
    """Max abs errors of (out, lse, dq, dk, dv) against the fp64 rows."""
    q, oa, la, kb, vb, dout, dq0 = _case(t, hq, hkv, d, nb, seed)
    scale = d**-0.5
    out, lse = branch_triton.merge(oa, la, q, kb, vb, scale)
    d64 = [x.double() for x in (oa, la, q)]
    kb64, vb64 = [k.double() for k in kb], [v.double() for v in vb]
    ro, rl = merge_rows(*d64, kb64, vb64, scale)
    dq = dq0.clone()
    dks, dvs = branch_triton.grad(dq, dout, q, kb, vb, out, lse, scale)
    rdq, rdk, rdv = grad_rows(dq0.double(), dout.double(), q.double(), kb64, vb64, ro, rl, scale)

    def e(a, b):
        return float((a.double() - b).abs().max())

    return {
        "out": e(out, ro),
        "lse": e(lse, rl),
        "dq": e(dq, rdq),
        "dk": max(e(a, b) for a, b in zip(dks, rdk, strict=True)),
        "dv": max(e(a, b) for a, b in zip(dvs, rdv, strict=True)),
    }


@pytest.mark.parametrize(
    "t,hq,hkv,d,nb",
    [(37, 6, 2, 24, 3), (9, 4, 4, 16, 1), (20, 8, 2, 32, 7), (5, 3, 1, 8, 2)],
    ids=["gqa3-d24-nb3", "mha-nb1", "gqa4-nb7", "gqa3-one-kv-head"],
)
def test_kernels_match_fp64_rows(t, hq, hkv, d, nb):
    errs = _errs(t, hq, hkv, d, nb)
    assert max(errs.values()) < TOL, errs


def test_merge_in_place_matches_out_of_place():
    """The context-parallel ring merges into its fp32 accumulators in place."""
    q, oa, la, kb, vb, _, _ = _case(13, 4, 2, 16, 2)
    acc_out, acc_lse = oa.clone(), la.contiguous().clone()
    ref_out, ref_lse = branch_triton.merge(oa, la, q, kb, vb, 0.25)
    branch_triton.merge(acc_out, acc_lse, q, kb, vb, 0.25, out=acc_out, lse=acc_lse)
    assert torch.equal(acc_out, ref_out) and torch.equal(acc_lse, ref_lse)


def test_rejects_mixed_layouts():
    q, oa, la, kb, vb, _, _ = _case(8, 4, 2, 16, 2)
    kb[1] = kb[1].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="one layout"):
        branch_triton.merge(oa, la, q, kb, vb, 0.25)


# Planted bugs: (kernel, a line of it as written, the same line with the bug).
MUTANTS = {
    "dropped-lse-grad": (  # delta = 0: the gradient through the lse is lost
        "grad_kernel",
        "delta = tl.sum(do * o, axis=2)",
        "delta = tl.sum(do * o, axis=2) * 0.0",
    ),
    "no-rescale": (  # the running sum is merged without rescaling
        "merge_kernel",
        "alpha = tl.exp(m - m_new)",
        "alpha = tl.exp(m - m_new) * 0.0 + 1.0",
    ),
}


def _mutant_kernels(directory: Path, line: str, bugged: str):
    """A copy of codraft.learner.attention.branch_triton_kernels with one line changed, imported
    from a file of its own (Triton's jit reads a kernel's source from its file)."""
    src = Path(branch_triton_kernels.__file__).read_text()
    assert src.count(line) == 1, f"the kernels no longer hold {line!r}: update MUTANTS"
    path = directory / "mutant_branch_triton_kernels.py"
    path.write_text(src.replace(line, bugged))
    spec = importlib.util.spec_from_file_location("mutant_branch_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bug", list(MUTANTS))
def test_planted_bug_is_caught(bug, monkeypatch, tmp_path):
    kernel, line, bugged = MUTANTS[bug]
    mutant = _mutant_kernels(tmp_path, line, bugged)
    monkeypatch.setattr(branch_triton_kernels, kernel, getattr(mutant, kernel))
    errs = _errs(37, 6, 2, 24, 3)
    assert max(errs.values()) > 100 * TOL, errs


def test_pass_attention_with_triton_rows_matches_dense(monkeypatch):
    """The trainer's per-pass op with the branch rows forced onto the Triton kernels (CPU trunk
    flash + interpreted branch), every pass of a 3-pass step, against the dense fp64 reference."""
    from codraft.learner.attention.pass_attention import pass_attention

    monkeypatch.setenv("CODRAFT_BRANCH_KERNEL", "triton")
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 3, 10, 16], dtype=torch.int32)
    n, t = 3, 16
    q, k, v = (
        torch.randn(n, t, h, 16, generator=gen, dtype=torch.float64).float().requires_grad_()
        for h in (4, 2, 2)
    )
    g = torch.randn(n, t, 4, 16, generator=gen)
    ks, vs = list(k.unbind(0)), list(v.unbind(0))
    out = torch.stack([pass_attention(q[p], ks[: p + 1], vs[: p + 1], cu) for p in range(n)])
    grads = torch.autograd.grad(out, (q, k, v), g)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = dense_ttt_attention(*x64, cu)
    ref_grads = torch.autograd.grad(ref, x64, g.double())
    errs = {"out": float((out.double() - ref).abs().max())}
    for c, a, b in zip("qkv", grads, ref_grads, strict=True):
        errs[c] = float((a.double() - b).abs().max())
    assert max(errs.values()) < 1e-4, errs
