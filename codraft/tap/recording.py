"""Recorded tap files: the `codraft.tap.v1` frames (schema 2) of many messages, one after another.

A file is `FILE_MAGIC` followed by records; a record is one encoded message (the very frames the
stream carries, see `message.py`), each frame length-prefixed, little-endian:

    file   := b"CODRAFT-TAPS\\x00v1" record*
    record := b"TREC" u32(n_frames) u64(len_0) .. u64(len_{n-1}) frame_0 .. frame_{n-1}

`TapWriter` appends to `<prefix>-<seq>.taps.partial` and renames it to `<prefix>-<seq>.taps` when
the file is closed (fsync'ed first) or rotated by size, so readers of a directory never see a
half-written file. A record interrupted by an error is cut off again before the rename.

Readers (`read_taps`, `TapDataset`) take a file or a directory (all `*.taps` files in name
order; `.partial` files are read only when named explicitly). Damage is never silent: a file that
ends inside a record (truncated copy, disk full) or whose framing is broken is reported with a
logged warning and counted in `ReadStats.damaged`, and reading goes on with the next file; pass
strict=True to raise `TapFileError` instead. A record whose frames fail `decode` raises
`TapRejected` (on_reject="raise", the default) or is counted by reason and skipped ("skip").

The file magic names the framing only; each record's header carries its schema version, checked
by `decode` like a streamed message's. A recording made with schema 1 (last hidden state before
the final norm) is therefore refused at its first record with reason "schema", an error that
names the file and record and says to record the taps again.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from codraft.atomic import fsync_dir
from codraft.tap.message import (
    DEFAULT_LIMITS,
    TapExpectation,
    TapLimits,
    TapMessage,
    TapRejected,
    decode,
    encode,
)

log = logging.getLogger(__name__)

FILE_MAGIC = b"CODRAFT-TAPS\x00v1"
RECORD_MAGIC = b"TREC"
SUFFIX = ".taps"
PARTIAL_SUFFIX = ".taps.partial"
MAX_RECORD_FRAMES = 64
_PREFIX = struct.Struct("<4sI")


class TapFileError(ValueError):
    """A tap file is not one, or is damaged (raised for damage only with strict=True)."""


# ---------------------------------------------------------------------- writing
class TapWriter:
    """Append tap messages to size-rotated files `<prefix>-<seq:08d>.taps` in `directory`.

    Sequence numbers continue after the highest one already in the directory. `flush` hands
    buffered bytes to the OS; `close` (or leaving the `with` block) fsyncs and renames the current
    file into place. Not thread-safe: one writer per directory and prefix.
    """

    def __init__(
        self, directory: str | os.PathLike, *, prefix: str = "taps", max_file_bytes: int = 256 << 20
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.]+", prefix):
            raise ValueError(f"prefix must be letters, digits, '_' or '.', got {prefix!r}")
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be >= 1, got {max_file_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_file_bytes = max_file_bytes
        self.files: list[Path] = []  # finished files, in order
        self.records = 0
        self._seq = self._next_seq()
        self._f: BinaryIO | None = None
        self._path: Path | None = None
        self._size = 0  # bytes in the current file up to the last complete record
        self._records_in_file = 0

    def _next_seq(self) -> int:
        pat = re.compile(rf"{re.escape(self.prefix)}-(\d+)\.taps(\.partial)?")
        seqs = [int(m.group(1)) for p in self.directory.iterdir() if (m := pat.fullmatch(p.name))]
        return max(seqs, default=-1) + 1

    def _open(self) -> BinaryIO:
        self._path = self.directory / f"{self.prefix}-{self._seq:08d}{PARTIAL_SUFFIX}"
        self._seq += 1
        self._f = open(self._path, "xb")
        self._f.write(FILE_MAGIC)
        self._size = len(FILE_MAGIC)
        self._records_in_file = 0
        return self._f

    def write(self, msg: TapMessage) -> None:
        self.write_frames(encode(msg))

    def write_frames(self, frames: Sequence[Any]) -> None:
        """Append one message given as frames (e.g. as received from the stream; not validated
        here: validate with `decode` first when the source is not trusted)."""
        views = [memoryview(f).cast("B") for f in frames]
        if not 1 <= len(views) <= MAX_RECORD_FRAMES:
            raise ValueError(f"a record holds 1..{MAX_RECORD_FRAMES} frames, got {len(views)}")
        prefix = _PREFIX.pack(RECORD_MAGIC, len(views)) + struct.pack(
            f"<{len(views)}Q", *(len(v) for v in views)
        )
        n = len(prefix) + sum(len(v) for v in views)
        if self._f is not None and self._records_in_file and self._size + n > self.max_file_bytes:
            self._finish()
        f = self._f or self._open()
        try:
            f.write(prefix)
            for v in views:
                f.write(v)
        except BaseException:
            f.flush()
            f.truncate(self._size)  # never leave half a record behind
            raise
        self._size += n
        self._records_in_file += 1
        self.records += 1

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def _finish(self) -> None:
        f, path = self._f, self._path
        self._f = self._path = None
        assert f is not None and path is not None
        try:
            f.flush()
            f.truncate(self._size)
            os.fsync(f.fileno())
        finally:
            f.close()
        final = path.with_name(path.name.removesuffix(PARTIAL_SUFFIX) + SUFFIX)
        os.replace(path, final)
        fsync_dir(self.directory)
        self.files.append(final)

    def close(self) -> None:
        """Finish the current file (fsync, rename to *.taps). Idempotent."""
        if self._f is not None:
            self._finish()

    def __enter__(self) -> TapWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- reading
@dataclass
class ReadStats:
    """What readers saw. `damaged` lists "file@offset: why" for truncated or broken files."""

    files: int = 0
    records: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)


def list_tap_files(path: str | os.PathLike) -> list[Path]:
    """A file itself, or the `*.taps` files of a directory in name order."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.name.endswith(SUFFIX) and q.is_file())
    raise FileNotFoundError(f"no tap file or directory at {p}")


