"""Adversarial tap messages from an authenticated peer into the learner's real ingest.

10^5 messages go through `TapIngest.handle` (what the ingest thread calls for each message),
and a few thousand more through a real CURVE socket on 127.0.0.1: malformed frames
(codraft.tap.fuzz.malformed: flipped bits, cut and overlong frames, wrong part counts, garbage
msgpack, fields of the wrong type) and well-formed foreign ones (codraft.tap.fuzz.foreign:
other tap layers, another dtype, a foreign target's fingerprint, another hidden size, the
other mode, versions far ahead of the server's, too many tokens, an oversized part). No
exception may escape, every refusal is counted under its reason (and exported on /metrics),
and afterwards genuine messages are still taken in, drawn, packed and trained on.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import zmq
from prometheus_client import generate_latest

from codraft.client.errors import CodraftConnectionError
from codraft.client.models import DraftInfo, Ready
from codraft.learner.data.packing import pack
from codraft.learner.online.buffer import BufferPolicy, SampleBuffer
from codraft.learner.online.daemon import OnlineConfig, OnlineLearner
from codraft.learner.online.ingest import TapIngest, VersionBounds
from codraft.learner.online.metrics import LearnerMetrics
from codraft.learner.trainer import TrainConfig, Trainer
from codraft.models.config import TargetConfig
from codraft.tap import TapExpectation, TapLimits, TapMessage, encode, model_fingerprint
from codraft.tap.auth import TapKeys, create_keys, curve_client
from codraft.tap.fuzz import FOREIGN, REFUSED_AS, foreign, malformed
from codraft.testing import make_tiny_target

N_HANDLE = 100_000
N_SOCKET = 3_000
POLICY, DRAFT = 3, 2  # what the server announces
LIMITS = TapLimits(max_tokens=64, max_message_bytes=1 << 17)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    """A tiny target, a trainer of its default draft, key pairs, and a message factory."""
    root = tmp_path_factory.mktemp("tap-fuzz")
    target = make_tiny_target(root / "target", arch="llama")
    tcfg = TargetConfig.from_pretrained(target)
    trainer = Trainer(target, root / "ck", TrainConfig(draft_vocab_size=64, device="cpu"))
    taps = tuple(trainer.draft.config.tap_layers)
    learner_pub, learner_sec = create_keys(root / "learner", "learner")
    server_pub, server_sec = create_keys(root / "server", "server")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "server.key").write_bytes(server_pub.read_bytes())
    H, fp = tcfg.hidden_size, model_fingerprint(tcfg)

    def message(i: int, n: int = 8, policy: int = POLICY) -> TapMessage:
        g = torch.Generator().manual_seed(i)
        return TapMessage.build(
            torch.randint(0, tcfg.vocab_size, (n,), generator=g, dtype=torch.int32),
            taps=torch.randn(n, len(taps) * H, generator=g),
            last_hidden=torch.randn(n, H, generator=g),
            tap_layers=taps,
            prompt_len=2,
            request_id=f"req-{i}",
            fingerprint=fp,
            policy_version=policy,
            draft_version=DRAFT,
        )

    return SimpleNamespace(
        target=target, tcfg=tcfg, trainer=trainer, taps=taps, message=message,
        learner=TapKeys(str(learner_sec), str(allowed)),
        server=TapKeys(str(server_sec), str(learner_pub)),
    )  # fmt: skip


def _ingest(world: SimpleNamespace, **policy) -> TapIngest:
    """The learner's ingest as the daemon builds it: the target and its draft's tap layers
    known, the dtype left to the pin, the server's versions as bounds, CURVE on."""
    expect = TapExpectation(
        fingerprint=model_fingerprint(world.tcfg),
        hidden_size=world.tcfg.hidden_size,
        vocab_size=world.tcfg.vocab_size,
        mode="full",
        tap_layers=world.taps,
    )
    buf = SampleBuffer(BufferPolicy(holdout_fraction=0.0, **policy))
    bounds = VersionBounds(policy=POLICY, draft=DRAFT, slack=1)
    return TapIngest(
        "tcp://127.0.0.1:*", buf, expect, LIMITS, keys=world.learner, bounds=bounds
    )  # fmt: skip


def _adversarial(good: list[bytes], rng: random.Random, *, huge: bool = True):
    """(kind, frames, reason or None): a foreign message half of the time (its reason
    known), a malformed one otherwise."""
    if rng.random() < 0.5:
        kinds = FOREIGN if huge else tuple(k for k in FOREIGN if k != "huge_part")
        kind, frames = foreign(good, rng, LIMITS, rng.choice(kinds))
        return kind, frames, REFUSED_AS[kind]
    kind, frames = malformed(good, rng)
    return kind, frames, None


