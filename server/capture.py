"""Decode-time capture: the target's tap features of every token that becomes final.

The step records come from codraft.server.hooks. Which rows are final: a request scheduled with n
tokens of which k are draft proposals, and whose verification returned a + 1 tokens (a accepted
drafts + the bonus/correction token), has final rows 0 .. n-k+a-1 (the inputs up to and including
the last accepted draft); the k-a rejected proposals are dropped. Prefill chunks and plain decode
steps (k = 0) are final entirely. A token's features come from the forward in which it is the
INPUT, so a sampled token's features arrive one step later, and the very last token of a request
never has any: a "full" message covers the final sequence minus its last token (T = prompt +
output - 1 rows, every row with features); an "ids" message covers the whole final sequence.

Two halves, so that the engine step never waits for the device nor builds a message:

* **Bookkeeping** (`Capture.on_step`, in the thread that hands over a step's sampled tokens, in
  step order): which requests exist (from the scheduler's new requests: prompt, sampling
  parameters, whether and how the request is captured), their outputs, vLLM's stop rule (EOS,
  stop token ids, min/max tokens, max_model_len; the scheduler's check_stop), which rows of the
  step are final, the draft version each finished request ends with. A request is finished when
  the stop rule says so - in the step that ends it - or when the scheduler lists it in
  `finished_req_ids` (aborts, stop strings).
* **Assembly** (`Assembler`, a thread of its own): copies a step's rows to the host
  (codraft.server.row_copy: the only wait for the device, in this thread), keeps each request's
  final rows keyed by position (a preempted and recomputed request overwrites its rows), cuts long
  requests into chunks of `max_tokens` rows while they run (ids "<request id>#<i>", i = 0, 1,
  ...; each chunk's prompt_len counts the prompt tokens inside it), checks every message's
  token ids against the request's sequence and hands the message to the publisher. Loss mask:
  0 on prompt tokens, 1 on generated ones.

In "full" mode a request whose first rows were never computed here (a prefix-cache hit), whose
last rows never arrived, or whose policy changed mid-request is not sent and is counted as
incomplete (a message holds every input of the final sequence or is not sent): run the engine
without prefix caching when the tap is on in "full" mode. With async scheduling a request may
still be scheduled for a step after the one that ended it; such rows are ignored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from codraft.server import hooks
from codraft.server.hooks import StepRecord
from codraft.server.row_copy import StagedRows
from codraft.tap.message import TapMessage

log = logging.getLogger(__name__)
# Records that may arrive ahead of a step whose tokens never came, before that step is given up.
MAX_OUT_OF_ORDER = 256


# ---------------------------------------------------------------------------- stop rule
# ---------------------------------------------------------------------------- requests
@dataclass
class NewRequest:
    """What the scheduler says about a request when it first schedules it."""

    req_id: str
    prompt_ids: list[int]
    sampling_params: Any
    mode: str | None  # "full" | "ids" | None (not captured)


@dataclass
class StepContext:
    """What the listener attaches to a step before it runs (engine thread)."""

    new: list[NewRequest]
    finished: frozenset[str]
    policy_version: int
    proposer_version: int  # the draft version that proposed this step's drafts


@dataclass
class StopRule:
    """vLLM's check_stop for one request, read once from its sampling parameters."""

    stop_ids: frozenset[int]  # EOS and stop token ids
    min_tokens: int
    limit: int  # outputs at which the length rule ends it (max_tokens or max_model_len)

    @classmethod
    def of(cls, sp: Any, prompt_len: int, max_model_len: int) -> StopRule:
        eos = getattr(sp, "eos_token_id", None)
        stops = set(getattr(sp, "stop_token_ids", None) or ())
        if eos is not None:
            stops.add(eos)
        max_tokens = getattr(sp, "max_tokens", None)
        limit = max_model_len - prompt_len
        if max_tokens is not None:
            limit = min(limit, max_tokens)
        return cls(frozenset(stops), getattr(sp, "min_tokens", 0) or 0, limit)

    def keep(self, new_tokens: list[int], n_out: int) -> int | None:
        """How many of `new_tokens` the scheduler keeps when one of them ends the request."""
        n = len(new_tokens)
        if n_out + n < self.limit and not (
            self.stop_ids and not self.stop_ids.isdisjoint(new_tokens)
        ):
            return None  # the common case: nothing here ends it
        for i, tok in enumerate(new_tokens):
            count = n_out + i + 1
            if count < self.min_tokens:
                continue
            if tok in self.stop_ids or count >= self.limit:
                return i + 1
        return None


