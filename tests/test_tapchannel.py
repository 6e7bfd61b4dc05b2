"""TapChannel alone, in one gloo world of 3 processes: sources on ranks 0 and 1, the receiver on
rank 2 (one spawn, many cases, fresh process groups per case).

Checked: the n-th put of each source meets the n-th get of that source, whatever the timing and
sizes; a source blocks only when its ring is full (and then until the receiver releases a
slot); data lands before `get` asks; timeouts on both sides name stage, slot, put and
microbatch; protocol misuse and schedule drift are errors that say what was expected; a planted
bug (the receiver's read pointer off by one) fails the data check.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest
import torch

SOURCES, RECEIVER = (0, 1), 2
NAMES = {0: "stage 0 (rank 0)", 1: "stage 1 (rank 1)", 2: "stage 2 (rank 2)"}
_ALIVE: list[Any] = []


# ---------------------------------------------------------------------- in the workers
def _channel(rank: int, slots: int = 2, timeout_s: float = 20.0, verify: bool = True, cls=None):
    import torch.distributed as dist

    from codraft.learner.parallel.tapchannel import TapChannel, TapChannelConfig

    data, credit = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])
    ch = (cls or TapChannel)(
        data, credit, SOURCES, RECEIVER, dtype=torch.float32, device="cpu",
        config=TapChannelConfig(slots=slots, timeout_s=timeout_s, verify=verify), names=NAMES,
    )  # fmt: skip
    _ALIVE.append(ch)  # a dropped channel drops its requests in flight: keep every one alive
    return ch


def _payload(src: int, n: int) -> torch.Tensor:
    """Put n of source src: a shape that changes with n, values that name (src, n)."""
    rows = 3 + (n * 5 + src) % 7
    return torch.full((rows, 4), float(src * 1000 + n)) + torch.arange(rows * 4.0).view(rows, 4)


def _case_position(rank: int, n_puts: int = 7, slots: int = 2) -> dict[str, Any]:
    """Source 0 puts slowly, source 1 fast; sizes vary; the receiver takes in its own order."""
    ch = _channel(rank, slots=slots)
    got: list[tuple[int, int, bool]] = []
    if rank in SOURCES:
        for n in range(n_puts):
            if rank == 0:
                time.sleep(0.01)
            ch.put(_payload(rank, n), microbatch=n)
    else:
        for src in SOURCES:
            for n in range(n_puts):
                ch.expect(src, _payload(src, n).shape, n)
        for n in range(n_puts):
            for src in (1, 0) if n % 2 else (0, 1):
                t = ch.get(src, n)
                got.append((src, n, torch.equal(t, _payload(src, n))))
                ch.release(src)
    ch.close()
    return {"got": got, "stats": vars(ch.stats)}


def _case_blocking(rank: int, pause: float = 1.5) -> dict[str, Any]:
    """S = 2: a source's first two puts return before the receiver takes anything, the third
    waits until the receiver released the first. Times are wall clock (one machine)."""
    ch = _channel(rank, slots=2)
    out: dict[str, Any] = {}
    if rank == 0:
        for n in range(3):
            ch.put(_payload(0, n), n)
            out[f"put{n}_done"] = time.time()
        out["blocked_s"] = ch.stats.put_blocked_s
    elif rank == RECEIVER:
        for n in range(3):
            ch.expect(0, _payload(0, n).shape, n)
        time.sleep(pause)
        t0 = time.time()
        ch.get(0, 0)  # landed during the pause
        out["first_get_s"] = time.time() - t0
        out["first_release"] = time.time()
        ch.release(0)
        for n in (1, 2):
            ch.get(0, n)
            ch.release(0)
    ch.close()
    return out


def _case_receiver_timeout(rank: int) -> dict[str, Any]:
    """Source 1 sends put 0 only; the receiver waits for put 1 of it."""
    ch = _channel(rank, timeout_s=1.0)
    try:
        if rank == 1:
            ch.put(_payload(1, 0), 0)
        if rank == RECEIVER:
            for n in range(2):
                ch.expect(1, _payload(1, n).shape, n)
            ch.get(1, 0)
            ch.release(1)
            ch.get(1, 1)
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - the test looks at the error
        return {"error": type(e).__name__, "message": str(e)}


def _case_source_timeout(rank: int) -> dict[str, Any]:
    """The receiver never takes anything: source 0's third put (S = 2) times out."""
    ch = _channel(rank, timeout_s=1.0)
    try:
        if rank == 0:
            for n in range(3):
                ch.put(_payload(0, n), 10 + n)
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e)}


