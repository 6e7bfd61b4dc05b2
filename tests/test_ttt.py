"""The TTT loss (codraft.learner.ttt) against an independent dense fp64 implementation.

The reference below rolls ids per document with Python loops, builds an explicit mask over all
passes' keys for every pass, and computes the soft (or hard) cross-entropy anchor by anchor. It
shares with the code under test only the draft's step pieces (fuse/qkv/finish/logits), which
tests/test_draft.py checks against a longhand reference of its own.
"""

from __future__ import annotations

import pytest
import torch
from planted_bugs import plant

from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.draft.vocab import build_draft_vocab
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.ttt import TTTConfig, doc_ends, roll_left, ttt_forward

V, H, NDRAFT = 96, 64, 40


def _draft(dtype: torch.dtype, seed: int = 0) -> Eagle3Draft:
    cfg = DraftConfig(
        hidden_size=H,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        draft_vocab_size=NDRAFT,
        target_hidden_size=H,
        tap_layers=(1, 2, 3),
        max_position_embeddings=512,
        dtype="float32",
    )
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    counts = torch.randint(0, 100, (V,), generator=g)
    model.set_vocab(*build_draft_vocab(counts, NDRAFT))
    model.set_embedding(torch.randn(V, H, generator=g))
    return model.to(dtype)