@dataclass
class ReqState:
    req_id: str
    prompt_ids: list[int]
    sampling_params: Any
    policy_version: int
    mode: str | None
    stop: StopRule
    outputs: list[int] = field(default_factory=list)
    done: bool = False

    def tokens(self, pos: int, n: int) -> list[int]:
        """Tokens pos .. pos+n-1 of the sequence (prompt + outputs so far)."""
        p = len(self.prompt_ids)
        head = self.prompt_ids[pos : min(pos + n, p)]
        start = max(pos - p, 0)
        return head + self.outputs[start : start + n - len(head)]


@dataclass
class CaptureStats:
    requests_captured: int = 0  # requests whose messages were handed to the publisher
    requests_incomplete: int = 0  # captured requests that could not be sent (see `broken`)
    requests_inconsistent: int = 0  # rows whose token ids disagreed with the sequence (a bug)
    messages_built: int = 0
    steps_lost: int = 0  # steps whose tokens never arrived (given up after MAX_OUT_OF_ORDER)

    def reported(self) -> dict[str, int]:
        """The counters the engines' stats RPC reports."""
        return {
            "requests_captured": self.requests_captured,
            "requests_incomplete": self.requests_incomplete,
            "requests_inconsistent": self.requests_inconsistent,
            "steps_lost": self.steps_lost,
        }


@dataclass
class TapTarget:
    """What every message describes."""

    tap_layers: tuple[int, ...]
    hidden_size: int
    fingerprint: str
    dtype: torch.dtype  # on the wire
    max_model_len: int


# ---------------------------------------------------------------------------- assembly
# A request's rows are views of the steps' arrays until this many have gathered; then they are
# joined into one array of the request's own, so that no step's array is kept alive for long.
MAX_PIECES = 32