class _Damaged(Exception):
    pass


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _Damaged(f"file ends inside {what} ({len(b)} of {n} bytes)")
    return b


def _next_record(f: BinaryIO, limits: TapLimits, *, skip: bool) -> list[memoryview] | None:
    """Frames of the next record (None at a clean end of file); with skip, seek past them."""
    head = f.read(_PREFIX.size)
    if not head:
        return None
    if len(head) < _PREFIX.size:
        raise _Damaged(f"file ends inside a record prefix ({len(head)} of {_PREFIX.size} bytes)")
    magic, n = _PREFIX.unpack(head)
    if magic != RECORD_MAGIC or not 1 <= n <= MAX_RECORD_FRAMES:
        raise _Damaged(f"no record starts here (marker {magic!r}, {n} frames)")
    lens = struct.unpack(f"<{n}Q", _read_exact(f, 8 * n, "a record's frame lengths"))
    total = sum(lens)
    if total > limits.max_message_bytes + limits.max_header_bytes + 64:
        raise _Damaged(f"record claims {total} bytes, over the message limit (TapLimits)")
    if skip:
        here = f.tell()
        if f.seek(0, os.SEEK_END) < here + total:
            raise _Damaged(f"file ends inside a record ({total} bytes announced)")
        f.seek(here + total)
        return []
    body = memoryview(_read_exact(f, total, "a record"))
    out, at = [], 0
    for n_bytes in lens:
        out.append(body[at : at + n_bytes])
        at += n_bytes
    return out


def _report(stats: ReadStats, strict: bool, file: Path, offset: int, why: str) -> None:
    text = f"{file.name}@{offset}: {why}"
    if strict:
        raise TapFileError(f"damaged tap file {file}: {text}")
    stats.damaged.append(text)
    log.warning("damaged tap file %s at byte %d: %s; the rest of it is skipped", file, offset, why)


def _iter_file(
    file: Path,
    start: int,
    limits: TapLimits,
    expect: TapExpectation | None,
    on_reject: str,
    strict: bool,
    stats: ReadStats,
) -> Iterator[tuple[int, TapMessage | None]]:
    """(record index, message or None when rejected and skipped) from record `start` on."""
    with open(file, "rb") as f:
        if f.read(len(FILE_MAGIC)) != FILE_MAGIC:
            raise TapFileError(
                f"{file} is not a codraft tap file (it does not start with {FILE_MAGIC!r})"
            )
        stats.files += 1
        index = 0
        while True:
            offset = f.tell()
            try:
                frames = _next_record(f, limits, skip=index < start)
            except _Damaged as e:
                _report(stats, strict, file, offset, str(e))
                if index < start:
                    raise TapFileError(
                        f"cannot resume at record {start} of {file}: damaged at record {index}"
                    ) from None
                return
            if frames is None:
                if index < start:
                    raise TapFileError(
                        f"cannot resume at record {start} of {file}: it holds {index} records; "
                        "the saved data position belongs to other files"
                    )
                return
            if index >= start:
                try:
                    msg = decode(frames, limits=limits, expect=expect)
                except TapRejected as e:
                    if on_reject == "raise":
                        raise TapRejected(
                            e.reason, f"{e.detail} ({file.name}, record {index})"
                        ) from e
                    stats.rejected[e.reason] = stats.rejected.get(e.reason, 0) + 1
                    msg = None
                else:
                    stats.records += 1
                yield index, msg
            index += 1


