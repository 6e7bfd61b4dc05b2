"""The codraft.tap.v1 message (schema 2) and recorded tap files: round trips, every rejection,
schema-1 data refused, a fuzz."""

from __future__ import annotations

import json
import logging
import random
import re
import zlib
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import codraft.tap.message as message_mod
from codraft.models.config import TargetConfig
from codraft.tap import (
    MAGIC,
    REASONS,
    SCHEMA_VERSION,
    ReadStats,
    TapDataset,
    TapExpectation,
    TapFileError,
    TapLimits,
    TapMessage,
    TapRejected,
    TapWriter,
    decode,
    encode,
    list_tap_files,
    model_fingerprint,
    read_taps,
)

T, H, TAPS = 11, 8, (1, 2, 3)


def make_msg(
    dtype: torch.dtype = torch.float32, mode: str = "full", seed: int = 0, T: int = T
) -> TapMessage:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (T,), generator=g)
    kw = {}
    if mode == "full":
        kw = dict(
            taps=torch.randn(T, len(TAPS) * H, generator=g).to(dtype),
            last_hidden=torch.randn(T, H, generator=g).to(dtype),
        )
    else:
        kw = dict(hidden_size=H)
    return TapMessage.build(
        ids,
        tap_layers=TAPS,
        prompt_len=4,
        request_id=f"req-{seed}",
        fingerprint="llama-0123456789abcdef",
        policy_version=3,
        draft_version=7,
        created=1700000000.5,
        **kw,
    )


def reject(frames, reason: str, **kw) -> TapRejected:
    with pytest.raises(TapRejected) as info:
        decode(frames, **kw)
    assert info.value.reason == reason, str(info.value)
    assert reason in REASONS
    return info.value


def with_header(frames: list, **changes) -> list:
    """Frames with header fields changed (or removed when the value is ...), crcs kept valid."""
    body = bytes(frames[1][:-4])
    h = msgpack.unpackb(body)
    for k, v in changes.items():
        if v is ...:
            h.pop(k)
        else:
            h[k] = v
    body = msgpack.packb(h, use_bin_type=True)
    return [frames[0], body + zlib.crc32(body).to_bytes(4, "little"), *frames[2:]]


def with_data(frames: list, index: int, data: bytes) -> list:
    """Frames with data frame `index` (2..5) replaced and its crc updated."""
    out = list(frames)
    out[index] = data
    crcs = [zlib.crc32(f) for f in out[2:]]
    return with_header(out, crc32=crcs)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["full", "ids"])
def test_round_trip_is_bit_exact(dtype: torch.dtype, mode: str) -> None:
    msg = make_msg(dtype, mode)
    frames = encode(msg)
    assert len(frames) == 6 and frames[0] == MAGIC
    if mode == "ids":
        assert len(frames[3]) == 0 and len(frames[4]) == 0
    for fs in (frames, [bytes(f) for f in frames]):
        got = decode(fs, expect=TapExpectation(fingerprint=msg.header.fingerprint, vocab_size=100))
        assert got.same_content(msg)
        assert got.header.mode == mode and got.header.prompt_len == 4
        assert got.loss_mask.tolist() == [0] * 4 + [1] * (T - 4)
        if mode == "full":
            assert got.taps.dtype == dtype and torch.equal(got.taps, msg.taps)


def test_decoded_tensors_are_writable_copies() -> None:
    msg = make_msg()
    frames = [bytearray(f) for f in encode(msg)]
    got = decode(frames)
    frames[4][:] = b"\0" * len(frames[4])  # the sender reuses its buffer
    assert torch.equal(got.last_hidden, msg.last_hidden)
    got.taps.add_(1)  # writable, no warning


def test_encode_is_zero_copy_for_contiguous_tensors() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        msg = make_msg(dtype)
        frames = encode(msg)
        for frame, t in ((frames[3], msg.taps), (frames[4], msg.last_hidden)):
            assert isinstance(frame, memoryview)
            assert np.frombuffer(frame, np.uint8).ctypes.data == t.data_ptr()
    # a non-contiguous tensor is copied, and still round-trips
    msg = make_msg()
    msg.last_hidden = torch.randn(H, T).t()
    assert decode(encode(msg)).same_content(msg)


