"""The `codraft.tap.v1` message, schema 2: the target's features for one finished request.

One message is a list of six frames (ZeroMQ multipart on the stream, length-prefixed records in
recorded files; see `recording.py`). All numbers are little-endian.

  0  b"codraft.tap.v1"
  1  header: a msgpack map with exactly the fields of `TapHeader` (`schema`: 2), followed by 4
     bytes: the crc32 (zlib) of those msgpack bytes, so a damaged header is caught like damaged
     data
  2  token ids    int32  [T]
  3  taps         dtype  [T, n_taps * H]   (tap k: the residual stream after k decoder layers,
                                            before any final norm; tap layers concatenated in
                                            header order; empty frame in "ids" mode)
  4  last hidden  dtype  [T, H]            (the target's final hidden state AFTER the final
                                            norm: the lm_head's input, what vLLM's forward
                                            returns; empty frame in "ids" mode)
  5  loss mask    uint8  [T]               (1: a token the draft learns on, usually a completion
                                            token; 0: a prompt token)

Schema versions (the header's `schema` field). 2: frame 4 as above, so the teacher's logits are
lm_head(last hidden). 1 (retired): the same frames and header fields, but frame 4 held the
residual stream after the last layer BEFORE the final norm. Nothing in a message's bytes tells
the two apart except `schema`, so a reader refuses every version but its own (reason "schema"),
and schema-1 messages and recordings are refused with the advice to record them again.

Why the magic stays b"codraft.tap.v1": it names the framing (six frames, a crc-sealed msgpack
header), which schema 2 keeps, and not the schema. Keeping it lets a reader of another schema
get as far as the header and refuse with reason "schema" (counted and reported as a version
mismatch) instead of "magic" (not a codraft message at all); recorded files keep their file
magic for the same reason, and every record in them is checked like a streamed message.

`header.crc32` holds the crc32 of frames 2..5 (0 for an empty frame). `encode` sends contiguous
CPU tensors without copying them (memoryviews over their storage; bf16 as raw 16-bit words);
`decode` checks everything a sender could get wrong before it allocates anything, and raises
`TapRejected` with a short machine-readable `reason` (one of `REASONS`) on the first problem.
There is no pickle anywhere: a message is plain bytes. A reader rejects unknown header fields; a
new field, or a new meaning of a frame, means a new schema version.
"""

from __future__ import annotations

import math
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import msgpack
import torch

MAGIC = b"codraft.tap.v1"
SCHEMA_VERSION = 2
# Versions once written whose data a reader of SCHEMA_VERSION must not take: why, for the error.
RETIRED_SCHEMAS: dict[int, str] = {
    1: (
        "it was recorded with the pre-norm definition of the last hidden state (frame 4: the "
        "residual stream BEFORE the target's final norm; schema 2 carries the final hidden state "
        "AFTER it, the lm_head's input). Such taps must be re-recorded, and a server sending them "
        "upgraded, with a codraft that writes schema 2"
    ),
}
NUM_FRAMES = 6
MODES = ("full", "ids")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
REASONS = (
    "frames",  # not a list of 6 bytes-like frames
    "magic",  # first frame is not b"codraft.tap.v1"
    "size",  # over a TapLimits bound (tokens, bytes, hidden size, tap count)
    "header",  # header not a msgpack map of exactly the TapHeader fields with valid values
    "schema",  # another schema version (schema 1: pre-norm last hidden, re-record)
    "mode",  # mode not "full"/"ids", or not the expected one
    "dtype",  # dtype not float32/bfloat16/float16, or not the expected one
    "fingerprint",  # another target family than expected
    "tap_layers",  # other tap layers than expected
    "hidden_size",  # another hidden size than expected
    "shape",  # a data frame's byte length does not match the header
    "crc",  # a frame (or the header) does not match its crc32
    "prompt_len",  # prompt length > token count
    "token_ids",  # a token id < 0 or >= the expected vocab size
    "mask",  # a loss-mask value other than 0 or 1
    "nonfinite",  # NaN or inf in taps or last hidden
)
_ID_BITS = 63  # versions are int64 on every side
_MAX_LAYER_ID = 65535

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("codraft.tap assumes a little-endian host (the wire format is little-endian)")