def test_1e5_adversarial_messages_are_refused_by_reason_and_training_goes_on(world) -> None:
    ing = _ingest(world)
    try:
        good = [bytes(f) for f in encode(world.message(0))]
        assert ing.expect.dtype is None
        assert ing.handle(good)  # the first genuine message pins the dtype
        assert ing.expect.tap_layers == world.taps and ing.expect.dtype == "float32"
        rng = random.Random(11)
        kinds, wrong = Counter(), []
        t0 = time.monotonic()
        for _ in range(N_HANDLE):
            kind, frames, reason = _adversarial(good, rng)
            before = ing.stats.rejected[reason] if reason else 0
            taken = ing.handle(frames)  # raises nothing, whatever it is given
            kinds[kind] += 1
            if taken or (reason and ing.stats.rejected[reason] != before + 1):
                wrong.append((kind, taken, dict(ing.stats.rejected)))
        elapsed = time.monotonic() - t0
        assert not wrong, wrong[:3]
        assert ing.stats.accepted == 1 and ing.stats.rejected_total == N_HANDLE
        assert ing.stats.rejected["internal"] == 0, "an unexpected error inside ingest"
        assert set(kinds) >= set(FOREIGN), kinds
        assert len(ing.stats.rejected) >= 18, ing.stats.rejected
        assert len(ing.buffer) == 1 and ing.buffer.newest_policy == POLICY
        # genuine messages still go in, and the buffer draws, packs and trains
        for i in range(1, 13):
            assert ing.handle(encode(world.message(i, policy=POLICY + i % 2)))
        batch = pack(ing.buffer.draw(token_budget=96))
        m = world.trainer.step(batch)
        assert torch.isfinite(torch.tensor(m.loss)) and m.tokens > 0
        print(f"{N_HANDLE} messages in {elapsed:.1f}s: {dict(ing.stats.rejected)}")
    finally:
        ing.stop()


def test_adversarial_messages_over_the_curve_socket(world) -> None:
    ing = _ingest(world).start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        curve_client(push, world.server)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(ing.bound)
        good = [bytes(f) for f in encode(world.message(0))]
        push.send_multipart(good)  # the dtype's pin
        rng = random.Random(12)
        expected = Counter()
        for _ in range(N_SOCKET):  # no part past MAXMSGSIZE: that closes the connection
            _, frames, reason = _adversarial(good, rng, huge=False)
            if reason:
                expected[reason] += 1
            push.send_multipart(frames)
        for i in range(3):
            push.send_multipart(encode(world.message(100 + i)))
        end = time.monotonic() + 60
        while ing.stats.accepted + ing.stats.rejected_total < N_SOCKET + 4:
            assert time.monotonic() < end, (ing.stats.accepted, dict(ing.stats.rejected))
            time.sleep(0.05)
        assert ing.stats.accepted == 4 and ing.stats.rejected_total == N_SOCKET
        assert all(ing.stats.rejected[r] >= n for r, n in expected.items()), ing.stats.rejected
        assert ing._thread.is_alive() and ing.stats.rejected["internal"] == 0
    finally:
        push.close(linger=0)
        ctx.term()
        ing.stop()


def test_without_the_tap_layer_check_a_foreign_message_gets_in_and_breaks_packing(
    world, monkeypatch
) -> None:
    """Planted bug: the expectation's tap layers ignored. Messages of other tap layers are
    then buffered, and a batch of them with the genuine ones cannot be packed: the check is
    what keeps the trainer's input whole."""
    import codraft.tap.message as message

    real = message._check_expectation
    monkeypatch.setattr(
        message, "_check_expectation", lambda h, e: real(h, replace(e, tap_layers=None))
    )
    ing = _ingest(world)
    try:
        good = [bytes(f) for f in encode(world.message(0))]
        assert ing.handle(good)
        rng = random.Random(1)
        assert ing.handle(foreign(good, rng, LIMITS, "tap_layers")[1])
        assert ing.handle(foreign(good, rng, LIMITS, "tap_count")[1])
        with pytest.raises(ValueError, match="different kinds"):
            pack(ing.buffer.all_samples())
    finally:
        ing.stop()


def test_without_the_version_bound_one_message_evicts_every_real_sample(world, monkeypatch) -> None:
    """Planted bug: no bound on versions. One message at policy 2**63-1 becomes the buffer's
    newest policy, and its policy window evicts every genuine sample."""
    monkeypatch.setattr(VersionBounds, "check", lambda self, policy, draft: None)
    ing = _ingest(world, policy_window=0)
    try:
        for i in range(4):
            assert ing.handle(encode(world.message(i)))
        good = [bytes(f) for f in encode(world.message(0))]
        assert ing.handle(foreign(good, random.Random(0), LIMITS, "policy_version")[1])
        assert ing.buffer.stats.evicted["policy"] == 4
    finally:
        ing.stop()