def test_bool_mask_and_general_mask() -> None:
    mask = torch.tensor([True, False] * 5 + [True])
    msg = TapMessage.build(torch.arange(T), tap_layers=(), hidden_size=H, loss_mask=mask)
    assert decode(encode(msg)).loss_mask.tolist() == mask.to(torch.uint8).tolist()


def test_build_refuses_inconsistent_messages() -> None:
    with pytest.raises(ValueError, match="both taps and last_hidden"):
        TapMessage.build(torch.arange(3), taps=torch.zeros(3, 6), tap_layers=(1, 2))
    with pytest.raises(ValueError, match="taps must be"):
        TapMessage.build(
            torch.arange(3), taps=torch.zeros(3, 5), last_hidden=torch.zeros(3, 2), tap_layers=(1,)
        )
    with pytest.raises(ValueError, match="hidden_size"):
        TapMessage.build(torch.arange(3), tap_layers=())
    with pytest.raises(ValueError, match="prompt_len"):
        TapMessage.build(torch.arange(3), tap_layers=(), hidden_size=4, prompt_len=5)


# ---------------------------------------------------------------------- rejections
def test_every_reason_is_reachable() -> None:
    msg = make_msg()
    good = encode(msg)
    seen = set()

    def check(frames, reason, **kw):
        seen.add(reject(frames, reason, **kw).reason)

    check(b"".join(bytes(f) for f in good), "frames")
    check(good[:5], "frames")
    check([*good[:5], 42], "frames")
    check([b"codraft.tap.v2", *good[1:]], "magic")
    check(good, "size", limits=TapLimits(max_tokens=T - 1))
    check(good, "size", limits=TapLimits(max_header_bytes=16))
    check(good, "size", limits=TapLimits(max_message_bytes=100))
    check(good, "size", limits=TapLimits(max_tap_layers=2))
    check(good, "size", limits=TapLimits(max_hidden_size=H - 1))
    body = b"\xc1garbage"
    check([good[0], body + zlib.crc32(body).to_bytes(4, "little"), *good[2:]], "header")
    body = msgpack.packb([1, 2, 3])
    check([good[0], body + zlib.crc32(body).to_bytes(4, "little"), *good[2:]], "header")
    check(with_header(good, policy_version=...), "header")
    check(with_header(good, surprise=1), "header")
    check(with_header(good, hidden_size=True), "header")
    check(with_header(good, tap_layers=[1, 1, 2]), "header")
    check(with_header(good, tap_layers=["1", 2, 3]), "header")
    check(with_header(good, crc32=[0, 0, 0]), "header")
    check(with_header(good, policy_version=-1), "header")
    check(with_header(good, created=float("nan")), "header")
    check(with_header(good, num_tokens=0), "header")
    check(with_header(good, schema=SCHEMA_VERSION + 1), "schema")
    check(with_header(good, schema=1), "schema")
    check(with_header(good, mode="logits"), "mode")
    check(good, "mode", expect=TapExpectation(mode="ids"))
    check(with_header(good, dtype="int8"), "dtype")
    check(good, "dtype", expect=TapExpectation(dtype="bfloat16"))
    check(good, "fingerprint", expect=TapExpectation(fingerprint="qwen3-ffffffffffffffff"))
    check(good, "tap_layers", expect=TapExpectation(tap_layers=(2, 3, 4)))
    check(good, "hidden_size", expect=TapExpectation(hidden_size=H * 2))
    check([*good[:3], bytes(good[3])[:-4], *good[4:]], "shape")
    check(with_header(good, num_tokens=T + 1), "shape")
    check(with_header(good, hidden_size=H // 2), "shape")
    flipped = bytearray(good[4])
    flipped[5] ^= 0x10
    check([*good[:4], bytes(flipped), good[5]], "crc")
    header = bytearray(good[1])
    header[3] ^= 0x01
    check([good[0], bytes(header), *good[2:]], "crc")
    check(with_header(good, prompt_len=T + 1), "prompt_len")
    bad_ids = torch.tensor([5] * (T - 1) + [-3], dtype=torch.int32).numpy().tobytes()
    check(with_data(good, 2, bad_ids), "token_ids")
    check(good, "token_ids", expect=TapExpectation(vocab_size=int(msg.token_ids.max())))
    check(with_data(good, 5, bytes([0, 1, 2] + [1] * (T - 3))), "mask")
    nan = msg.last_hidden.clone()
    nan[3, 2] = float("inf")
    check(with_data(good, 4, nan.numpy().tobytes()), "nonfinite")
    assert decode(with_data(good, 4, nan.numpy().tobytes()), limits=TapLimits(check_finite=False))
    assert seen == set(REASONS)


# ---------------------------------------------------------------------- schema versions
PRE_NORM = r"schema version 1.*pre-norm definition.*BEFORE the target's final norm.*re-recorded"


def test_messages_say_schema_2_behind_the_unchanged_magic() -> None:
    frames = encode(make_msg())
    assert SCHEMA_VERSION == 2 and MAGIC == b"codraft.tap.v1" == bytes(frames[0])
    wire = msgpack.unpackb(bytes(frames[1][:-4]))
    assert wire["schema"] == 2 and type(wire["schema"]) is int
    assert decode(frames).header.schema == 2
    msg = make_msg()
    with pytest.raises(ValueError, match="schema 2 only"):
        TapMessage(replace(msg.header, schema=1), msg.token_ids, msg.loss_mask, msg.taps,
                   msg.last_hidden)  # fmt: skip


@pytest.mark.parametrize("mode", ["full", "ids"])
def test_schema_1_messages_are_refused_as_pre_norm(mode: str) -> None:
    """Schema 1 has the same frames and fields; only the meaning of frame 4 differs, so the
    header's version is all a reader can go by, and its error must say what to do."""
    old = with_header(encode(make_msg(mode=mode)), schema=1)
    e = reject(old, "schema")
    assert re.search(PRE_NORM, str(e)), str(e)


def test_a_schema_1_reader_refuses_schema_2_for_its_schema(monkeypatch) -> None:
    """A reader of schema 1 differs from this one by its version number only: it gets past the
    (unchanged) magic and refuses on the header's version, reason "schema", not "magic"."""
    frames = encode(make_msg())
    monkeypatch.setattr(message_mod, "SCHEMA_VERSION", 1)
    monkeypatch.setattr(message_mod, "RETIRED_SCHEMAS", {})
    e = reject(frames, "schema")
    assert "schema version 2, this reader understands 1 only" in str(e)


def test_schema_1_recording_is_refused_as_pre_norm(tmp_path: Path) -> None:
    with TapWriter(tmp_path) as w:
        for i in range(2):
            w.write_frames(with_header(encode(make_msg(seed=i)), schema=1))
    (file,) = w.files
    with pytest.raises(TapRejected, match=PRE_NORM) as info:
        list(read_taps(tmp_path))
    assert info.value.reason == "schema" and f"{file.name}, record 0" in str(info.value)
    with pytest.raises(TapRejected, match=PRE_NORM):
        next(iter(TapDataset(tmp_path, loop=True)))
    ds = TapDataset(tmp_path, on_reject="skip")
    assert list(ds) == [] and ds.stats.rejected == {"schema": 2}


def test_tap_layer_and_dtype_expectations_do_not_apply_to_ids_mode() -> None:
    frames = encode(make_msg(mode="ids"))
    decode(frames, expect=TapExpectation(tap_layers=(7, 8, 9), dtype="bfloat16", hidden_size=H))
    reject(frames, "hidden_size", expect=TapExpectation(hidden_size=H + 1))


def test_rejection_message_is_readable_and_picklable() -> None:
    import pickle

    e = reject(encode(make_msg()), "tap_layers", expect=TapExpectation(tap_layers=(1, 2, 4)))
    assert "expected [1, 2, 4]" in str(e)
    e2 = pickle.loads(pickle.dumps(e))
    assert e2.reason == "tap_layers" and str(e2) == str(e)


def _mutate(rng: random.Random, frames: list[bytes]) -> list:
    out = list(frames)
    kind = rng.randrange(9)
    i = rng.randrange(len(out))
    if kind == 0 and out[i]:  # flip bits in a byte
        b = bytearray(out[i])
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        out[i] = bytes(b)
    elif kind == 1:  # truncate
        out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
    elif kind == 2:  # extend
        out[i] = out[i] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    elif kind == 3:  # drop a frame
        del out[i]
    elif kind == 4:  # duplicate a frame
        out.insert(i, out[i])
    elif kind == 5:  # swap two frames
        j = rng.randrange(len(out))
        out[i], out[j] = out[j], out[i]
    elif kind == 6:  # random bytes
        out[i] = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    elif kind == 7:  # overwrite a run of bytes
        b = bytearray(out[i])
        if b:
            a = rng.randrange(len(b))
            b[a : a + 4] = bytes(rng.randrange(256) for _ in range(4))
        out[i] = bytes(b)
    else:  # nothing: must decode identically
        pass
    return out


def test_fuzz_raw_mutations_never_escape_tap_rejected() -> None:
    rng = random.Random(1234)
    msgs = [make_msg(torch.float32), make_msg(torch.bfloat16, seed=1), make_msg(mode="ids")]
    stats: dict[str, int] = {}
    for n in range(400):
        msg = msgs[n % len(msgs)]
        frames = [bytes(f) for f in encode(msg)]
        for _ in range(rng.randrange(1, 3)):
            frames = _mutate(rng, frames)
        try:
            got = decode(frames, expect=TapExpectation(vocab_size=100))
        except TapRejected as e:
            stats[e.reason] = stats.get(e.reason, 0) + 1
        else:
            assert got.same_content(msg), f"mutation {n} decoded to different content"
            stats["ok"] = stats.get("ok", 0) + 1
    assert len(stats) >= 5, stats


_WILD = [0, -1, 1, 2**31, 2**64 - 1, -(2**63), 1.5, float("inf"), "", "x" * 600, None, True]
_WILD += [[], [1, 2], [[1]], {"a": 1}, b"raw", "float32", "ids", "full"]


def test_fuzz_header_values_never_escape_tap_rejected() -> None:
    rng = random.Random(99)
    good = encode(make_msg())
    keys = list(msgpack.unpackb(bytes(good[1][:-4])))
    for _ in range(300):
        changes = {rng.choice(keys): rng.choice(_WILD) for _ in range(rng.randrange(1, 3))}
        try:
            decode(with_header(good, **changes))
        except TapRejected:
            pass


# ---------------------------------------------------------------------- fingerprint
def test_model_fingerprint_is_stable_and_architecture_only(tiny_llama_dir: Path) -> None:
    cfg = TargetConfig.from_pretrained(tiny_llama_dir)
    fp = model_fingerprint(cfg)
    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    assert fp == model_fingerprint(tiny_llama_dir) == model_fingerprint(hf)
    assert fp.startswith("llama-") and len(fp) == len("llama-") + 16
    assert model_fingerprint(replace(cfg, max_position_embeddings=99, dtype="bfloat16")) == fp
    assert model_fingerprint(replace(cfg, hidden_size=128)) != fp
    assert model_fingerprint(replace(cfg, rope_theta=1e6)) != fp
    assert model_fingerprint(cfg, extra={"tokenizer": "abc"}) != fp
    scaled = dict(rope_type="llama3", factor=8, original_max_position_embeddings=8192)
    same = dict(type="llama3", factor=8.0, original_max_position_embeddings=8192.0)
    assert model_fingerprint(replace(cfg, rope_scaling=scaled)) == model_fingerprint(
        replace(cfg, rope_scaling=same)
    )


# ---------------------------------------------------------------------- recorded files
def write_messages(directory: Path, msgs: list[TapMessage], **kw) -> TapWriter:
    with TapWriter(directory, **kw) as w:
        for m in msgs:
            w.write(m)
    return w


def test_recording_round_trip_and_rotation(tmp_path: Path) -> None:
    msgs = [make_msg(seed=i, mode="ids" if i % 3 == 2 else "full") for i in range(10)]
    w = write_messages(tmp_path, msgs, max_file_bytes=2000)
    assert len(w.files) > 2 and w.records == 10
    assert [p.name for p in list_tap_files(tmp_path)] == [p.name for p in w.files]
    assert w.files[0].name == "taps-00000000.taps"
    assert not list(tmp_path.glob("*.partial"))
    got = list(read_taps(tmp_path))
    assert len(got) == 10 and all(a.same_content(b) for a, b in zip(got, msgs, strict=True))
    # a second writer continues the sequence numbers
    w2 = write_messages(tmp_path, msgs[:1])
    assert w2.files[0].name > w.files[-1].name
    assert len(list(read_taps(tmp_path))) == 11


def test_partial_file_is_not_read_until_closed(tmp_path: Path) -> None:
    w = TapWriter(tmp_path)
    w.write(make_msg())
    w.flush()
    assert list(read_taps(tmp_path)) == []
    (partial,) = tmp_path.glob("*.taps.partial")
    assert len(list(read_taps(partial))) == 1  # readable when named explicitly
    w.close()
    assert len(list(read_taps(tmp_path))) == 1


def test_truncated_file_is_reported_not_ignored(tmp_path: Path, caplog) -> None:
    msgs = [make_msg(seed=i) for i in range(3)]
    (file,) = write_messages(tmp_path, msgs).files
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        got = list(read_taps(tmp_path, stats=stats))
    assert len(got) == 2 and stats.records == 2
    assert len(stats.damaged) == 1 and file.name in stats.damaged[0]
    assert "damaged tap file" in caplog.text
    with pytest.raises(TapFileError, match="ends inside"):
        list(read_taps(tmp_path, strict=True))
    file.write_bytes(b"NOT-A-TAP-FILE" + data)
    with pytest.raises(TapFileError, match="not a codraft tap file"):
        list(read_taps(file))


def test_rejected_records_raise_or_are_counted(tmp_path: Path) -> None:
    write_messages(tmp_path, [make_msg(seed=i) for i in range(3)])
    expect = TapExpectation(tap_layers=(2, 3, 4))
    with pytest.raises(TapRejected, match="record 0"):
        list(read_taps(tmp_path, expect=expect))
    ds = TapDataset(tmp_path, expect=expect, on_reject="skip")
    assert list(ds) == [] and ds.stats.rejected == {"tap_layers": 3}


def test_dataset_resumes_from_saved_position(tmp_path: Path) -> None:
    msgs = [make_msg(seed=i) for i in range(9)]
    write_messages(tmp_path, msgs, max_file_bytes=2500)
    assert len(list_tap_files(tmp_path)) >= 3
    ds = TapDataset(tmp_path)
    it = iter(ds)
    first = [next(it) for _ in range(5)]
    state = ds.state_dict()
    rest = list(TapDataset(tmp_path, position=state))
    assert [m.header.request_id for m in first + rest] == [m.header.request_id for m in msgs]
    # a new file appended later is found after the end position
    list(it)
    end = ds.state_dict()
    write_messages(tmp_path, [make_msg(seed=42)])
    assert [m.header.request_id for m in TapDataset(tmp_path, position=end)] == ["req-42"]
    # looping counts epochs
    ds = TapDataset(tmp_path, loop=True)
    it = iter(ds)
    for _ in range(11):
        next(it)
    assert ds.position.epoch == 1
    with pytest.raises(TapFileError, match="not among"):
        list(TapDataset(tmp_path, position=dict(state, file_name="gone.taps")))


def test_zeromq_frames_round_trip_without_copies() -> None:
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://codraft-tap-test")
        push.connect("inproc://codraft-tap-test")
        msg = make_msg(torch.bfloat16)
        push.send_multipart(encode(msg), copy=False)
        assert pull.poll(5000), "no message arrived"
        frames = pull.recv_multipart(copy=False)
        assert decode(frames, expect=TapExpectation(tap_layers=TAPS)).same_content(msg)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