def _case_misuse(rank: int) -> dict[str, Any]:
    """Errors raised before anything is sent: wrong role, no expect, wrong dtype, stray release."""
    ch = _channel(rank)
    errors: dict[str, str] = {}

    def attempt(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"

    attempt("beyond_watchdog", lambda: _channel(rank, timeout_s=1e5))  # gloo's is 30 min
    if rank == RECEIVER:
        attempt("put_on_receiver", lambda: ch.put(torch.zeros(2), 0))
        attempt("get_without_expect", lambda: ch.get(0, 0))
        attempt("release_without_get", lambda: ch.release(0))
        attempt("unknown_source", lambda: ch.expect(2, (2,), 0))
    else:
        attempt("get_on_source", lambda: ch.get(0, 0))
        attempt("wrong_dtype", lambda: ch.put(torch.zeros(2, dtype=torch.float64), 0))
    return errors


def _case_drift(rank: int) -> dict[str, Any]:
    """The source labels its put microbatch 4, the receiver expects microbatch 3: the header
    check names both."""
    ch = _channel(rank, timeout_s=5.0)
    try:
        if rank == 0:
            ch.put(_payload(0, 0), 4)
        if rank == RECEIVER:
            ch.expect(0, _payload(0, 0).shape, 3)
            ch.get(0, 3)
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        return {"error": type(e).__name__, "message": str(e)}


def _case_mutation(rank: int) -> dict[str, Any]:
    """The position check of `_case_position` against a receiver whose read pointer starts one
    slot late (2 puts, 2 slots: the run completes, with the two puts swapped)."""
    from codraft.learner.parallel.tapchannel import TapChannel

    class OffByOne(TapChannel):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            for ring in self._rings.values():
                ring.head = 1

    ch = _channel(rank, verify=False, cls=OffByOne, timeout_s=3.0)
    same: list[bool] = []
    if rank in SOURCES:
        for n in range(2):
            ch.put(_payload(rank, 0) + n, n)  # equal shapes: only the values can tell
    else:
        for src in SOURCES:
            for n in range(2):
                ch.expect(src, _payload(src, 0).shape, n)
        for n in range(2):
            for src in SOURCES:
                same.append(torch.equal(ch.get(src, n), _payload(src, 0) + n))
                ch.release(src)
    ch.close()
    return {"same": same}


CASES = {
    "position": _case_position,
    "position_one_slot": lambda r: _case_position(r, n_puts=5, slots=1),
    "blocking": _case_blocking,
    "misuse": _case_misuse,
    "mutation": _case_mutation,
    "drift": _case_drift,
    "receiver_timeout": _case_receiver_timeout,
    "source_timeout": _case_source_timeout,
}


def channel_cases(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for name, case in CASES.items():
        try:
            results[name] = case(rank)
        except Exception:  # noqa: BLE001
            results[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    return results


# ---------------------------------------------------------------------- in pytest
@pytest.fixture(scope="module")
def world3() -> list[dict[str, Any]]:
    from codraft.learner.parallel.spawn import run_world

    return run_world(channel_cases, 3, timeout_s=120)


def _get(world3: list[dict[str, Any]], case: str, rank: int) -> Any:
    r = world3[rank][case]
    if isinstance(r, dict) and "crash" in r:
        pytest.fail(f"rank {rank}: {r['crash']}")
    return r


@pytest.mark.parametrize("case", ["position", "position_one_slot"])
def test_nth_put_meets_nth_get(world3: list[dict[str, Any]], case: str) -> None:
    for rank in range(3):
        _get(world3, case, rank)
    got = _get(world3, case, RECEIVER)["got"]
    n_puts = 7 if case == "position" else 5
    assert len(got) == 2 * n_puts
    assert all(ok for _, _, ok in got), [g for g in got if not g[2]]


def test_source_blocks_only_when_the_ring_is_full(world3: list[dict[str, Any]]) -> None:
    src, rcv = _get(world3, "blocking", 0), _get(world3, "blocking", RECEIVER)
    assert src["put1_done"] < rcv["first_release"], "a put within the ring waited for the receiver"
    assert src["put2_done"] >= rcv["first_release"], "put #2 did not wait for a free slot"
    assert src["blocked_s"] > 0.5
    assert rcv["first_get_s"] < 0.5, "put #0 had not landed while the receiver was busy"


def test_receiver_timeout_names_source_slot_and_microbatch(world3) -> None:
    r = _get(world3, "receiver_timeout", RECEIVER)
    assert r.get("error") == "TapChannelTimeout", r
    for part in ("stage 2 (rank 2)", "source stage 1 (rank 1)", "landing slot 1 of 2", "put #1"):
        assert part in r["message"], f"{part!r} missing from: {r['message']}"
    assert "microbatch 1" in r["message"]


def test_source_timeout_names_receiver_slot_and_microbatch(world3) -> None:
    r = _get(world3, "source_timeout", 0)
    assert r.get("error") == "TapChannelTimeout", r
    msg = r["message"]
    for part in ("source stage 0 (rank 0)", "landing slot 0 of 2", "stage 2 (rank 2)"):
        assert part in msg, f"{part!r} missing from: {msg}"
    assert "put #2" in msg and "put #0 (microbatch 10)" in msg, msg


def test_misuse_is_an_error_that_says_what_was_expected(world3) -> None:
    rcv, src = _get(world3, "misuse", RECEIVER), _get(world3, "misuse", 0)
    assert "is not a source" in rcv["put_on_receiver"]
    assert "call expect" in rcv["get_without_expect"]
    assert "without a get" in rcv["release_without_get"]
    assert "is not a source of this TapChannel" in rcv["unknown_source"]
    assert "is not the receiver" in src["get_on_source"]
    assert "torch.float32" in src["wrong_dtype"] and "torch.float64" in src["wrong_dtype"]
    assert "collective watchdog" in src["beyond_watchdog"]


def test_schedule_drift_is_caught_by_the_header(world3) -> None:
    r = _get(world3, "drift", RECEIVER)
    assert r.get("error") == "TapChannelError", r
    assert "for microbatch 3" in r["message"] and "for microbatch 4" in r["message"], r


def test_planted_read_pointer_bug_fails_the_data_check(world3) -> None:
    same = _get(world3, "mutation", RECEIVER)["same"]
    assert len(same) == 4 and not any(same), same
