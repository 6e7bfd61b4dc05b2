"""Decode-time capture: the target's tap features of every token that becomes final.

The step records come from server.hooks. Which rows are final: a request scheduled with n tokens
of which k are draft proposals, and whose verification returned a + 1 tokens (a accepted drafts
+ the bonus/correction token), has final rows 0 .. n-k+a-1 (the inputs up to and including the
last accepted draft); the k-a rejected proposals are dropped. Prefill chunks and plain decode
steps (k = 0) are final entirely. A token's features come from the forward in which it is the
INPUT, so a sampled token's features arrive one step later, and the very last token of a request
never has any: a "full" message covers the final sequence minus its last token (T = prompt +
output - 1 rows, every row with features); an "ids" message covers the whole final sequence.

Requests are assembled by request id (rows keyed by position, so a preempted and recomputed
request overwrites its rows), sent when they finish, and in chunks of `max_tokens` rows while
running when they are long (chunk ids "<request id>#<i>", i = 0, 1, ...; each chunk's prompt_len
counts the prompt tokens inside it). A request is finished when vLLM's stop rule (EOS, stop token
ids, max_tokens, max_model_len; the order of the scheduler's check_stop) says so - then it is
sent in the same step - or when the scheduler lists it in `finished_req_ids` (aborts, stop
strings). Loss mask: 0 on prompt tokens, 1 on generated ones. In "full" mode a request whose
first rows were never computed here (a prefix-cache hit, or hooks installed mid-request) or whose
policy changed mid-request is not sent and is counted as incomplete: run the engine without
prefix caching when the tap is on in "full" mode. Every message's token ids are checked against
the request's sequence before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from codraft.tap.message import TapMessage
from server.hooks import StepRecord

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- stop rule
def stop_after(
    new_tokens: list[int], n_out: int, prompt_len: int, sp: Any, max_model_len: int
) -> int | None:
    """How many of `new_tokens` the scheduler keeps when one of them ends the request (else
    None): vLLM's check_stop per token, in its order (EOS, stop token ids, length)."""
    eos = getattr(sp, "eos_token_id", None)
    stops = set(getattr(sp, "stop_token_ids", None) or ())
    max_tokens = getattr(sp, "max_tokens", None)
    for i, tok in enumerate(new_tokens):
        n = n_out + i + 1
        if (eos is not None and tok == eos) or tok in stops:
            return i + 1
        if prompt_len + n >= max_model_len or (max_tokens is not None and n >= max_tokens):
            return i + 1
    return None