@dataclass
class TapPosition:
    """Where a `TapDataset` resumes: the next record to read. file_name (the name of the file at
    file_index, "" when past the last file) guards against a changed file list."""

    file_index: int = 0
    record_index: int = 0
    file_name: str = ""
    epoch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TapPosition:
        return cls(**{k: d[k] for k in ("file_index", "record_index", "file_name", "epoch")})


class TapDataset:
    """Iterate tap messages of a file or directory, resumable from a saved `TapPosition`.

    The file list is re-read at the start of every pass, so files a recorder finishes later are
    picked up. With loop=True passes repeat forever (epoch counts them). `position` (and
    `state_dict`) always names the record after the last one yielded: save it with the trainer's
    checkpoint and pass it back to continue without repeating or skipping data.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        limits: TapLimits = DEFAULT_LIMITS,
        expect: TapExpectation | None = None,
        on_reject: str = "raise",
        strict: bool = False,
        loop: bool = False,
        position: TapPosition | dict[str, Any] | None = None,
    ) -> None:
        if on_reject not in ("raise", "skip"):
            raise ValueError(f"on_reject must be 'raise' or 'skip', got {on_reject!r}")
        self.path = Path(path)
        self.limits, self.expect = limits, expect
        self.on_reject, self.strict, self.loop = on_reject, strict, loop
        self.stats = ReadStats()
        self._pos = TapPosition()
        if position is not None:
            self.load_state_dict(position if isinstance(position, dict) else position.to_dict())

    @property
    def position(self) -> TapPosition:
        return TapPosition(**asdict(self._pos))

    def state_dict(self) -> dict[str, Any]:
        return self._pos.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pos = TapPosition.from_dict(state)
        if pos.file_index < 0 or pos.record_index < 0:
            raise ValueError(f"a data position has non-negative indices, got {pos}")
        self._pos = pos

    def _resolve(self, files: list[Path]) -> int:
        pos = self._pos
        names = [f.name for f in files]
        if not pos.file_name or (
            pos.file_index < len(files) and names[pos.file_index] == pos.file_name
        ):
            return pos.file_index
        if pos.file_name in names:  # files were added before it, or removed: follow the name
            return names.index(pos.file_name)
        raise TapFileError(
            f"the saved data position names {pos.file_name!r} (record {pos.record_index}), "
            f"which is not among the {len(files)} tap files of {self.path}; restore that file or "
            "start from a fresh position"
        )

    def __iter__(self) -> Iterator[TapMessage]:
        while True:
            files = list_tap_files(self.path)
            if not files and self.loop:
                raise FileNotFoundError(f"no *{SUFFIX} files in {self.path} to loop over")
            fi = self._resolve(files)
            epoch = self._pos.epoch
            while fi < len(files):
                file = files[fi]
                args = (self.limits, self.expect, self.on_reject, self.strict, self.stats)
                for index, msg in _iter_file(file, self._pos.record_index, *args):
                    self._pos = TapPosition(fi, index + 1, file.name, epoch)
                    if msg is not None:
                        yield msg
                fi += 1
                nxt = files[fi].name if fi < len(files) else ""
                self._pos = TapPosition(fi, 0, nxt, epoch)
            if not self.loop:
                return
            self._pos = TapPosition(0, 0, "", epoch + 1)


def read_taps(
    path: str | os.PathLike,
    limits: TapLimits = DEFAULT_LIMITS,
    expect: TapExpectation | None = None,
    *,
    on_reject: str = "raise",
    strict: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[TapMessage]:
    """Every message of a tap file, or of all `*.taps` files of a directory in name order.

    Damaged files are warned about and counted in `stats.damaged` (strict=True raises instead).
    """
    ds = TapDataset(path, limits=limits, expect=expect, on_reject=on_reject, strict=strict)
    if stats is not None:
        ds.stats = stats
    yield from ds