def _batch(lengths: list[int], dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = torch.randint(0, V, (n,), generator=g)
    positions = torch.cat([torch.arange(L) for L in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    taps = torch.randn(n, 3 * H, generator=g, dtype=torch.float64).to(dtype)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.uint8)
    teacher_logits = torch.randn(n, NDRAFT, generator=g, dtype=torch.float64) * 2
    return ids, positions, cu, taps, mask, teacher_logits


def _dense_attn(q, ks, vs, cu):
    """Explicit [T, d*T] mask: trunk causal within documents + own-anchor branch diagonal."""
    n, hq, dim = q.shape
    d = len(ks)
    doc = torch.zeros(n, dtype=torch.long)
    for j in range(len(cu) - 1):
        doc[int(cu[j]) : int(cu[j + 1])] = j
    i = torch.arange(n)
    trunk = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    eye = torch.eye(n, dtype=torch.bool)
    mask = torch.cat([trunk] + [eye] * (d - 1), dim=1)  # [T, d*T]
    k = torch.cat(list(ks), 0)
    v = torch.cat(list(vs), 0)
    rep = hq // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,shd->hts", q, k) / dim**0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), v)


def _reference_loss(draft, ids, positions, cu, taps, mask, logits, K, weights, hard=False):
    n = ids.shape[0]
    docs = [(int(cu[j]), int(cu[j + 1])) for j in range(len(cu) - 1)]
    end = torch.empty(n, dtype=torch.long)
    for a, b in docs:
        end[a:b] = b
    t2d = draft.t2d
    target_ids = draft.draft_to_target_ids().tolist()
    probs = torch.softmax(logits.double(), -1)  # the teacher's, whole, in fp64
    h = draft.fuse(taps)
    ks, vs, total = [], [], 0.0
    for d in range(1, K + 1):
        ids_d = torch.tensor([int(ids[i + d]) if i + d < end[i] else 0 for i in range(n)])
        q, k, v, res = draft.qkv(draft.embed(ids_d), h, positions + d - 1)
        ks.append(k)
        vs.append(v)
        h = draft.finish(_dense_attn(q, ks, vs, cu), res)
        logp = torch.log_softmax(draft.logits(h).double(), -1)
        ce, count = 0.0, 0
        for i in range(n):
            j = i + d
            if j >= end[i] or not mask[j]:
                continue
            if hard:
                if j + 1 >= end[i] or not t2d[ids[j + 1]]:
                    continue
                ce = ce - logp[i, target_ids.index(int(ids[j + 1]))]
            else:
                ce = ce - (probs[j] * logp[i]).sum()
            count += 1
        total = total + weights[d - 1] * ce / max(count, 1)
    return total


CASES = [([7], 1), ([5, 1, 9, 3], 2), ([1, 2, 13, 4], 3), ([6, 10, 2], 4)]


@pytest.mark.parametrize("lengths,K", CASES)
@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_ttt_loss_and_grads_match_dense_fp64(
    lengths: list[int], K: int, hard: bool, recompute: bool
) -> None:
    draft = _draft(torch.float64)
    ids, positions, cu, taps, mask, logits = _batch(lengths, torch.float64)
    taps.requires_grad_(True)
    cfg = TTTConfig(num_passes=K, loss_chunk_tokens=3, recompute_mlp=recompute)
    teacher = None if hard else logits
    got = ttt_forward(draft, ids, positions, cu, taps, mask, pass_attention, cfg, teacher)
    params = [p for p in draft.parameters()] + [taps]
    g_got = torch.autograd.grad(got.loss, params)
    want = _reference_loss(draft, ids, positions, cu, taps, mask, logits, K, cfg.weights, hard)
    g_want = torch.autograd.grad(want, params)
    assert abs(got.loss.item() - want.item()) < 1e-10
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_ttt_fp32_close_to_fp64() -> None:
    lengths, K = [5, 1, 9, 3], 3
    d64, d32 = _draft(torch.float64), _draft(torch.float32)
    b64 = _batch(lengths, torch.float64)
    b32 = _batch(lengths, torch.float32)
    cfg = TTTConfig(num_passes=K)
    l64 = ttt_forward(d64, *b64[:5], pass_attention, cfg, b64[5].double()).loss
    l32 = ttt_forward(d32, *b32[:5], pass_attention, cfg, b32[5]).loss
    g64 = torch.autograd.grad(l64, list(d64.parameters()))
    g32 = torch.autograd.grad(l32, list(d32.parameters()))
    assert abs(l64.item() - l32.item()) < 1e-4
    for a, b in zip(g32, g64, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-4)


def test_ttt_under_bf16_autocast_close_to_fp32() -> None:
    """The trainer's GPU setting (bf16 autocast, fp32 master weights), run on CPU: the draft's
    q/k/v must leave qkv in one dtype, and the loss stays near the fp32 loss."""
    lengths, K = [5, 1, 9, 3], 3
    d32 = _draft(torch.float32)
    b32 = _batch(lengths, torch.float32)
    cfg = TTTConfig(num_passes=K)
    want = ttt_forward(d32, *b32[:5], pass_attention, cfg, b32[5]).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v, _ = d32.qkv(d32.embed(b32[0]), b32[3][..., : d32.config.hidden_size], b32[1])
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        got = ttt_forward(d32, *b32[:5], pass_attention, cfg, b32[5]).loss
    got.backward()
    assert abs(got.item() - want.item()) < 0.05 * abs(want.item())
    assert all(
        p.grad is not None and p.grad.isfinite().all() for p in d32.parameters() if p.requires_grad
    )


def test_roll_left_stays_inside_documents() -> None:
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    x = torch.arange(8)
    ends = doc_ends(cu, 8)
    assert roll_left(x, 1, ends, fill=-1).tolist() == [1, 2, -1, -1, 5, 6, 7, -1]
    assert roll_left(x, 2, ends, fill=-1).tolist() == [2, -1, -1, -1, 6, 7, -1, -1]


def test_counts_are_normalised_globally() -> None:
    draft = _draft(torch.float64)
    batch = _batch([6, 4], torch.float64)
    cfg = TTTConfig(num_passes=2)
    local = ttt_forward(draft, *batch[:5], pass_attention, cfg, batch[5].double())
    doubled = ttt_forward(
        draft, *batch[:5], pass_attention, cfg, batch[5].double(), reduce_counts=lambda c: 2 * c
    )
    assert abs(doubled.loss.item() - local.loss.item() / 2) < 1e-12


@pytest.mark.parametrize("bug", ["off_by_one_roll", "wrong_position", "detached_hidden"])
def test_mutations_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bugs in the TTT loop must make the dense comparison fail."""
    import codraft.learner.ttt as ttt

    lengths, K = [5, 1, 9, 3], 3
    draft = _draft(torch.float64)
    ids, positions, cu, taps, mask, logits = _batch(lengths, torch.float64)
    cfg = TTTConfig(num_passes=K)
    if bug == "off_by_one_roll":
        real = ttt.roll_left
        monkeypatch.setattr(ttt, "roll_left", lambda x, s, e, fill=0: real(x, s + 1, e, fill))
    elif bug == "wrong_position":  # every pass at the trunk's positions (offset d-1 forgotten)
        real_qkv = draft.qkv
        calls = iter(range(K))
        monkeypatch.setattr(draft, "qkv", lambda e, h, p: real_qkv(e, h, p - next(calls)))
    else:
        real_finish = draft.finish
        monkeypatch.setattr(draft, "finish", lambda a, r: real_finish(a, r).detach() + 0 * r)
    got = ttt_forward(draft, ids, positions, cu, taps, mask, pass_attention, cfg, logits)
    monkeypatch.undo()
    want = _reference_loss(draft, ids, positions, cu, taps, mask, logits, K, cfg.weights)
    params = list(draft.parameters())
    g_got = torch.autograd.grad(got.loss, params, allow_unused=True)
    g_want = torch.autograd.grad(want, params)
    loss_diff = abs(got.loss.item() - want.item())
    grad_diff = max(
        (a - b).abs().max().item() if a is not None else b.abs().max().item()
        for a, b in zip(g_got, g_want, strict=True)
    )
    assert max(loss_diff, grad_diff) > 1e-6, f"planted bug {bug} went unnoticed"


def _pass_inputs(lengths: list[int], passes: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(n, 4, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    ks = [
        torch.randn(n, 2, 16, generator=g, dtype=torch.float64).requires_grad_(True)
        for _ in range(passes)
    ]
    vs = [
        torch.randn(n, 2, 16, generator=g, dtype=torch.float64).requires_grad_(True)
        for _ in range(passes)
    ]
    return q, ks, vs, cu


def _pass_errors(lengths: list[int], passes: int) -> float:
    q, ks, vs, cu = _pass_inputs(lengths, passes)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    leaves = [q, *ks, *vs]
    got = pass_attention(q, ks, vs, cu)
    g_got = torch.autograd.grad(got, leaves, dout)
    want = _dense_attn(q, ks, vs, cu)
    g_want = torch.autograd.grad(want, leaves, dout)
    errs = [(got - want).abs().max().item()]
    errs += [(a - b).abs().max().item() for a, b in zip(g_got, g_want, strict=True)]
    return max(errs)


@pytest.mark.parametrize("passes", [1, 2, 3, 4])
def test_pass_attention_matches_dense_fp64(passes: int) -> None:
    assert _pass_errors([1, 5, 17, 3], passes) < 1e-10


@pytest.mark.parametrize("bug", ["causal_off_by_one", "own_lse_replay", "branch_wrong_pass"])
def test_pass_attention_mutations_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import codraft.learner.attention.block as block
    import codraft.learner.attention.pass_attention as pa

    if bug == "causal_off_by_one":
        plant("causal_off_by_one", monkeypatch)
    elif bug == "own_lse_replay":  # merge "outside": each block replayed with its own out/lse
        real = pa.block_backward

        def own(dout, q, k, v, out, lse, cu_q, cu_k, **kw):
            o, lse_own = block.block_forward(
                q, k, v, cu_q, cu_k, causal=kw["causal"], scale=kw["scale"]
            )
            return real(dout, q, k, v, o, lse_own, cu_q, cu_k, **kw)

        monkeypatch.setattr(pa, "block_backward", own)
    else:  # the branch reads passes 0..d-2 instead of 1..d-1
        monkeypatch.setattr(pa, "_branch_keys", lambda ks, vs: (list(ks[:-1]), list(vs[:-1])))
    assert _pass_errors([1, 5, 17, 3], 3) > 1e-6, f"planted bug {bug} went unnoticed"