# ---------------------------------------------------------------------------- requests
@dataclass
class TapBuffer:
    """Captured rows of one request: positions base .. base+length-1 (rows before `base` went
    out in earlier chunks)."""

    mode: str  # "full" | "ids"
    base: int = 0
    length: int = 0
    ids: list[torch.Tensor] = field(default_factory=list)
    taps: list[torch.Tensor] = field(default_factory=list)
    last: list[torch.Tensor] = field(default_factory=list)
    chunks_sent: int = 0
    broken: str | None = None  # why it cannot be sent

    def put(self, position: int, ids: torch.Tensor, taps: torch.Tensor, last: torch.Tensor) -> None:
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

    def truncate(self, n: int) -> None:
        """Keep the first n buffered rows."""
        if n >= self.length:
            return
        self.ids = [torch.cat(self.ids)[:n]] if n else []
        self.taps = [torch.cat(self.taps)[:n]] if n else []
        self.last = [torch.cat(self.last)[:n]] if n else []
        self.length = n

    def take(self, n: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Remove and return the first n rows as (position, ids, taps, last)."""
        ids, taps, last = torch.cat(self.ids), torch.cat(self.taps), torch.cat(self.last)
        pos = self.base
        self.ids, self.taps, self.last = [ids[n:]], [taps[n:]], [last[n:]]
        self.base += n
        self.length -= n
        return pos, ids[:n], taps[:n], last[:n]


@dataclass
class ReqState:
    req_id: str
    prompt_ids: list[int]
    sampling_params: Any
    policy_version: int
    outputs: list[int] = field(default_factory=list)
    tap: TapBuffer | None = None
    done: bool = False


@dataclass
class CaptureStats:
    requests_captured: int = 0  # requests whose messages were handed to the publisher
    requests_incomplete: int = 0  # captured requests that could not be sent (see `broken`)
    requests_inconsistent: int = 0  # rows whose token ids disagreed with the sequence (a bug)
    messages_built: int = 0


@dataclass
class TapTarget:
    """What every message describes."""

    tap_layers: tuple[int, ...]
    hidden_size: int
    fingerprint: str
    dtype: torch.dtype  # on the wire
    max_model_len: int


class Capture:
    """Per-request assembly of final rows into tap messages (see module doc).

    `want(req_id)` -> "full" | "ids" | None decides at a request's first sight whether and how it
    is captured; `emit(msg)` hands a finished message on; `versions()` gives the current
    (policy, draft) versions; `on_finished(req_id)` is told when a request finishes."""

    def __init__(
        self,
        target: TapTarget,
        *,
        want: Callable[[str], str | None],
        emit: Callable[[TapMessage], None],
        versions: Callable[[], tuple[int, int]],
        on_finished: Callable[[str], None],
        max_tokens: int = 8192,
        requests: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.target = target
        self.want = want
        self.emit = emit
        self.versions = versions
        self.on_finished = on_finished
        self.max_tokens = max_tokens
        self.runner_requests = requests
        self.states: dict[str, ReqState] = {}
        self.stats = CaptureStats()

    # ------------------------------------------------------------------ engine events
    def on_step(self, record: StepRecord, sampled: list[list[int]]) -> None:
        full_rows: list[tuple[ReqState, int, int, int]] = []  # state, flat start, count, pos
        for s, toks in zip(record.slices, sampled, strict=True):
            state = self.states.get(s.req_id) or self._new_state(s.req_id, len(toks))
            if state is None or state.done:
                continue
            n_final = s.final_rows(toks)
            if state.tap is not None and state.tap.mode == "full" and n_final > 0:
                if record.input_ids is None:
                    state.tap.broken = "the step ran on input embeddings, not token ids"
                elif state.policy_version != self.versions()[0]:
                    state.tap.broken = "the policy changed while the request ran"
                else:
                    full_rows.append((state, s.start, n_final, s.position))
        if full_rows:
            self._put_rows(record, full_rows)
        for s, toks in zip(record.slices, sampled, strict=True):
            state = self.states.get(s.req_id)
            if state is None or state.done or not toks:
                continue
            keep = stop_after(
                toks,
                len(state.outputs),
                len(state.prompt_ids),
                state.sampling_params,
                self.target.max_model_len,
            )
            state.outputs.extend(toks if keep is None else toks[:keep])
            if keep is not None:
                self._finish(state)
            else:
                self._send_full_chunks(state)

    def finished(self, req_ids: set[str] | list[str]) -> None:
        """The scheduler reports these requests finished (aborted ones included)."""
        for rid in req_ids:
            state = self.states.pop(rid, None)
            if state is not None and not state.done:
                self._finish(state)

    def drop_all(self) -> None:
        """Forget every in-progress capture (the tap was turned off or reconfigured)."""
        for state in self.states.values():
            state.tap = None

    # ------------------------------------------------------------------ internals
    def _new_state(self, req_id: str, sampled_now: int) -> ReqState | None:
        req = self.runner_requests().get(req_id)
        if req is None or req.prompt_token_ids is None or req.sampling_params is None:
            return None  # prompt embeddings or pooling: nothing codraft can capture
        state = ReqState(
            req_id, list(req.prompt_token_ids), req.sampling_params, self.versions()[0]
        )
        # The runner has already appended this step's tokens; on_step adds them again. Earlier
        # outputs exist only when the request was first seen mid-way.
        prior = list(req.output_token_ids)
        state.outputs = prior[: max(len(prior) - sampled_now, 0)]
        mode = self.want(req_id)
        if mode is not None:
            state.tap = TapBuffer(mode)
        self.states[req_id] = state
        return state

    def _put_rows(self, record: StepRecord, rows: list[tuple[ReqState, int, int, int]]) -> None:
        device = record.last_hidden.device
        index = torch.cat(
            [torch.arange(start, start + n, device=device) for _, start, n, _ in rows]
        )
        dtype = self.target.dtype
        ids = record.input_ids[index].to("cpu", torch.int32)
        taps = torch.cat([t[index] for t in record.taps], dim=-1).to("cpu", dtype)
        last = record.last_hidden[index].to("cpu", dtype)
        counts = [n for _, _, n, _ in rows]
        for (state, _, _, pos), i, t, h in zip(
            rows, ids.split(counts), taps.split(counts), last.split(counts), strict=True
        ):
            state.tap.put(pos, i, t, h)

    def _send_full_chunks(self, state: ReqState) -> None:
        tap = state.tap
        if tap is None or tap.mode != "full" or tap.broken:
            return
        while tap.length >= self.max_tokens:
            pos, ids, taps, last = tap.take(self.max_tokens)
            self._emit(state, pos, ids, taps, last, chunk=tap.chunks_sent)
            tap.chunks_sent += 1

    def _finish(self, state: ReqState) -> None:
        state.done = True
        try:
            tap = state.tap
            if tap is None:
                return
            if tap.broken:
                self.stats.requests_incomplete += 1
                log.debug("tap capture of %s not sent: %s", state.req_id, tap.broken)
                return
            if tap.mode == "ids":
                self._send_ids(state)
            else:
                self._send_full_rest(state)
            self.stats.requests_captured += 1
        finally:
            state.tap = None
            self.on_finished(state.req_id)

    def _send_full_rest(self, state: ReqState) -> None:
        tap = state.tap
        final_len = len(state.prompt_ids) + len(state.outputs)
        tap.truncate(max(final_len - 1 - tap.base, 0))
        pieces = []
        while tap.length > 0:
            pieces.append(tap.take(min(self.max_tokens, tap.length)))
        chunked = tap.chunks_sent > 0 or len(pieces) > 1
        for pos, ids, taps, last in pieces:
            self._emit(state, pos, ids, taps, last, chunk=tap.chunks_sent if chunked else None)
            tap.chunks_sent += 1

    def _send_ids(self, state: ReqState) -> None:
        seq = state.prompt_ids + state.outputs
        pieces = range(0, len(seq), self.max_tokens)
        for i, pos in enumerate(pieces):
            ids = torch.tensor(seq[pos : pos + self.max_tokens], dtype=torch.int32)
            self._emit(state, pos, ids, None, None, chunk=i if len(pieces) > 1 else None)

    def _emit(
        self,
        state: ReqState,
        pos: int,
        ids: torch.Tensor,
        taps: torch.Tensor | None,
        last: torch.Tensor | None,
        chunk: int | None,
    ) -> None:
        seq = state.prompt_ids + state.outputs
        want = torch.tensor(seq[pos : pos + ids.shape[0]], dtype=torch.int32)
        if not torch.equal(ids, want):
            self.stats.requests_inconsistent += 1
            log.error(
                "tap capture of %s: token ids of rows %d..%d disagree with the sequence; not sent",
                state.req_id,
                pos,
                pos + ids.shape[0] - 1,
            )
            return
        prompt_len = min(max(len(state.prompt_ids) - pos, 0), ids.shape[0])
        policy, draft = self.versions()
        t = self.target
        msg = TapMessage.build(
            ids,
            taps=taps,
            last_hidden=last,
            tap_layers=t.tap_layers,
            prompt_len=prompt_len,
            hidden_size=t.hidden_size,
            dtype=_dtype_name(t.dtype),
            request_id=state.req_id if chunk is None else f"{state.req_id}#{chunk}",
            fingerprint=t.fingerprint,
            policy_version=state.policy_version if taps is not None else policy,
            draft_version=draft,
        )
        self.stats.messages_built += 1
        self.emit(msg)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