class TapRejected(ValueError):
    """A tap message failed validation. `reason` is one of `REASONS` (for metrics labels)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"tap message rejected [{reason}]: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.detail))


@dataclass(frozen=True)
class TapLimits:
    """Bounds a receiver enforces before it allocates anything for a message."""

    max_tokens: int = 65536
    max_message_bytes: int = 1 << 30  # all frames together
    max_header_bytes: int = 16384
    max_hidden_size: int = 65536
    max_tap_layers: int = 16
    max_id_chars: int = 512  # request id and fingerprint length
    verify_crc: bool = True
    check_finite: bool = True


@dataclass(frozen=True)
class TapExpectation:
    """What the receiver knows about its target; None means "accept any".

    tap_layers and dtype are only checked in "full" mode (an "ids" message carries no features).
    """

    fingerprint: str | None = None
    tap_layers: tuple[int, ...] | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    dtype: str | None = None
    mode: str | None = None


DEFAULT_LIMITS = TapLimits()


@dataclass(frozen=True)
class TapHeader:
    """Header of a tap message. `crc32` is filled by `encode`; `created` is Unix seconds;
    `schema` is always SCHEMA_VERSION (a message of another schema is never built or decoded)."""

    request_id: str = ""
    fingerprint: str = ""
    policy_version: int = 0
    draft_version: int = 0
    tap_layers: tuple[int, ...] = ()
    hidden_size: int = 0
    dtype: str = "float32"
    num_tokens: int = 0
    prompt_len: int = 0
    mode: str = "full"
    crc32: tuple[int, ...] = (0, 0, 0, 0)
    created: float = 0.0
    schema: int = SCHEMA_VERSION

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    def frame_nbytes(self) -> tuple[int, int, int, int]:
        """Byte lengths of frames 2..5 (ids, taps, last hidden, mask) this header announces."""
        T, H = self.num_tokens, self.hidden_size
        if self.mode == "ids":
            return (4 * T, 0, 0, T)
        return (4 * T, T * len(self.tap_layers) * H * self.itemsize, T * H * self.itemsize, T)

    def to_wire(self) -> dict[str, Any]:
        # not dataclasses.asdict: it deep-copies every field, once per message on the tap's path
        d = {name: getattr(self, name) for name in _HEADER_FIELDS}
        d["tap_layers"] = list(self.tap_layers)
        d["crc32"] = list(self.crc32)
        return d


_HEADER_FIELDS = tuple(f.name for f in fields(TapHeader))


@dataclass
class TapMessage:
    """Header plus tensors. Shapes: token_ids int32 [T], taps [T, n_taps*H] (before any final
    norm), last_hidden [T, H] (the final hidden state after the final norm; both None in "ids"
    mode, else of `header.dtype`), loss_mask uint8 [T] of 0/1."""

    header: TapHeader
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    taps: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_message(self)

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @classmethod
    def build(
        cls,
        token_ids: torch.Tensor | Sequence[int],
        *,
        taps: torch.Tensor | None = None,
        last_hidden: torch.Tensor | None = None,
        tap_layers: Sequence[int],
        prompt_len: int = 0,
        loss_mask: torch.Tensor | None = None,
        hidden_size: int | None = None,
        dtype: str | None = None,
        request_id: str = "",
        fingerprint: str = "",
        policy_version: int = 0,
        draft_version: int = 0,
        created: float | None = None,
    ) -> TapMessage:
        """Build a consistent message. Mode is "full" when taps and last_hidden are given, "ids"
        when neither is (then pass hidden_size, and dtype if not float32, to describe the
        target). last_hidden is the target's final hidden state AFTER its final norm (the
        lm_head's input), taps the pre-norm residual streams of the tap layers. loss_mask
        defaults to 0 on the first prompt_len tokens and 1 after them."""
        ids = torch.as_tensor(token_ids)
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() != 1:
            raise ValueError(
                f"token_ids must be a 1-D integer tensor, got {ids.dtype} {list(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
            raise ValueError("token ids must lie in 0 .. 2**31-1 (they travel as int32)")
        ids = ids.to(device="cpu", dtype=torch.int32)
        T = ids.numel()
        if (taps is None) != (last_hidden is None):
            raise ValueError(
                "give both taps and last_hidden (mode 'full') or neither (mode 'ids'), "
                f"got taps={'set' if taps is not None else None}, "
                f"last_hidden={'set' if last_hidden is not None else None}"
            )
        mode = "ids" if taps is None else "full"
        if mode == "full":
            hidden_size = last_hidden.shape[-1]
            names = {v: k for k, v in DTYPES.items()}
            if last_hidden.dtype not in names:
                raise ValueError(
                    f"features must be one of {list(DTYPES)}, got {last_hidden.dtype}; cast first"
                )
            dtype = names[last_hidden.dtype]
        elif hidden_size is None:
            raise ValueError("an 'ids' message needs hidden_size (the target's hidden size)")
        if loss_mask is None:
            loss_mask = (torch.arange(T) >= prompt_len).to(torch.uint8)
        elif loss_mask.dtype != torch.uint8:
            loss_mask = loss_mask.to(torch.uint8)
        header = TapHeader(
            request_id=request_id,
            fingerprint=fingerprint,
            policy_version=policy_version,
            draft_version=draft_version,
            tap_layers=tuple(int(t) for t in tap_layers),
            hidden_size=int(hidden_size),
            dtype=dtype or "float32",
            num_tokens=T,
            prompt_len=int(prompt_len),
            mode=mode,
            created=time.time() if created is None else float(created),
        )
        return cls(header, ids, loss_mask, taps, last_hidden)

    def same_content(self, other: TapMessage) -> bool:
        """Bit-exact equality of header (crc32 aside) and tensors."""

        def eq(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return a.dtype == b.dtype and a.shape == b.shape and _bits(a).equal(_bits(b))

        return (
            replace(self.header, crc32=()) == replace(other.header, crc32=())
            and eq(self.token_ids, other.token_ids)
            and eq(self.loss_mask, other.loss_mask)
            and eq(self.taps, other.taps)
            and eq(self.last_hidden, other.last_hidden)
        )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bits (so NaN == NaN and -0.0 != 0.0 in comparisons)."""
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def check_message(msg: TapMessage) -> None:
    """Raise ValueError when the tensors do not fit the header (a sender-side bug)."""
    h = msg.header
    if h.schema != SCHEMA_VERSION:
        raise ValueError(
            f"header schema {h.schema!r}: this codraft writes and reads schema {SCHEMA_VERSION} "
            "only (frame 4 is the final hidden state after the final norm)"
        )
    if h.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {h.mode!r}")
    if h.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {h.dtype!r}")
    T, H, n = h.num_tokens, h.hidden_size, len(h.tap_layers)
    if T < 1 or H < 1:
        raise ValueError(f"need num_tokens >= 1 and hidden_size >= 1, got T={T}, H={H}")
    if not 0 <= h.prompt_len <= T:
        raise ValueError(f"prompt_len must be in 0..{T} (the token count), got {h.prompt_len}")

    def need(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtypes: tuple) -> None:
        if t is None:
            raise ValueError(f"{name} is required in mode {h.mode!r}")
        if tuple(t.shape) != shape or t.dtype not in dtypes:
            raise ValueError(
                f"{name} must be {[str(d) for d in dtypes]} {list(shape)} for the header "
                f"(T={T}, H={H}, {n} taps), got {t.dtype} {list(t.shape)}"
            )

    need("token_ids", msg.token_ids, (T,), (torch.int32,))
    need("loss_mask", msg.loss_mask, (T,), (torch.uint8,))
    if h.mode == "full":
        if n < 1:
            raise ValueError("a 'full' message needs at least one tap layer")
        need("taps", msg.taps, (T, n * H), (DTYPES[h.dtype],))
        need("last_hidden", msg.last_hidden, (T, H), (DTYPES[h.dtype],))
    elif msg.taps is not None or msg.last_hidden is not None:
        raise ValueError("an 'ids' message carries no taps or last_hidden; set them to None")


