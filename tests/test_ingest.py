"""The learner's ingest over a real ZeroMQ PUSH -> PULL pair on 127.0.0.1, and the buffer policy.

Malformed messages (fuzzed bytes, wrong schema, wrong fingerprint, oversized, wrong frame count)
must never stop the learner, and every one must be counted."""

from __future__ import annotations

import logging
import random
import time
import zlib
from collections import Counter

import msgpack
import pytest
import torch
import zmq

from codraft.learner.data.packing import Sample
from codraft.learner.online.buffer import BufferPolicy, SampleBuffer, is_holdout
from codraft.learner.online.ingest import TapIngest
from codraft.tap import TapExpectation, TapLimits, TapMessage, TapRejected, decode, encode
from codraft.tap.fuzz import malformed

H, TAPS, FP = 16, (1, 2, 3), "llama-0123456789abcdef"


def _msg(i: int, n: int = 12, fp: str = FP, policy: int = 0) -> TapMessage:
    g = torch.Generator().manual_seed(i)
    return TapMessage.build(
        torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
        taps=torch.randn(n, 3 * H, generator=g),
        last_hidden=torch.randn(n, H, generator=g),
        tap_layers=TAPS,
        prompt_len=3,
        request_id=f"req-{i}",
        fingerprint=fp,
        policy_version=policy,
    )


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError("timed out waiting for the ingest thread")
        time.sleep(0.02)


@pytest.fixture
def ingest():
    buf = SampleBuffer(BufferPolicy(holdout_fraction=0.0))
    expect = TapExpectation(fingerprint=FP, tap_layers=TAPS, hidden_size=H, vocab_size=100)
    ing = TapIngest(
        "tcp://127.0.0.1:*", buf, expect, limits=TapLimits(max_tokens=64, max_message_bytes=1 << 16)
    ).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(ing.bound)
    yield ing, buf, push
    push.close(linger=0)
    ing.stop()


def test_valid_messages_are_buffered(ingest) -> None:
    ing, buf, push = ingest
    for i in range(5):
        push.send_multipart(encode(_msg(i)), copy=False)
    _wait(lambda: ing.stats.accepted == 5)
    assert len(buf) == 5 and ing.stats.rejected_total == 0


def test_malformed_messages_are_counted_and_never_fatal(ingest) -> None:
    ing, buf, push = ingest
    rng = random.Random(0)
    sent_bad = 0
    good = [bytes(f) for f in encode(_msg(0))]
    for _ in range(200):  # fuzzed frames
        frames = list(good)
        j = rng.randrange(len(frames))
        b = bytearray(frames[j])
        if b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        frames[j] = bytes(b)
        push.send_multipart(frames)
        sent_bad += 1
    push.send_multipart([b"codraft.tap.v1", b"x"])  # wrong frame count
    header = msgpack.unpackb(good[1][:-4])
    header["schema"] = 99  # a future schema, with a valid header checksum
    packed = msgpack.packb(header)
    push.send_multipart([good[0], packed + zlib.crc32(packed).to_bytes(4, "little"), *good[2:]])
    push.send_multipart(encode(_msg(1, fp="qwen2-ffffffffffffffff")))  # another target
    push.send_multipart(encode(_msg(2, n=200)))  # over max_tokens
    sent_bad += 4
    for i in range(3):  # the learner still works afterwards
        push.send_multipart(encode(_msg(100 + i)))
    _wait(lambda: ing.stats.accepted + ing.stats.rejected_total >= sent_bad + 3)
    st = ing.stats
    assert st.rejected_total == sent_bad, dict(st.rejected)
    assert st.accepted == 3 and len(buf) == 3
    assert {"frames", "schema", "fingerprint", "size"} <= set(st.rejected)
    assert ing._thread.is_alive()


def test_a_schema_1_server_is_refused_and_told_why(ingest, caplog) -> None:
    """A server of schema 1 streams its last hidden state before the final norm: every message is
    refused under "schema" and the log says the taps are pre-norm and must be re-recorded."""
    ing, buf, _ = ingest
    good = [bytes(f) for f in encode(_msg(0))]
    header = msgpack.unpackb(good[1][:-4])
    header["schema"] = 1
    packed = msgpack.packb(header)
    old = [good[0], packed + zlib.crc32(packed).to_bytes(4, "little"), *good[2:]]
    with caplog.at_level(logging.WARNING, logger="codraft.learn.ingest"):
        assert ing.handle(old) is False
    assert ing.stats.rejected == {"schema": 1} and ing.stats.accepted == 0 and len(buf) == 0
    assert "pre-norm" in caplog.text and "re-recorded" in caplog.text
    assert ing.handle(good) is True  # the current schema is still taken


def test_buffer_policy_size_age_policy_window() -> None:
    buf = SampleBuffer(BufferPolicy(max_samples=3, max_age_s=10, holdout_fraction=0.0))
    s = [Sample.from_tap(_msg(i)) for i in range(5)]
    for i, x in enumerate(s):
        buf.add(x, policy_version=0, now=1000.0 + i)
    assert len(buf) == 3 and buf.stats.evicted["size"] == 2
    assert buf.newest_policy == 0
    buf.add(Sample.from_tap(_msg(9)), policy_version=1, now=1005.0)  # new policy
    assert len(buf) == 1 and buf.stats.evicted["policy"] == 3
    assert buf.newest_policy == 1  # what the next published draft records as its policy
    buf.add(Sample.from_tap(_msg(10)), policy_version=1, now=1020.0)
    assert len(buf) == 1 and buf.stats.evicted["age"] == 1
    drawn = buf.draw(token_budget=100, now=1021.0)
    assert len(drawn) == 1