@dataclass
class TapBuffer:
    """Captured rows of one request: positions base .. base+length-1 (rows before `base` went
    out in earlier chunks), as pieces: views of the arrays each step's final rows were copied
    into (`ids` [n], `taps` [n, T * H], `last` [n, H]; features as the wire dtype's bits in a
    same-width integer type, numpy having no bf16). Views cost no copy and no release of the
    interpreter lock, which the engine thread wants back at once; the pieces are joined every
    MAX_PIECES steps and when a message is cut. Lives in the assembler thread."""

    state: ReqState
    base: int = 0
    length: int = 0
    ids: list[np.ndarray] = field(default_factory=list)
    taps: list[np.ndarray] = field(default_factory=list)
    last: list[np.ndarray] = field(default_factory=list)
    chunks_sent: int = 0
    broken: str | None = None  # why it cannot be sent

    def put(self, position: int, ids: np.ndarray, taps: np.ndarray, last: np.ndarray) -> None:
        """Rows for positions position .. position+len(ids)-1."""
        n = ids.shape[0]
        end = self.base + self.length
        if position > end:
            self.broken = (
                f"rows {end}..{position - 1} were never computed here (prefix cache hit, or "
                "capture started mid-request)"
            )
            return
        skip = max(self.base - position, 0)  # rows already sent in a chunk
        if skip >= n:
            return
        if position + skip < end:  # recomputed rows (preemption): keep the new ones
            self.truncate(position + skip - self.base)
        self.ids.append(ids[skip:])
        self.taps.append(taps[skip:])
        self.last.append(last[skip:])
        self.length += n - skip
        if len(self.ids) > MAX_PIECES:
            self._join()

    def _join(self) -> None:
        if len(self.ids) > 1:
            self.ids, self.taps, self.last = (
                [np.concatenate(x)] for x in (self.ids, self.taps, self.last)
            )

    def truncate(self, n: int) -> None:
        """Keep the first n buffered rows."""
        if n >= self.length:
            return
        self._join()
        self.ids, self.taps, self.last = (
            [x[0][:n]] if n else [] for x in (self.ids, self.taps, self.last)
        )
        self.length = n

    def take(self, n: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Remove the first n rows; (position, ids, taps, last) of them."""
        self._join()
        (ids,), (taps,), (last,) = self.ids, self.taps, self.last
        pos = self.base
        self.ids, self.taps, self.last = [ids[n:]], [taps[n:]], [last[n:]]
        self.base += n
        self.length -= n
        return pos, ids[:n], taps[:n], last[:n]


@dataclass
class _Rows:
    rows: StagedRows
    items: list[tuple[ReqState, int, int]]  # (request, first row in rows, final rows)


@dataclass
class _Broken:
    state: ReqState
    why: str


@dataclass
class _Finish:
    state: ReqState
    policy_version: int  # the serving policy when the request finished (ids messages)


_DROP_ALL = object()
_STOP = object()


@dataclass
class StepRows:
    """A step's final rows on the host, request after request: `ids` [M], `taps` [M, T * H],
    `last` [M, H] (features as same-width integers); `items` (request, first row, rows, first
    position, whether the positions are consecutive)."""

    ids: np.ndarray
    taps: np.ndarray
    last: np.ndarray
    items: list[tuple[Any, int, int, int, bool]]


def step_rows(op: _Rows, out: tuple[np.ndarray, ...] | None = None) -> StepRows:
    """The final rows of a step, copied once out of what `to_host` left (on a GPU, pinned
    buffers that the next step reuses); into `out` (ids, taps, last; large enough) if given."""
    rows = op.rows
    rows.to_host()
    offsets = np.fromiter((off for _, off, _ in op.items), np.int64, len(op.items))
    counts = np.fromiter((n for _, _, n in op.items), np.int64, len(op.items))
    starts = np.cumsum(counts) - counts  # where each request's rows begin in the result
    m = int(counts.sum())
    index = np.arange(m) + np.repeat(offsets - starts, counts)
    positions = rows.positions.numpy()[index]
    first, last_pos = positions[starts], positions[starts + counts - 1]
    consecutive = (last_pos - first == counts - 1).tolist()
    src = (rows.ids.numpy(), _bits(rows.taps), _bits(rows.last))
    if out is None:
        ids, taps, last = (a[index] for a in src)
    else:
        ids, taps, last = (
            np.take(a, index, axis=0, out=o[:m]) for a, o in zip(src, out, strict=True)
        )
    items = [
        (state, a, n, p, ok)
        for (state, _, n), a, p, ok in zip(
            op.items, starts.tolist(), first.tolist(), consecutive, strict=True
        )
    ]
    return StepRows(ids, taps, last, items)


class Assembler:
    """The assembly thread (see module doc): consumes the bookkeeping's operations in order."""

    def __init__(
        self,
        target: TapTarget,
        emit: Callable[[TapMessage], None],
        draft_version: Callable[[], int],
        max_tokens: int,
        stats: CaptureStats,
        *,
        thread: bool = True,
    ) -> None:
        """With `thread` False nothing runs by itself: the owner calls `apply(op)` (the tap
        process, codraft.server.tap_process, does)."""
        self.target = target
        self.emit = emit
        self.draft_version = draft_version
        self.max_tokens = max_tokens
        self.stats = stats
        self.buffers: dict[int, TapBuffer] = {}  # id(ReqState) -> its rows
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._busy = 0
        if thread:
            self._thread = threading.Thread(target=self._run, name="codraft-capture", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ bookkeeping side
    def put(self, op: Any) -> None:
        with self._idle:
            self._busy += 1
        self._queue.put(op)

    def depth(self) -> int:
        return self._busy

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every operation queued so far is done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is _STOP:
                return
            try:
                self.apply(op)
            except Exception:
                log.exception("codraft capture: assembling a tap message failed (dropped)")
            finally:
                with self._idle:
                    self._busy -= 1
                    if not self._busy:
                        self._idle.notify_all()

    def _buffer(self, state: ReqState) -> TapBuffer:
        buf = self.buffers.get(id(state))
        if buf is None:
            buf = self.buffers[id(state)] = TapBuffer(state)
        return buf

    def apply(self, op: Any) -> None:
        if isinstance(op, _Rows):
            self.store(step_rows(op))
        elif isinstance(op, _Broken):
            self._buffer(op.state).broken = op.why
        elif isinstance(op, _Finish):
            self._finish(op)
        elif op is _DROP_ALL:
            self.buffers.clear()

    def store(self, rows: StepRows) -> None:
        """Keep a step's final rows, and send the chunks of requests that have grown long."""
        ids, taps, last = rows.ids, rows.taps, rows.last
        for state, a, n, p, ok in rows.items:
            buf = self._buffer(state)
            if not ok:
                log.error("codraft capture: %s's rows are not consecutive positions", state.req_id)
                buf.broken = "non-consecutive positions in one step"
                continue
            buf.put(p, ids[a : a + n], taps[a : a + n], last[a : a + n])
            if not state.done and buf.length >= self.max_tokens:
                self._send_chunks(buf)

    def _send_chunks(self, buf: TapBuffer) -> None:
        if buf.broken:
            return
        while buf.length >= self.max_tokens:
            pos, ids, taps, last = buf.take(self.max_tokens)
            self._emit(buf.state, pos, ids, (taps, last), buf.chunks_sent)
            buf.chunks_sent += 1

    def _finish(self, op: _Finish) -> None:
        state = op.state
        buf = self.buffers.pop(id(state), None)
        if state.mode == "ids":
            self._send_ids(state, op.policy_version)
            self.stats.requests_captured += 1
            return
        if buf is None or buf.broken:
            self.stats.requests_incomplete += 1
            why = buf.broken if buf is not None else "none of its rows were captured"
            log.debug("tap capture of %s not sent: %s", state.req_id, why)
            return
        final_len = len(state.prompt_ids) + len(state.outputs)
        if buf.base + buf.length < final_len - 1:  # every input of the final sequence, or none
            self.stats.requests_incomplete += 1
            log.debug("tap capture of %s not sent: rows %d..%d were never captured",
                      state.req_id, buf.base + buf.length, final_len - 2)  # fmt: skip
            return
        buf.truncate(max(final_len - 1 - buf.base, 0))
        pieces = []
        while buf.length > 0:
            pieces.append(buf.take(min(self.max_tokens, buf.length)))
        chunked = buf.chunks_sent > 0 or len(pieces) > 1
        for pos, ids, taps, last in pieces:
            chunk = buf.chunks_sent if chunked else None
            self._emit(state, pos, ids, (taps, last), chunk)
            buf.chunks_sent += 1
        self.stats.requests_captured += 1

    def _send_ids(self, state: ReqState, policy_version: int) -> None:
        seq = state.prompt_ids + state.outputs
        pieces = range(0, len(seq), self.max_tokens)
        for i, pos in enumerate(pieces):
            ids = np.asarray(seq[pos : pos + self.max_tokens], dtype=np.int32)
            chunk = i if len(pieces) > 1 else None
            self._emit(state, pos, ids, None, chunk, policy_version)

    def _emit(
        self,
        state: ReqState,
        pos: int,
        ids: np.ndarray,
        feats: tuple[np.ndarray, np.ndarray] | None,  # (taps [n, T * H], last [n, H]) bits
        chunk: int | None,
        policy_version: int | None = None,
    ) -> None:
        n = ids.shape[0]
        if not np.array_equal(ids, state.tokens(pos, n)):
            self.stats.requests_inconsistent += 1
            log.error(
                "tap capture of %s: token ids of rows %d..%d disagree with the sequence; not sent",
                state.req_id,
                pos,
                pos + n - 1,
            )
            return
        taps = last = None
        if feats is not None:  # views of the request's buffer: the frames are sent from them
            taps, last = (torch.from_numpy(f).view(self.target.dtype) for f in feats)
        prompt_len = min(max(len(state.prompt_ids) - pos, 0), n)
        t = self.target
        msg = TapMessage.build(
            torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32)),
            taps=taps,
            last_hidden=last,
            tap_layers=t.tap_layers,
            prompt_len=prompt_len,
            hidden_size=t.hidden_size,
            dtype=_dtype_name(t.dtype),
            request_id=state.req_id if chunk is None else f"{state.req_id}#{chunk}",
            fingerprint=t.fingerprint,
            policy_version=state.policy_version if policy_version is None else policy_version,
            draft_version=self.draft_version(),
        )
        self.stats.messages_built += 1
        self.emit(msg)