# ---------------------------------------------------------------------- encode
def _frame(t: torch.Tensor | None) -> bytes | memoryview:
    """The raw bytes of a tensor, without a copy when it is a contiguous CPU tensor."""
    if t is None:
        return b""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)  # numpy has no bfloat16; the bits are what travel
    return memoryview(t.numpy()).cast("B")


def encode(msg: TapMessage) -> list[bytes | memoryview]:
    """The six frames of `msg`. Data frames are memoryviews over the tensors' own storage when
    those are contiguous CPU tensors: keep the tensors unchanged until the frames are sent."""
    check_message(msg)
    data = [_frame(msg.token_ids), _frame(msg.taps), _frame(msg.last_hidden), _frame(msg.loss_mask)]
    header = replace(msg.header, crc32=tuple(zlib.crc32(f) for f in data))
    body = msgpack.packb(header.to_wire(), use_bin_type=True)
    return [MAGIC, body + zlib.crc32(body).to_bytes(4, "little"), *data]


# ---------------------------------------------------------------------- decode
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,),
    "request_id": (str,),
    "fingerprint": (str,),
    "policy_version": (int,),
    "draft_version": (int,),
    "tap_layers": (list,),
    "hidden_size": (int,),
    "dtype": (str,),
    "num_tokens": (int,),
    "prompt_len": (int,),
    "mode": (str,),
    "crc32": (list,),
    "created": (float, int),
}