def test_holdout_split_is_deterministic_under_a_key_and_secret_without_it() -> None:
    ids = [f"req-{i}" for i in range(2000)]
    held = [i for i in ids if is_holdout(i, 0.1, b"k" * 32)]
    assert 120 < len(held) < 280
    assert held == [i for i in ids if is_holdout(i, 0.1, b"k" * 32)]
    other = [i for i in ids if is_holdout(i, 0.1, b"j" * 32)]
    assert len(set(held) & set(other)) < len(held) // 2  # another key, another split
    # two buffers (two learners) draw their own keys: a sender cannot pick the held-out side
    a, b = SampleBuffer(BufferPolicy()), SampleBuffer(BufferPolicy())
    assert [i for i in ids if a.is_holdout(i)] != [i for i in ids if b.is_holdout(i)]
    fixed = SampleBuffer(BufferPolicy(holdout_key=b"k" * 32))
    assert [i for i in ids if fixed.is_holdout(i)] == held


def test_the_buffer_is_bounded_in_bytes() -> None:
    one = Sample.from_tap(_msg(0))
    size = sum(t.numel() * t.element_size() for t in (one.token_ids, one.loss_mask, one.taps,
                                                      one.last_hidden))  # fmt: skip
    buf = SampleBuffer(BufferPolicy(max_bytes=3 * size + 10, holdout_fraction=0.0))
    for i in range(5):
        buf.add(Sample.from_tap(_msg(i)), now=1000.0)
    assert len(buf) == 3 and buf.nbytes == 3 * size and buf.stats.evicted["bytes"] == 2
    assert [s.request_id for s in buf.all_samples()] == ["req-2", "req-3", "req-4"]
    held = SampleBuffer(BufferPolicy(max_bytes=2 * size, holdout_fraction=1.0))
    for i in range(4):
        held.add(Sample.from_tap(_msg(i)), now=1000.0)
    assert len(held.holdout()) == 2 and held.nbytes == 2 * size  # held-out samples count too


# ------------------------------------------------------------------------------ fuzzed frames
def _fuzz_limits() -> TapLimits:
    return TapLimits(max_tokens=64, max_message_bytes=1 << 16)


def _expect() -> TapExpectation:
    return TapExpectation(fingerprint=FP, tap_layers=TAPS, hidden_size=H, vocab_size=100)


def _refusals(n: int, seed: int) -> tuple[Counter, Counter, Counter]:
    """decode() over n fuzzed messages: (reasons refused, kinds accepted, other exceptions)."""
    good = [bytes(f) for f in encode(_msg(0))]
    rng = random.Random(seed)
    reasons, accepted, other = Counter(), Counter(), Counter()
    for _ in range(n):
        kind, frames = malformed(good, rng)
        try:
            decode(frames, limits=_fuzz_limits(), expect=_expect())
            accepted[kind] += 1
        except TapRejected as e:
            reasons[e.reason] += 1
        except Exception as e:  # noqa: BLE001 - anything else is a reader bug
            other[f"{kind}: {type(e).__name__}"] += 1
    return reasons, accepted, other


def test_fuzzed_frames_are_all_refused_by_reason() -> None:
    reasons, accepted, other = _refusals(5000, seed=3)
    assert not accepted and not other, (accepted, other)
    assert sum(reasons.values()) == 5000
    assert len(reasons) >= 12, reasons  # the breaks reach every kind of check


def test_a_reader_without_header_checks_lets_fuzzed_frames_through(monkeypatch) -> None:
    """Planted bug: the header's field checks skipped. The fuzzed frames then get through or
    crash the reader, so the test above sees the checks' work."""
    import codraft.tap.message as message

    monkeypatch.setattr(message, "_check_header", lambda h, limits: None)
    _, accepted, other = _refusals(2000, seed=3)
    assert accepted or other


def test_fuzzed_frames_through_zeromq_are_counted_and_the_learner_goes_on(ingest) -> None:
    ing, buf, push = ingest
    good = [bytes(f) for f in encode(_msg(0))]
    rng = random.Random(5)
    n = 2000
    for _ in range(n):
        push.send_multipart(malformed(good, rng)[1])
    for i in range(3):
        push.send_multipart(encode(_msg(200 + i)))
    _wait(lambda: ing.stats.accepted + ing.stats.rejected_total >= n + 3, timeout=60)
    assert ing.stats.rejected_total == n and ing.stats.accepted == 3, dict(ing.stats.rejected)
    assert len(ing.stats.rejected) >= 12 and ing._thread.is_alive()


def test_the_learner_reports_the_newest_policy_of_its_data(ingest) -> None:
    """codraft_learner_policy_version: what a policy pushed to the server looks like from the
    learner (its exporter on a stand-in for the daemon: the ingest, buffer and metrics only)."""
    from types import SimpleNamespace

    from codraft.learner.online.daemon import OnlineLearner
    from codraft.learner.online.metrics import LearnerMetrics

    ing, buf, push = ingest
    for i, policy in enumerate((2, 7, 5)):  # the newest, not the last to arrive
        push.send_multipart(encode(_msg(i, policy=policy)), copy=False)
    _wait(lambda: ing.stats.accepted == 3)
    daemon = SimpleNamespace(
        ingest=ing, buffer=buf, metrics=LearnerMetrics(), _saved_policy=2,
        cfg=SimpleNamespace(buffer=SimpleNamespace(max_tokens=1000)),
    )  # fmt: skip
    OnlineLearner._export_gauges(daemon)  # type: ignore[arg-type]
    assert daemon.metrics.policy_version._value.get() == 7
    assert daemon.metrics.policy_lag._value.get() == 5