# ---------------------------------------------------------------------------- bookkeeping
class Capture:
    """Per-request bookkeeping, in step order, feeding the assembler (see module doc).

    Engine thread: `new_requests(scheduler_output)` (whether and how each new request is
    captured: `want(req_id)` -> "full" | "ids" | None), `finished_now(req_ids)`,
    `rows_wanted(slices)`, `drop_all()`. Delivering side: `on_step(record, sampled)`, which
    also calls `per_step(record, sampled)` in step order (acceptance accounting).
    `draft_version()` gives the serving draft version; `on_finished(req_id)` is told when a
    request finishes."""

    def __init__(
        self,
        target: TapTarget,
        *,
        want: Callable[[str], str | None],
        emit: Callable[[TapMessage], None],
        draft_version: Callable[[], int],
        on_finished: Callable[[str], None],
        per_step: Callable[[StepRecord, list[list[int]] | None], None] = lambda r, s: None,
        max_tokens: int = 8192,
        assembler: Callable[..., Any] | None = None,
    ) -> None:
        """`assembler`: what assembles (default: an Assembler thread here; codraft.server.
        tap_process.TapProcess assembles in a process of its own), called as Assembler is."""
        self.target = target
        self.want = want
        self.draft_version = draft_version
        self.on_finished = on_finished
        self.per_step = per_step
        self.stats = CaptureStats()
        make = assembler or Assembler
        self.assembler = make(target, emit, draft_version, max_tokens, self.stats)
        self.states: dict[str, ReqState] = {}  # delivering side
        self._full: set[str] = set()  # engine thread: requests whose rows are gathered
        self._drop = False
        self._policy = 0  # the policy version of the latest step
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, tuple[StepRecord, list[list[int]] | None]] = {}

    # ------------------------------------------------------------------ engine thread
    def new_requests(self, scheduler_output: Any) -> list[NewRequest]:
        out = []
        for req in scheduler_output.scheduled_new_reqs or ():
            prompt = getattr(req, "prompt_token_ids", None)
            sp = getattr(req, "sampling_params", None)
            if prompt is None or sp is None:
                continue  # prompt embeddings or pooling: nothing codraft can capture
            mode = self.want(req.req_id)
            if mode == "full":
                self._full.add(req.req_id)
            out.append(NewRequest(req.req_id, list(prompt), sp, mode))
        return out

    def finished_now(self, req_ids: Any) -> None:
        self._full.difference_update(req_ids)

    def rows_wanted(self, slices: list) -> list[int]:
        full = self._full
        return [i for i, s in enumerate(slices) if s.req_id in full] if full else []

    def drop_all(self) -> None:
        """Forget every in-progress capture (the tap was turned off or reconfigured)."""
        self._full.clear()
        self._drop = True

    def running(self) -> list[str]:
        """Ids of the requests seen and not finished."""
        return [rid for rid, st in list(self.states.items()) if not st.done]

    def flush(self, timeout: float = 10.0) -> bool:
        return self.assembler.flush(timeout)

    def close(self) -> None:
        self.assembler.close()

    # ------------------------------------------------------------------ delivering side
    def on_step(self, record: StepRecord, sampled: list[list[int]] | None) -> None:
        """A step's tokens (None: it produced none); records may come out of order."""
        with self._lock:
            self._waiting[record.seq] = (record, sampled)
            while True:
                item = self._waiting.pop(self._next, None)
                if item is None:
                    if len(self._waiting) <= MAX_OUT_OF_ORDER:
                        return
                    log.warning("codraft capture: step %d never delivered; skipping", self._next)
                    self.stats.steps_lost += 1
                    self._next += 1
                    continue
                self._next += 1
                self.per_step(*item)
                self._step(*item)

    def _step(self, record: StepRecord, sampled: list[list[int]] | None) -> None:
        ctx: StepContext | None = record.context
        if self._drop:
            self._drop = False
            for st in self.states.values():
                st.mode = None
            self.assembler.put(_DROP_ALL)
        if ctx is not None:
            self._policy = ctx.policy_version
            for rid in ctx.finished:
                st = self.states.pop(rid, None)
                if st is not None and not st.done:
                    self._finish(st)
            for new in ctx.new:
                if new.req_id not in self.states:  # a resumed request keeps its state
                    rule = StopRule.of(
                        new.sampling_params, len(new.prompt_ids), self.target.max_model_len
                    )
                    self.states[new.req_id] = ReqState(
                        new.req_id, new.prompt_ids, new.sampling_params, ctx.policy_version,
                        new.mode, rule,
                    )  # fmt: skip
        if sampled is None:
            return
        rows: list[tuple[ReqState, int, int]] = []
        ended: list[ReqState] = []
        states = self.states
        for i, (s, toks) in enumerate(zip(record.slices, sampled, strict=True)):
            st = states.get(s.req_id)
            if st is None or st.done:
                continue
            n_final = hooks.final_rows(s, toks)
            if st.mode == "full" and n_final > 0:
                offset = record.row_offsets.get(i)
                if offset is None or record.rows is None:
                    self.assembler.put(_Broken(st, "its rows were not captured in a step"))
                elif ctx is not None and ctx.policy_version != st.policy_version:
                    self.assembler.put(_Broken(st, "the policy changed while the request ran"))
                else:
                    rows.append((st, offset, n_final))
            if toks:
                keep = st.stop.keep(toks, len(st.outputs))
                st.outputs.extend(toks if keep is None else toks[:keep])
                if keep is not None:
                    st.done = True
                    ended.append(st)
        if rows:
            self.assembler.put(_Rows(record.rows, rows))
        for st in ended:
            self._finish(st)

    def _finish(self, st: ReqState) -> None:
        st.done = True
        try:
            if st.mode is not None:
                self.assembler.put(_Finish(st, self._policy))
        finally:
            self.on_finished(st.req_id)


_BITS = {2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor's elements as a numpy array of same-width integers (numpy has no bf16)."""
    return t.view(_BITS[t.element_size()]).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