def _views(frames: Any) -> list[memoryview]:
    if not isinstance(frames, list | tuple):
        raise TapRejected("frames", f"expected a list of frames, got {type(frames).__name__}")
    if not frames or len(frames) > 4 * NUM_FRAMES:
        raise TapRejected("frames", f"expected {NUM_FRAMES} frames, got {len(frames)}")
    views = []
    for i, f in enumerate(frames):
        try:
            views.append(memoryview(f).cast("B"))
        except (TypeError, ValueError):
            raise TapRejected(
                "frames", f"frame {i} is not a contiguous bytes-like object ({type(f).__name__})"
            ) from None
    return views


def _parse_header(buf: memoryview, limits: TapLimits) -> TapHeader:
    if len(buf) > limits.max_header_bytes:
        raise TapRejected(
            "size", f"header is {len(buf)} bytes, limit {limits.max_header_bytes} (TapLimits)"
        )
    if len(buf) < 5:
        raise TapRejected("header", f"header frame is {len(buf)} bytes, too short")
    body = buf[:-4]
    if zlib.crc32(body) != int.from_bytes(buf[-4:], "little"):
        raise TapRejected("crc", "header bytes do not match their crc32 (damaged in transit)")
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several types on malformed input
        raise TapRejected("header", f"header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise TapRejected("header", f"header must be a msgpack map, got {type(obj).__name__}")
    schema = obj.get("schema")
    if type(schema) is int and schema != SCHEMA_VERSION:
        detail = f"schema version {schema}, this reader understands {SCHEMA_VERSION} only"
        if schema in RETIRED_SCHEMAS:
            detail += f": {RETIRED_SCHEMAS[schema]}"
        raise TapRejected("schema", detail)
    missing = sorted(set(_FIELD_TYPES) - set(obj))
    unknown = sorted(set(obj) - set(_FIELD_TYPES))
    if missing or unknown:
        raise TapRejected(
            "header",
            f"header fields differ from schema {SCHEMA_VERSION}'s: missing {missing}, "
            f"unknown {unknown[:8]}",
        )
    for key, types in _FIELD_TYPES.items():
        if type(obj[key]) not in types:
            raise TapRejected(
                "header",
                f"header field {key!r} must be {'/'.join(t.__name__ for t in types)}, "
                f"got {type(obj[key]).__name__}",
            )
    for key in ("tap_layers", "crc32"):
        if not all(type(v) is int for v in obj[key]):
            raise TapRejected("header", f"header field {key!r} must be a list of ints")
    return TapHeader(
        **{k: v for k, v in obj.items() if k not in ("tap_layers", "crc32", "created")},
        tap_layers=tuple(obj["tap_layers"]),
        crc32=tuple(obj["crc32"]),
        created=float(obj["created"]),
    )


def _check_header(h: TapHeader, limits: TapLimits) -> None:
    if h.mode not in MODES:
        raise TapRejected("mode", f"mode must be one of {MODES}, got {h.mode[:32]!r}")
    if h.dtype not in DTYPES:
        raise TapRejected("dtype", f"dtype must be one of {list(DTYPES)}, got {h.dtype[:32]!r}")
    for key in ("request_id", "fingerprint"):
        if len(getattr(h, key)) > limits.max_id_chars:
            raise TapRejected("header", f"{key} longer than {limits.max_id_chars} characters")
    for key in ("policy_version", "draft_version"):
        if not 0 <= getattr(h, key) < 2**_ID_BITS:
            raise TapRejected("header", f"{key} must be in 0..2**63-1, got {getattr(h, key)}")
    if len(h.crc32) != 4 or not all(0 <= c < 2**32 for c in h.crc32):
        raise TapRejected("header", "crc32 must list 4 unsigned 32-bit values (frames 2..5)")
    if not (math.isfinite(h.created) and h.created >= 0):
        raise TapRejected("header", f"created must be a finite time >= 0, got {h.created}")
    if h.num_tokens < 1 or h.hidden_size < 1:
        raise TapRejected(
            "header", f"need num_tokens >= 1, hidden_size >= 1; got {h.num_tokens}, {h.hidden_size}"
        )
    if h.num_tokens > limits.max_tokens:
        raise TapRejected("size", f"{h.num_tokens} tokens, limit {limits.max_tokens}")
    if h.hidden_size > limits.max_hidden_size:
        raise TapRejected("size", f"hidden size {h.hidden_size}, limit {limits.max_hidden_size}")
    if len(h.tap_layers) > limits.max_tap_layers:
        raise TapRejected("size", f"{len(h.tap_layers)} tap layers, limit {limits.max_tap_layers}")
    if not all(0 <= t <= _MAX_LAYER_ID for t in h.tap_layers):
        raise TapRejected("header", f"tap layer ids must be in 0..{_MAX_LAYER_ID}")
    if len(set(h.tap_layers)) != len(h.tap_layers):
        raise TapRejected("header", f"tap layer ids must be distinct, got {list(h.tap_layers)}")
    if h.mode == "full" and not h.tap_layers:
        raise TapRejected("header", "a 'full' message must name its tap layers")
    if not 0 <= h.prompt_len <= h.num_tokens:
        raise TapRejected(
            "prompt_len", f"prompt_len {h.prompt_len} is not in 0..{h.num_tokens} (token count)"
        )
    total = sum(h.frame_nbytes())
    if total > limits.max_message_bytes:
        raise TapRejected(
            "size", f"message would hold {total} bytes, limit {limits.max_message_bytes}"
        )


def _check_expectation(h: TapHeader, e: TapExpectation) -> None:
    if e.fingerprint is not None and h.fingerprint != e.fingerprint:
        raise TapRejected(
            "fingerprint",
            f"target fingerprint {h.fingerprint[:80]!r}, expected {e.fingerprint!r}: the server "
            "runs another target family than this learner was configured for",
        )
    if e.mode is not None and h.mode != e.mode:
        raise TapRejected("mode", f"mode {h.mode!r}, expected {e.mode!r}")
    if e.hidden_size is not None and h.hidden_size != e.hidden_size:
        raise TapRejected("hidden_size", f"hidden size {h.hidden_size}, expected {e.hidden_size}")
    if h.mode == "full":
        if e.tap_layers is not None and h.tap_layers != tuple(e.tap_layers):
            raise TapRejected(
                "tap_layers",
                f"tap layers {list(h.tap_layers)}, expected {list(e.tap_layers)}: server and "
                "learner must use the same tap layers (codraft convention, tap k = after k layers)",
            )
        if e.dtype is not None and h.dtype != e.dtype:
            raise TapRejected("dtype", f"dtype {h.dtype!r}, expected {e.dtype!r}")


def _tensor(view: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh, writable tensor holding a copy of `view` (the frame buffer may be reused)."""
    return torch.frombuffer(bytearray(view), dtype=dtype).view(shape)


def decode(
    frames: Sequence[Any],
    *,
    limits: TapLimits = DEFAULT_LIMITS,
    expect: TapExpectation | None = None,
) -> TapMessage:
    """Validate the frames of one message and return it as tensors (copies, CPU).

    Raises TapRejected (reason in `REASONS`) on the first problem and nothing else, whatever the
    frames hold. Sizes are checked against `limits` before any tensor is allocated.
    """
    views = _views(frames)
    if views[0] != MAGIC:
        raise TapRejected("magic", f"first frame is not {MAGIC!r}: not a codraft tap message")
    if len(views) != NUM_FRAMES:
        raise TapRejected("frames", f"expected {NUM_FRAMES} frames, got {len(views)}")
    received = sum(len(v) for v in views)
    if received > limits.max_message_bytes + limits.max_header_bytes + len(MAGIC):
        raise TapRejected(
            "size", f"message is {received} bytes, limit {limits.max_message_bytes} (TapLimits)"
        )
    h = _parse_header(views[1], limits)
    _check_header(h, limits)
    if expect is not None:
        _check_expectation(h, expect)
    data = views[2:]
    names = ("token ids", "taps", "last hidden", "loss mask")
    for name, view, want in zip(names, data, h.frame_nbytes(), strict=True):
        if len(view) != want:
            raise TapRejected(
                "shape",
                f"{name} frame is {len(view)} bytes, header announces {want} "
                f"(T={h.num_tokens}, H={h.hidden_size}, {len(h.tap_layers)} taps, {h.dtype}, "
                f"mode {h.mode})",
            )
    if limits.verify_crc:
        for name, view, crc in zip(names, data, h.crc32, strict=True):
            if zlib.crc32(view) != crc:
                raise TapRejected("crc", f"{name} frame does not match its crc32")

    T, H = h.num_tokens, h.hidden_size
    ids = _tensor(data[0], torch.int32, (T,))
    mask = _tensor(data[3], torch.uint8, (T,))
    if int(ids.min()) < 0 or (expect and expect.vocab_size and int(ids.max()) >= expect.vocab_size):
        vocab = expect.vocab_size if expect and expect.vocab_size else 2**31
        raise TapRejected(
            "token_ids",
            f"token ids span {int(ids.min())}..{int(ids.max())}, expected 0..{vocab - 1}",
        )
    if int(mask.max()) > 1:
        raise TapRejected("mask", f"loss mask values must be 0 or 1, found {int(mask.max())}")
    taps = last = None
    if h.mode == "full":
        dt = DTYPES[h.dtype]
        taps = _tensor(data[1], dt, (T, len(h.tap_layers) * H))
        last = _tensor(data[2], dt, (T, H))
        if limits.check_finite and not (taps.isfinite().all() and last.isfinite().all()):
            raise TapRejected("nonfinite", "taps or last hidden hold NaN or inf")
    return TapMessage(h, ids, mask, taps, last)
