"""A draft checkpoint's weights, read once and hashed while the caller checks and stages them.

`read_checked(root, expect, pool)` does the checks of `codraft.draft.load_draft` (config,
sidecar, contract, safetensors header and file length, tensor names/shapes/dtypes, d2t/t2d,
finite weights) on one read of `model.safetensors`, whose bytes are the ones the returned
tensors view (no copy).
What makes it fast:

- The file is read in chunks into one buffer, and each chunk goes to a hashing thread as soon as
  it has landed: hashlib releases the GIL on large buffers, so the sha256 (~22 ms for 39 MB on
  this CPU, the largest single cost) runs on another core while the caller parses the header,
  checks the tensors and builds the kernel-format weights. `CheckedWeights.verify_sha()` waits
  for the digest; until it has returned, nothing read may be installed.
- The buffer comes from a `BufferPool` and goes back to it once the weights are no longer
  needed: filling a fresh 39 MB buffer costs ~25 ms of page faults, a reused one ~6 ms.
- The header is parsed from the buffer itself (an `io.BytesIO` of the file would copy it all).

Failures are `DraftCheckpointError`s with the messages of `codraft.draft.checkpoint`, in its
order: the header's first, then the checksum, then tensors and vocabulary maps.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from codraft.draft import checkpoint as ckpt
from codraft.draft.checkpoint import (
    WEIGHTS_NAME,
    AnyDraftConfig,
    DraftCheckpointError,
    DraftContract,
    DraftMeta,
)

CHUNK = 4 << 20  # bytes read before the hashing thread gets them


class BufferPool:
    """At most one idle byte buffer, handed out to one reader at a time and taken back when its
    tensors are dropped. A reader that finds the pool empty (or the buffer too small) gets a
    fresh one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buf, self._idle = self._idle, None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._idle is None or self._idle.numel() < buf.numel():
                self._idle = buf


class _Hasher:
    """sha256 of the chunks put into it, computed in its own thread."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._chunks: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._stop = False
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="codraft-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._chunks.get()) is not None:
            if not self._stop:
                t0 = time.perf_counter()
                self._digest.update(chunk)
                self.busy_s += time.perf_counter() - t0

    def put(self, chunk: memoryview) -> None:
        self._chunks.put(chunk)

    def hexdigest(self) -> str:
        self._chunks.put(None)
        self._thread.join()
        return self._digest.hexdigest()

    def abandon(self) -> None:
        """Stop hashing (the chunks still queued are skipped) and wait for the thread."""
        self._stop = True
        self._chunks.put(None)
        self._thread.join()


class _Head:
    """The `read` that `ckpt._read_header` needs, over the buffer without copying it."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def read(self, n: int) -> bytes:
        out = bytes(self._view[self._pos : self._pos + n])
        self._pos += len(out)
        return out


@dataclass
class CheckedWeights:
    """A checkpoint whose files passed every check but the checksum, which is still being
    computed: call `verify_sha()` before using `tensors`; `release()` when they are dropped."""

    root: Path
    cfg: AnyDraftConfig
    meta: DraftMeta
    tensors: dict[str, torch.Tensor]
    buffer: torch.Tensor
    pool: BufferPool | None
    hasher: _Hasher
    timing: dict[str, float] = field(default_factory=dict)
    _sha: str | None = None

    def verify_sha(self) -> str:
        """The file's sha256, once it matches codraft.json (DraftCheckpointError otherwise)."""
        if self._sha is None:
            t0 = time.perf_counter()
            sha = self.hasher.hexdigest()
            self.timing["hash_wait_ms"] = 1e3 * (time.perf_counter() - t0)
            self.timing["hash_ms"] = 1e3 * self.hasher.busy_s
            ckpt._check_sha(sha, self.meta, self.root / WEIGHTS_NAME)
            self._sha = sha
        return self._sha

    def release(self) -> None:
        """The tensors are no longer used: stop hashing, give the buffer back to the pool."""
        self.tensors = {}
        if self._sha is None:
            self.hasher.abandon()
        if self.pool is not None:
            self.pool.give(self.buffer)
            self.pool = None

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory lies inside the read buffer (then the buffer is not reused)."""
        lo = self.buffer.data_ptr()
        return lo <= t.data_ptr() < lo + self.buffer.numel()


def _read_into(file: Path, pool: BufferPool | None) -> tuple[torch.Tensor, int, _Hasher]:
    """The file's bytes in a buffer (hashing started), its size and the hasher."""
    try:
        f = open(file, "rb", buffering=0)  # noqa: SIM115 - closed below, errors mapped
    except OSError as e:
        raise DraftCheckpointError(f"{file}: unreadable: {e}") from None
    hasher = _Hasher()
    buf: torch.Tensor | None = None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            buf = pool.take(size) if pool is not None else torch.empty(size, dtype=torch.uint8)
            view = memoryview(buf.numpy())[:size]
            pos = 0
            while pos < size:
                got = f.readinto(view[pos : pos + CHUNK])
                if not got:
                    break
                hasher.put(view[pos : pos + got])
                pos += got
            if pos != size or f.read(1):
                raise DraftCheckpointError(f"{file}: changed size while being read")
    except BaseException as e:
        hasher.abandon()
        if pool is not None and buf is not None:
            pool.give(buf)
        if isinstance(e, OSError):
            raise DraftCheckpointError(f"{file}: unreadable: {e}") from None
        raise
    assert buf is not None
    return buf, size, hasher


def read_checked(
    root: Path, expect: DraftContract | None = None, pool: BufferPool | None = None
) -> CheckedWeights:
    """Read and check the checkpoint at `root` (see the module doc); the sha256 is still
    running when this returns. Raises DraftCheckpointError."""
    t0 = time.perf_counter()
    cfg, meta = ckpt._read_config_and_meta(root, expect)
    weights = root / WEIGHTS_NAME
    buf, size, hasher = _read_into(weights, pool)
    t1 = time.perf_counter()
    data = memoryview(buf.numpy())[:size]
    checked = CheckedWeights(root, cfg, meta, {}, buf, pool, hasher)
    try:
        header = ckpt._read_header(_Head(data), size, weights)  # type: ignore[arg-type]
    except BaseException:
        checked.release()
        raise
    try:
        ckpt._check_tensors(header, cfg, weights)
        base = 8 + struct.unpack_from("<Q", data)[0]
        tensors = {}
        for name, (dt, shape, begin, end) in header.items():
            dtype = ckpt._ST_DTYPES[dt][0]
            if end == begin:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=base + begin)
            tensors[name] = flat.view(shape)
        if not cfg.full_vocab:
            ckpt._check_maps(tensors["d2t"], tensors["t2d"], cfg, weights)
        ckpt._check_finite(tensors, weights)
    except DraftCheckpointError:
        try:
            checked.verify_sha()  # a checksum error comes first, as in codraft.draft.checkpoint
        finally:
            checked.release()
        raise
    except BaseException:
        checked.release()
        raise
    checked.tensors = tensors
    checked.timing.update(
        read_ms=1e3 * (t1 - t0), check_ms=1e3 * (time.perf_counter() - t1), bytes=float(size)
    )
    return checked
