"""The ring that hands a step's rows to the tap process (codraft.server.device_ring).

On this CPU-only machine the ring is the CPU's: a memfd both sides map, the same bookkeeping,
gather and copy-out as on CUDA, where only the buffer's sharing (CUDA IPC) and the events
differ (those run on the GPU machine: scripts/gpu_vllm/engine_checks.py's capture check, with
the tap process and the ring on by default). The ring through a real engine and tap process:
tests/test_server_engine.py (`rows_via == "device ring"`); the pipe the rows take otherwise:
tests/test_capture_steps.py.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from codraft.server import device_ring
from codraft.server.device_ring import ALIGN, DeviceRing, RingReader, RingSpace
from codraft.server.row_copy import RowCopier


def _drive_space(seed: int, steps: int = 4000) -> list[str]:
    """Random allocations, drops, sends and copies on a small ring; every violation found: two
    live slots whose requested bytes overlap, a slot past the end, more live than allowed, or
    a slot reclaimed before it was done with."""
    rng = random.Random(seed)
    space = RingSpace(64 * ALIGN, max_live=8)
    requested: dict[int, int] = {}  # seq -> bytes asked for
    copied = -1  # the tap process's counter
    sent: list[int] = []  # sent, not yet copied, in order
    last = -1  # the newest slot sent
    wraps = 0  # slots placed at the start while others were live
    bad: list[str] = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.5:
            n = rng.choice([1, ALIGN - 1, ALIGN, 3 * ALIGN + 5, 17 * ALIGN])
            had = len(space.live)
            slot = space.alloc(n)
            if slot is not None:
                requested[slot.seq] = n
                wraps += slot.offset == 0 and had > 0
        elif r < 0.75 and space.live:
            # any slot may be dropped; slots are sent in the order handed out (step order)
            send = rng.random() < 0.5
            open_ = [s for s in space.live if not (s.sent or s.dropped or (send and s.seq < last))]
            if open_:
                slot = rng.choice(open_)
                if send:
                    slot.sent, last = True, slot.seq
                    sent.append(slot.seq)
                else:
                    slot.dropped = True
        elif sent:
            copied = sent.pop(0)
            sent = [s for s in sent if s > copied]
        space.reclaim(copied)
        live = sorted(space.live, key=lambda s: s.offset)
        if len(live) > space.max_live:
            bad.append(f"{len(live)} live slots")
        for s in live:
            if s.offset + requested[s.seq] > space.capacity:
                bad.append(f"slot {s.seq} ends past the ring")
            if s.offset % ALIGN:
                bad.append(f"slot {s.seq} is not aligned")
        for a, b in zip(live, live[1:], strict=False):
            if a.offset + requested[a.seq] > b.offset:
                bad.append(f"slots {a.seq} and {b.seq} overlap")
        gone = set(sent) - {s.seq for s in space.live}
        if gone:
            bad.append(f"slots {sorted(gone)} reclaimed before they were copied")
    if wraps < 10:
        bad.append(f"the ring wrapped only {wraps} times: the drive proves little")
    return bad


def test_slots_never_overlap_and_are_reclaimed_only_when_done() -> None:
    for seed in range(5):
        assert _drive_space(seed) == [], seed


def test_mutation_a_slot_rounded_down_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted from here: slots rounded down to ALIGN instead of up (shorter than asked)."""
    monkeypatch.setattr(device_ring, "aligned", lambda n: max(n // ALIGN, 1) * ALIGN)
    assert any("overlap" in v or "past" in v for s in range(5) for v in _drive_space(s))


def test_a_full_ring_frees_in_order() -> None:
    space = RingSpace(8 * ALIGN, max_live=4)
    a, b = space.alloc(4 * ALIGN), space.alloc(4 * ALIGN)
    assert a.offset == 0 and b.offset == 4 * ALIGN and space.alloc(1) is None
    b.dropped = True  # not the oldest: nothing comes back yet
    space.reclaim(-1)
    assert space.alloc(1) is None
    a.sent = True  # sent: back once the tap process has copied it
    space.reclaim(-1)
    assert space.alloc(1) is None
    space.reclaim(a.seq)
    c = space.alloc(8 * ALIGN)
    assert c is not None and c.offset == 0 and not space.alloc(1)
    with pytest.raises(ValueError, match="multiple of"):
        RingSpace(ALIGN + 1, 4)


def _forward(n: int = 12, h: int = 8, dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    pos = torch.arange(n, dtype=torch.int64) + 40
    taps = [torch.randn(n, h, generator=g, dtype=dtype) for _ in range(3)]
    return ids, pos, taps, torch.randn(n, h, generator=g, dtype=dtype)


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranges", [[(0, 12)], [(1, 4), (6, 11)]])
def test_rows_gathered_into_the_ring_are_the_plain_gather(wire, ranges) -> None:
    ids, pos, taps, hidden = _forward()
    ring = DeviceRing(torch.device("cpu"), 1 << 20)
    wire_info = ring.export()
    ring.opened = True  # what the tap process says once it has opened the ring
    plain = RowCopier(torch.device("cpu"), wire, 1 << 30).copy(ids, pos, taps, hidden, ranges)
    copier = RowCopier(torch.device("cpu"), wire, 1 << 30, ring)
    staged = copier.copy(ids, pos, taps, hidden, ranges)
    assert staged.slot is not None and plain.slot is None
    for name in ("ids", "positions", "taps", "last"):
        got, want = getattr(staged, name), getattr(plain, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    # what the tap process reads back, through its own mapping of the memfd
    reader = RingReader(wire_info, ring.fd)
    width = staged.taps.shape[1] + staged.last.shape[1]
    ints, feats = reader.take(staged.slot.wire(), staged.taps.shape[0], width, wire)
    assert torch.equal(ints[0], plain.ids.long()) and torch.equal(ints[1], plain.positions)
    assert torch.equal(feats, torch.cat([plain.taps, plain.last], dim=-1))


def test_a_full_ring_skips_steps_and_dropped_rows_come_back() -> None:
    ids, pos, taps, hidden = _forward(n=64)
    ring = DeviceRing(torch.device("cpu"), 54 * ALIGN)  # a step is 36 * ALIGN: room for one
    info = ring.export()
    ring.opened = True
    copier = RowCopier(torch.device("cpu"), torch.float32, 1 << 30, ring)
    first = copier.copy(ids, pos, taps, hidden, [(0, 64)])
    second = copier.copy(ids, pos, taps, hidden, [(0, 64)])
    assert first is not None and second is None and copier.steps_skipped == 1
    ring.sent(first.slot)
    del first
    gc.collect()
    assert copier.copy(ids, pos, taps, hidden, [(0, 64)]) is None  # sent, not yet copied
    reader = RingReader(info, ring.fd)
    reader.take(ring.space.live[0].wire(), 64, 32, torch.float32)
    third = copier.copy(ids, pos, taps, hidden, [(0, 64)])
    assert third is not None and copier.steps_skipped == 2
    del third  # never sent (the capture kept none of its rows): back at once
    gc.collect()
    assert copier.copy(ids, pos, taps, hidden, [(0, 64)]) is not None


def test_an_unopened_or_disabled_ring_leaves_the_rows_off_it() -> None:
    ids, pos, taps, hidden = _forward()
    ring = DeviceRing(torch.device("cpu"), 1 << 20)
    copier = RowCopier(torch.device("cpu"), torch.float32, 1 << 30, ring)
    assert copier.copy(ids, pos, taps, hidden, [(0, 12)]).slot is None  # not exported
    ring.export()
    assert copier.copy(ids, pos, taps, hidden, [(0, 12)]).slot is None  # not opened yet
    ring.opened = True
    assert copier.copy(ids, pos, taps, hidden, [(0, 12)]).slot is not None
    ring.disable("the tap process ended", quiet=True)
    assert copier.copy(ids, pos, taps, hidden, [(0, 12)]).slot is None
