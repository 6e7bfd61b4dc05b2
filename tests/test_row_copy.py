"""The row gather (codraft.server.row_copy.RowCopier) against rows picked one by one.

The gather joins adjacent ranges and then copies either one slice or an indexed selection; the
reference here takes every row by its number in plain Python, so both paths, and the join, are
held to the same independent answer."""

from __future__ import annotations

import pytest
import torch

from codraft.server.row_copy import RowCopier, merge_ranges


def _forward(n: int = 20, h: int = 6) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    pos = torch.arange(n, dtype=torch.int64) * 3 + 7
    taps = [torch.randn(n, h, generator=g) for _ in range(3)]
    return ids, pos, taps, torch.randn(n, h, generator=g)


RANGES = [
    [(0, 20)],
    [(0, 4), (4, 8), (8, 12), (12, 20)],  # a batch whose every request is captured
    [(2, 5), (5, 9), (12, 15)],  # adjacent, then a gap
    [(0, 1), (3, 4), (19, 20)],
]


@pytest.mark.parametrize("ranges", RANGES)
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_gathered_rows_are_the_rows_of_the_ranges_in_order(ranges, wire) -> None:
    ids, pos, taps, hidden = _forward()
    rows = RowCopier(torch.device("cpu"), wire, 1 << 30).copy(ids, pos, taps, hidden, ranges)
    picked = [r for s, e in ranges for r in range(s, e)]
    assert rows.ids.tolist() == [int(ids[r]) for r in picked]
    assert rows.ids.dtype == torch.int32
    assert rows.positions.tolist() == [int(pos[r]) for r in picked]
    for i, r in enumerate(picked):
        want_taps = torch.cat([t[r] for t in taps]).to(wire)
        assert torch.equal(rows.taps[i], want_taps), (ranges, r)
        assert torch.equal(rows.last[i], hidden[r].to(wire)), (ranges, r)


def test_adjacent_ranges_are_joined_and_gaps_kept() -> None:
    assert merge_ranges([(0, 4), (4, 8), (8, 12)]) == [(0, 12)]
    assert merge_ranges([(2, 5), (5, 9), (12, 15), (15, 16)]) == [(2, 9), (12, 16)]
    assert merge_ranges([(3, 4)]) == [(3, 4)]
    assert merge_ranges([]) == []


def test_a_join_across_a_gap_is_caught(monkeypatch) -> None:
    """Mutation check: a join that also swallows gaps gives rows the reference does not."""
    import codraft.server.row_copy as row_copy

    def sloppy(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(ranges[0][0], ranges[-1][1])]

    monkeypatch.setattr(row_copy, "merge_ranges", sloppy)
    with pytest.raises(AssertionError):
        test_gathered_rows_are_the_rows_of_the_ranges_in_order(RANGES[2], torch.float32)