def test_refusals_are_exported_on_metrics_by_reason(world) -> None:
    ing = _ingest(world)
    try:
        good = [bytes(f) for f in encode(world.message(0))]
        assert ing.handle(good)
        rng = random.Random(3)
        for kind in FOREIGN:
            ing.handle(foreign(good, rng, LIMITS, kind)[1])
        ing.handle([b"garbage"])
        daemon = SimpleNamespace(
            ingest=ing, buffer=ing.buffer, metrics=LearnerMetrics(), _saved_policy=0
        )
        OnlineLearner._export_gauges(daemon)  # type: ignore[arg-type]
        text = generate_latest(daemon.metrics.registry).decode()
        assert ing.stats.rejected
        for reason, n in ing.stats.rejected.items():
            assert f'codraft_learner_tap_rejected{{reason="{reason}"}} {float(n)}' in text, reason
        for reason in ("policy_ahead", "draft_ahead", "tap_layers", "dtype", "size"):
            assert f'reason="{reason}"' in text, reason
        assert "codraft_learner_buffer_bytes" in text
    finally:
        ing.stop()


class _Server:
    """The two control calls the learner reads the server's versions with."""

    def __init__(self, policy: int | None, draft: int, taps: list[int]) -> None:
        self.policy, self.version, self.taps, self.down = policy, draft, taps, False

    def ready(self) -> Ready:
        if self.down:
            raise CodraftConnectionError("GET", "http://server/ready", OSError("down"), 1)
        return Ready(ready=True, draft_version=self.version, policy_version=self.policy)

    def draft(self) -> DraftInfo:
        return DraftInfo(version=self.version, highest_version=self.version, tap_layers=self.taps)


def test_the_announced_versions_bound_what_is_taken_in(world, tmp_path) -> None:
    """The real learner (no server reachable: it takes only versions within the slack of 0),
    then a server announcing policy 5 and draft 4 with its draft's tap layers."""
    from codraft.server.serve import free_port

    cfg = OnlineConfig(
        server=f"http://127.0.0.1:{free_port()}", tap=f"tcp://127.0.0.1:{free_port()}",
        target=str(world.target), out=str(tmp_path / "out"), http_port=0,
    )  # fmt: skip
    learner = OnlineLearner(cfg)
    try:
        ing = learner.ingest
        bounds = learner.bounds
        assert ing.bounds is bounds and (bounds.policy, bounds.draft) == (0, 0)
        assert not ing.handle(encode(world.message(1, policy=2)))
        assert ing.stats.rejected["policy_ahead"] == 1
        assert ing.expect.tap_layers == world.taps  # the default draft's, before the server's
        other = [t + 1 for t in world.taps]
        server = _Server(policy=5, draft=4, taps=other)
        learner.client = server
        assert learner.read_announced()
        assert (learner.bounds.policy, learner.bounds.draft) == (5, 4)
        assert ing.expect.tap_layers == tuple(other)  # pinned to the serving draft's
        assert not ing.handle(encode(world.message(2, policy=5)))
        assert ing.stats.rejected["tap_layers"] == 1
        server.taps = list(world.taps)
        assert learner.read_announced() and ing.expect.tap_layers == world.taps
        assert ing.handle(encode(world.message(2, policy=6)))  # within the slack
        assert not ing.handle(encode(world.message(3, policy=7)))
        assert ing.stats.rejected["policy_ahead"] == 2
        server.down = True
        assert not learner.read_announced()  # the bounds stay as they were
        assert learner.bounds.policy == 5
    finally:
        learner.ingest.stop()


def test_repinning_to_the_drafts_tap_layers_empties_a_buffer_of_others(world) -> None:
    ing = _ingest(world)
    try:
        for i in range(3):
            assert ing.handle(encode(world.message(i)))
        other = tuple(t + 1 for t in world.taps)
        assert ing.repin(other)  # the draft reads other layers than the buffer holds
        assert len(ing.buffer) == 0 and ing.buffer.stats.evicted["tap_layers"] == 3
        assert not ing.handle(encode(world.message(4)))
        assert ing.stats.rejected["tap_layers"] == 1
        assert not ing.repin(other)  # the same layers again: nothing to empty
    finally:
        ing.stop()


def test_the_dtype_is_pinned_to_the_first_message_taken(world) -> None:
    """Documented behaviour: a learner takes features of one dtype, the first it accepts (a
    buffer of mixed dtypes would not pack); any other is refused under "dtype"."""
    ing = _ingest(world)
    try:
        good = [bytes(f) for f in encode(world.message(0))]
        half = foreign(good, random.Random(0), LIMITS, "dtype")[1]
        assert ing.handle(half)
        assert ing.expect.dtype != "float32"
        assert not ing.handle(good) and ing.stats.rejected["dtype"] == 1
    finally:
        ing.stop()
