"""Packing samples into THD batches: padding, cu_seqlens, positions, masks, budget."""

from __future__ import annotations

import pytest
import torch

from codraft.learner.data import PackedBatch, Packer, Sample, pack, pack_stream, padded_len, unpack
from codraft.tap import TapMessage

H, NT = 4, 3


def sample(n: int, seed: int = 0, prompt: int = 2, features: bool = True, cursor=None) -> Sample:
    g = torch.Generator().manual_seed(seed)
    return Sample(
        token_ids=torch.randint(1, 50, (n,), generator=g),
        loss_mask=(torch.arange(n) >= prompt).to(torch.uint8),
        taps=torch.randn(n, NT * H, generator=g) if features else None,
        last_hidden=torch.randn(n, H, generator=g) if features else None,
        request_id=f"r{seed}",
        cursor=cursor,
    )


def test_pack_layout_with_padding() -> None:
    samples = [sample(5, 0), sample(8, 1), sample(1, 2, prompt=0)]
    b = pack(samples, pad_multiple=4)
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 8, 16, 20]
    assert b.doc_lens.tolist() == [5, 8, 1]
    assert b.num_tokens == 20 and b.num_docs == 3 and b.max_seqlen == 8
    assert b.positions.tolist() == list(range(8)) + list(range(8)) + list(range(4))
    assert b.input_ids.dtype == torch.int64 and b.loss_mask.dtype == torch.uint8
    valid = b.valid
    assert valid.tolist() == [1] * 5 + [0] * 3 + [1] * 8 + [1] + [0] * 3
    for name in ("input_ids", "loss_mask", "taps", "last_hidden"):
        t = getattr(b, name)
        assert not t[~valid].any(), f"{name} must be zero on padding"
    for s, ids, taps, mask in zip(
        samples, unpack(b, b.input_ids), unpack(b, b.taps), unpack(b, b.loss_mask), strict=True
    ):
        assert torch.equal(ids, s.token_ids) and torch.equal(taps, s.taps)
        assert torch.equal(mask, s.loss_mask)
    assert b.request_ids == ["r0", "r1", "r2"]
    # every document is a multiple of pad_multiple (CP zigzag needs 2*CP equal chunks)
    assert all(n % 4 == 0 for n in b.padded_lens.tolist())


def test_pack_without_padding_and_ids_only() -> None:
    b = pack([sample(3, features=False), sample(2, features=False)])
    assert b.cu_seqlens.tolist() == [0, 3, 5] and b.taps is None and b.last_hidden is None
    assert b.positions.tolist() == [0, 1, 2, 0, 1]


def test_pack_refuses_over_budget_and_mixed_kinds() -> None:
    with pytest.raises(ValueError, match="over the budget"):
        pack([sample(5), sample(5)], token_budget=12, pad_multiple=4)
    with pytest.raises(ValueError, match="different kinds"):
        pack([sample(5), sample(5, features=False)])
    with pytest.raises(ValueError, match="at least one"):
        pack([])


def test_packer_respects_budget_and_keeps_order() -> None:
    lens = [3, 7, 2, 9, 4, 4, 1, 6, 5, 8]
    samples = [sample(n, i, prompt=0, cursor={"i": i}) for i, n in enumerate(lens)]
    batches = list(pack_stream(samples, token_budget=16, pad_multiple=2))
    order = [rid for b in batches for rid in b.request_ids]
    assert order == [f"r{i}" for i in range(len(lens))]
    for b in batches:
        assert b.num_tokens <= 16
        assert all(n % 2 == 0 for n in b.padded_lens.tolist())
    # greedy: adding the next batch's first document would have overflowed
    for b, nxt in zip(batches, batches[1:], strict=False):
        assert b.num_tokens + padded_len(int(nxt.doc_lens[0]), 2) > 16
    # the cursor of a batch is its last document's: resuming there repeats nothing
    assert [b.cursor["i"] for b in batches][-1] == len(lens) - 1
    assert all(b.cursor["i"] == int(b.request_ids[-1][1:]) for b in batches)


def test_packer_truncates_long_documents_and_drops_empty_ones() -> None:
    p = Packer(10, pad_multiple=4)
    assert p.add(sample(23, prompt=3)) == []
    assert p.stats.truncated == 1
    assert p.add(sample(4, prompt=4)) == []  # nothing to learn on: dropped
    assert p.stats.dropped_empty == 1
    (b,) = p.add(sample(2, prompt=0))  # 8 (truncated from 23) + 4 > 10: the first batch goes
    assert b.doc_lens.tolist() == [8] and b.num_tokens == 8
    last = p.flush()
    assert last.doc_lens.tolist() == [2] and last.num_tokens == 4
    assert p.flush() is None
    assert p.stats.batches == 2 and p.stats.tokens == 10 and p.stats.pad_tokens == 2


def test_packer_closes_batch_on_kind_change_and_max_docs() -> None:
    p = Packer(100, max_docs=2)
    out = []
    for s in [sample(3), sample(3, features=False), sample(3, features=False)]:
        out += p.add(s)
    out += p.add(sample(3, features=False))
    out.append(p.flush())
    assert [b.num_docs for b in out] == [1, 2, 1]
    assert out[0].taps is not None and out[1].taps is None


def test_budget_must_hold_one_padded_document() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        Packer(3, pad_multiple=4)


def test_sample_from_tap_and_validation() -> None:
    msg = TapMessage.build(
        torch.arange(6),
        taps=torch.randn(6, 2 * H),
        last_hidden=torch.randn(6, H),
        tap_layers=(1, 2),
        prompt_len=2,
        request_id="abc",
    )
    s = Sample.from_tap(msg, cursor={"file_index": 0, "record_index": 1})
    assert s.request_id == "abc" and s.loss_mask.tolist() == [0, 0, 1, 1, 1, 1]
    b = pack([s], pad_multiple=8)
    assert isinstance(b, PackedBatch) and b.taps.shape == (8, 2 * H)
    with pytest.raises(ValueError, match="taps must be"):
        Sample(torch.arange(3), taps=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="token_ids"):
        Sample(torch.zeros(3))
    assert Sample(torch.arange(3)).loss_mask.tolist() == [1, 1, 1]


def test_batch_to_device_keeps_everything() -> None:
    b = pack([sample(3)], pad_multiple=2)
    c = b.to("cpu")
    assert torch.equal(c.cu_seqlens, b.cu_seqlens) and c.request_ids == b.request_ids
