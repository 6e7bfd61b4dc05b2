"""Malformed tap messages, made from a valid one, for fuzzing a reader (tests, the reliability
benchmark).

`malformed(good, rng)` returns `(kind, frames)`: the six frames of a valid message (as
`encode` gives them) broken in one way that no reader may accept. Some breaks leave every crc32
wrong (a flipped bit, a cut frame), most are sealed again so that they reach the checks behind
the crc32s: a header field of the wrong type or out of range, a missing or unknown field, a
header that is no map, token ids outside the vocabulary, a loss mask of 2, NaN or inf in the
features, a data frame of another length than the header announces, frames added or dropped,
frames of random bytes.

`foreign(good, rng, limits)` returns `(kind, frames)`: a well-formed, sealed message that a
learner expecting `good`'s target, tap layers, dtype and mode, and the server's versions, must
still refuse (`REFUSED_AS` names the reason each kind is counted under): other tap layers
(other ids, or another count), another dtype, a foreign target's fingerprint, another hidden
size, the other mode, a policy or draft version far ahead of the server's, more tokens than
the limits allow, a data frame past the message size limit.
"""

from __future__ import annotations

import random
import struct
import zlib
from typing import Any

import msgpack

from codraft.tap.message import DTYPES, MAGIC, TapLimits

# Values of the wrong type for each header field, or out of its range.
_WRONG: dict[str, list[Any]] = {
    "int": [-1, 2**64 - 1, -(2**63), 1.5, "3", None, True, [1], {"a": 1}],
    "str": [3, None, True, b"\xff" * 3, ["x"], "x" * 600, "x" * 20_000],
    "list": [3, "1,2", None, [1.5], [-1], ["a"], [2**64 - 1]],
    "float": [-1.0, float("nan"), float("inf"), "now", None, [0.0]],
}
_KIND = {
    "schema": "int", "request_id": "str", "fingerprint": "str", "policy_version": "int",
    "draft_version": "int", "tap_layers": "list", "hidden_size": "int", "dtype": "str",
    "num_tokens": "int", "prompt_len": "int", "mode": "str", "crc32": "list", "created": "float",
}  # fmt: skip
KINDS = (
    "bitflip", "truncate", "frames", "garbage", "magic", "field", "missing_field",
    "unknown_field", "not_a_map", "token_ids", "mask", "nonfinite", "length",
)  # fmt: skip


def seal(header: dict[str, Any], data: list[bytes], *, crcs: bool = True) -> list[bytes]:
    """Frames for `header` and the four data frames, with the crc32s made to match (the data
    frames' in the header unless `crcs` is False, and the header's own)."""
    if crcs:
        header = {**header, "crc32": [zlib.crc32(f) for f in data]}
    body = msgpack.packb(header, use_bin_type=True)
    return [MAGIC, body + zlib.crc32(body).to_bytes(4, "little"), *data]


def _flip(b: bytes, rng: random.Random) -> bytes:
    out = bytearray(b)
    out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _wrong_value(key: str, header: dict[str, Any], rng: random.Random) -> Any:
    choices = [v for v in _WRONG[_KIND.get(key, "int")] if v != header.get(key)]
    if key == "num_tokens":  # a count the frames do not hold
        choices.append(header[key] + rng.randrange(1, 50))
    if key == "mode":
        choices += ["partial", "FULL"]
    if key == "dtype":
        choices += ["float64", "int8"]
    return rng.choice(choices)


