"""SGLang's steps as codraft's capture sees them: which rows of a batch are final, per request.

SGLang (0.5.17, its EAGLE worker v2) runs two kinds of target forward with the draft's tap
layers captured (docs/sglang.md; checked on an H200 by scripts/gpu_sglang/capture_probe.py):

* an **extend** (a prefill, possibly one chunk of it) over `extend_lens[i]` new tokens of each
  request i, request after request: every row is final;
* a **verification** of `k` rows per request (its last token, then k - 1 drafts), of which the
  first `accept_lens[i]` are final: SGLang's own count of the tokens the step adds (1 + accepted
  drafts) is the count of inputs that belong to the final sequence.

`SGLangCapture` turns those facts into the operations of codraft's assembler
(`codraft.server.capture.Assembler`: a step's rows staged by `codraft.server.row_copy`, each
request's first row and final row count; a request's finish with SGLang's own output tokens),
so the assembly, chunking of long requests, the check of every row's token id against the
final sequence and the message format are the ones codraft's vLLM engine uses. The hooks that
read these facts from SGLang's objects in its scheduler process are the GPU side, built on this.

A request whose first rows were never computed here (a radix-cache hit), whose last rows never
arrived, or whose policy changed while it ran is not sent and is counted as incomplete, as with
vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from codraft.server.capture import ReqState, StopRule, _Broken, _Finish, _Rows
from codraft.server.row_copy import StagedRows

# SGLang decides when a request ends and hands its output tokens over at the finish: the
# assembler never needs codraft's own stop rule here
NO_STOP = StopRule(frozenset(), 0, 1 << 62)


@dataclass
class Step:
    """One target forward of a batch: its requests in batch order, the rows each has in it
    (extend lengths, or k each), how many of those are final (the same, or SGLang's accepted
    lengths), the tokens the step added to each (the first token after a prefill; a
    verification's accepted drafts and bonus token; none for a chunk that is not the last), the
    rows staged from the device, or None, and which requests (indices) those rows are of, in
    batch order (None: all of them; `SGLangCapture.rows_wanted` names the ones worth staging)."""

    rids: list[str]
    counts: list[int]
    final: list[int]
    new_tokens: list[list[int]]
    rows: StagedRows | None = None
    staged: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.rids)
        if not (len(self.counts) == len(self.final) == len(self.new_tokens) == n):
            raise ValueError(
                f"a step of {n} requests needs that many counts, final counts and token lists; "
                f"got {len(self.counts)}, {len(self.final)}, {len(self.new_tokens)}"
            )
        rows = zip(self.rids, self.final, self.counts, strict=True)
        bad = [(r, f, c) for r, f, c in rows if not 0 <= f <= c]
        if bad:
            raise ValueError(f"final rows must be within each request's rows: {bad[:3]}")
        if self.staged is not None and sorted(set(self.staged)) != self.staged:
            raise ValueError(f"staged must be increasing request indices, got {self.staged}")
        if self.staged and not 0 <= self.staged[0] <= self.staged[-1] < n:
            raise ValueError(f"staged names requests outside the step's {n}: {self.staged}")
        expected = sum(self.counts[i] for i in self.staged_indices())
        if self.rows is not None and self.rows.ids.shape[0] != expected:
            raise ValueError(
                f"{self.rows.ids.shape[0]} staged rows for {expected} rows of the staged requests"
            )

    def staged_indices(self) -> list[int] | range:
        return range(len(self.rids)) if self.staged is None else self.staged


class SGLangCapture:
    """Per-request bookkeeping for SGLang, feeding codraft's assembler (module doc). Called in
    step order from one thread (the scheduler's)."""

    def __init__(
        self,
        assembler: Any,
        *,
        want: Callable[[str], str | None],
        policy_version: Callable[[], int],
    ) -> None:
        """`want(rid)` says whether and how a new request is captured ("full", "ids", None);
        `policy_version()` the serving policy's version."""
        self.assembler = assembler
        self.want = want
        self.policy_version = policy_version
        self.states: dict[str, ReqState] = {}

    def begin(self, rid: str, prompt_ids: list[int]) -> None:
        """A request the scheduler took in (before its first extend)."""
        self.states[rid] = ReqState(
            rid, list(prompt_ids), None, self.policy_version(), self.want(rid), NO_STOP
        )

    def step(self, step: Step) -> None:
        policy = self.policy_version()
        items: list[tuple[ReqState, int, int]] = []
        staged = set(step.staged_indices())
        offset = 0
        for i, (rid, count, final, toks) in enumerate(
            zip(step.rids, step.counts, step.final, step.new_tokens, strict=True)
        ):
            state = self.states.get(rid)
            if state is not None and not state.done:
                if state.mode == "full" and final:
                    if state.policy_version != policy:
                        self.assembler.put(_Broken(state, "the policy changed while it ran"))
                    elif step.rows is None or i not in staged:
                        self.assembler.put(_Broken(state, "its rows were not captured in a step"))
                    else:
                        items.append((state, offset, final))
                state.outputs.extend(toks)
            if i in staged:
                offset += count
        if items:
            self.assembler.put(_Rows(step.rows, items))

    def finish(self, rid: str, output_ids: list[int]) -> None:
        """The request ended with these output tokens (SGLang's, authoritative)."""
        state = self.states.pop(rid, None)
        if state is None or state.done:
            return
        state.outputs = list(output_ids)
        state.done = True
        if state.mode is not None:
            self.assembler.put(_Finish(state, self.policy_version()))

    def rows_wanted(self, rids: list[str]) -> list[int]:
        """Which requests of a batch (indices) want their rows staged."""
        states = self.states
        return [i for i, r in enumerate(rids) if (s := states.get(r)) and s.mode == "full"]