def malformed(good: list[bytes], rng: random.Random) -> tuple[str, list[bytes]]:
    """One message made from valid frames `good` and broken in one way (see the module doc).
    `good` must be a 'full' message with at least two tokens."""
    header = msgpack.unpackb(bytes(good[1][:-4]), raw=False)
    data = [bytes(f) for f in good[2:]]
    frames = [bytes(f) for f in good]
    kind = rng.choice(KINDS)
    if kind == "bitflip":
        j = rng.choice([i for i, f in enumerate(frames) if f and i > 0])
        frames[j] = _flip(frames[j], rng)
        return kind, frames
    if kind == "truncate":
        j = rng.choice([i for i, f in enumerate(frames) if f and i > 0])
        frames[j] = frames[j][: rng.randrange(len(frames[j]))]
        return kind, frames
    if kind == "frames":
        if rng.random() < 0.5:
            del frames[rng.randrange(1, len(frames))]
        else:
            frames.insert(rng.randrange(1, len(frames) + 1), rng.randbytes(rng.randrange(16)))
        return kind, frames
    if kind == "garbage":
        return kind, [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 8))]
    if kind == "magic":
        return kind, [_flip(MAGIC, rng), *frames[1:]]
    if kind == "field":
        key = rng.choice(sorted(_KIND))
        broken = {**header, key: _wrong_value(key, header, rng)}
        return kind, seal(broken, data, crcs=key != "crc32")
    if kind == "missing_field":
        key = rng.choice(sorted(header))
        return kind, seal({k: v for k, v in header.items() if k != key}, data, crcs=False)
    if kind == "unknown_field":
        return kind, seal({**header, f"x_{rng.randrange(10**6)}": 1}, data)
    if kind == "not_a_map":
        body = msgpack.packb(rng.choice([[1, 2], 7, "header", None, b"\x00"]))
        return kind, [MAGIC, body + zlib.crc32(body).to_bytes(4, "little"), *data]
    T = header["num_tokens"]
    ids, taps, last, mask = data
    if kind == "token_ids":
        bad = rng.choice([-1, -(2**31), 2**31 - 1, 10**9])
        at = rng.randrange(T)
        ids = ids[: 4 * at] + struct.pack("<i", bad) + ids[4 * at + 4 :]
    elif kind == "mask":
        at = rng.randrange(T)
        mask = mask[:at] + bytes([rng.randrange(2, 256)]) + mask[at + 1 :]
    elif kind == "nonfinite":
        width = 2 if header["dtype"] in ("bfloat16", "float16") else 4
        if width == 2:
            word = rng.choice([b"\xc0\x7f", b"\x80\x7f", b"\x80\xff"])  # NaN, inf, -inf
        else:
            word = struct.pack("<f", float(rng.choice(["nan", "inf", "-inf"])))
        target = rng.choice(["taps", "last"])
        frame = taps if target == "taps" else last
        at = rng.randrange(len(frame) // width) * width
        frame = frame[:at] + word + frame[at + width :]
        taps, last = (frame, last) if target == "taps" else (taps, frame)
    else:  # "length": a data frame longer or shorter than the header says
        j = rng.randrange(4)
        frame = [ids, taps, last, mask][j]
        cut = rng.randrange(1, max(2, len(frame)))
        frame = (
            frame[:-cut] if rng.random() < 0.5 and len(frame) > 1 else frame + rng.randbytes(cut)
        )
        ids, taps, last, mask = [
            frame if i == j else f for i, f in enumerate([ids, taps, last, mask])
        ]
    return kind, seal(header, [ids, taps, last, mask])


FOREIGN = (
    "tap_layers", "tap_count", "dtype", "fingerprint", "hidden_size", "mode", "policy_version",
    "draft_version", "oversized", "huge_part",
)  # fmt: skip
# the reason a learner counts each kind under (policy/draft: its ingest's version bounds)
REFUSED_AS = {
    "tap_layers": "tap_layers", "tap_count": "tap_layers", "dtype": "dtype",
    "fingerprint": "fingerprint", "hidden_size": "hidden_size", "mode": "mode",
    "policy_version": "policy_ahead", "draft_version": "draft_ahead", "oversized": "size",
    "huge_part": "size",
}  # fmt: skip


def foreign(
    good: list[bytes], rng: random.Random, limits: TapLimits, kind: str | None = None
) -> tuple[str, list[bytes]]:
    """A well-formed message made from valid frames `good` ('full' mode) that differs from it
    in one way its receiver must refuse (see the module doc); `kind` one of FOREIGN, or
    random. Features are zeros (finite), resized to what the header announces."""
    header = msgpack.unpackb(bytes(good[1][:-4]), raw=False)
    ids, taps, last, mask = (bytes(f) for f in good[2:])
    kind = kind or rng.choice(FOREIGN)
    T, H, layers = header["num_tokens"], header["hidden_size"], list(header["tap_layers"])
    size = DTYPES[header["dtype"]].itemsize

    def features(t: int, n: int, h: int, itemsize: int) -> tuple[bytes, bytes]:
        return bytes(t * n * h * itemsize), bytes(t * h * itemsize)

    if kind == "tap_layers":
        pool = [i for i in range(64) if i not in layers]
        header["tap_layers"] = sorted(rng.sample(pool, len(layers)))
    elif kind == "tap_count":
        n = len(layers) + 1 if len(layers) < 2 or rng.random() < 0.5 else len(layers) - 1
        header["tap_layers"] = sorted(rng.sample(range(64), n))
        taps, last = features(T, n, H, size)
    elif kind == "dtype":
        other = rng.choice([d for d in DTYPES if d != header["dtype"]])
        header["dtype"] = other
        taps, last = features(T, len(layers), H, DTYPES[other].itemsize)
    elif kind == "fingerprint":
        header["fingerprint"] = (
            rng.choice(["qwen2-", "llama-", "mistral-"]) + rng.randbytes(8).hex()
        )
    elif kind == "hidden_size":
        h = rng.choice([H // 2, H + 1, 2 * H]) or H + 1
        header["hidden_size"] = h
        taps, last = features(T, len(layers), h, size)
    elif kind == "mode":
        header["mode"], taps, last = "ids", b"", b""
    elif kind in ("policy_version", "draft_version"):
        header[kind] = rng.choice([2**63 - 1, 2**40, 10**6, header[kind] + 1000])
    elif kind == "oversized":
        t = limits.max_tokens + rng.randrange(1, 8)
        header["num_tokens"] = t
        ids, mask = bytes(4 * t), b"\x01" * t
        taps, last = features(t, len(layers), H, size)
    elif kind == "huge_part":  # a frame past the whole message's limit, the header unchanged
        over = limits.max_message_bytes + limits.max_header_bytes + len(MAGIC) + 1
        return kind, [*seal(header, [ids, taps, last, mask])[:3],
                      bytes(over), last, mask]  # fmt: skip
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {FOREIGN}")
    return kind, seal(header, [ids, taps, last, mask])
