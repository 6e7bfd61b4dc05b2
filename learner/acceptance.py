"""Offline acceptance estimate: the mean accepted length of chain drafting under greedy
verification, from a draft, a target and sequences the target produced greedily.

For a sequence of prompt length P and length L (x[P..L-1] the target's greedy continuation),
generation emits x[P] from prefill; then each verification step at anchor i (the last emitted
position minus one) lets the draft propose k tokens by chaining its own outputs, accepts the
longest prefix equal to the target's tokens x[i+2..], and emits it plus one bonus token. Pass d
of a teacher-forced TTT forward at anchor i predicts x[i+d+1] from exactly the inputs chain
drafting would have fed it whenever passes 1..d-1 were right, so the walk below reproduces the
steps vLLM would take, without running vLLM. Acceptance length = tokens emitted / steps (what
vLLM reports as 1 + accepted / drafts).

A DFlash draft proposes its k tokens at once: at anchor i its block holds x[i+1] and k mask
slots at positions i+2.., over the context x[..i], and slot d proposes x[i+d+1]. A proposal
counts only when the slots before it won too (the walk stops at the first miss), so the block of
the training forward at anchor i is exactly the one vLLM would draft there. A DSpark draft's
block holds x[i+1] and noise at positions i+1.., and slot d - 1 proposes x[i+d+1] with the
Markov bias of the token before it: vLLM's own proposal there while the walk goes on, the true
token x[i+d] in the teacher-forced forward, the same token whenever the proposal counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from codraft.draft.dflash import DFlashDraft
from codraft.draft.model import Eagle3Draft
from codraft.learner.attention.block_draft import block_draft_attention
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.data.packing import PackedBatch, Sample, pack
from codraft.learner.teacher import Teacher
from codraft.learner.ttt import draft_states


@dataclass
class AcceptanceReport:
    k: int
    steps: int = 0
    emitted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # steps whose d-th proposal won
    sequences: int = 0

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def to_dict(self) -> dict:
        return {
            "k": self.k,
            "steps": self.steps,
            "emitted": self.emitted,
            "sequences": self.sequences,
            "acceptance_length": self.acceptance_length,
            "accepted_per_pos": self.accepted_per_pos,
        }


def walk(hits: torch.Tensor, prompt_len: int, length: int, report: AcceptanceReport) -> None:
    """Greedy verification steps over one sequence. hits [k, length] bool: hits[d-1, i] is
    True when pass d at anchor i proposes x[i+d+1]."""
    k = hits.shape[0]
    i = prompt_len - 1  # x[P] came from prefill; the first step drafts x[P+1..]
    while i + 2 <= length - 1:
        remaining = length - 1 - (i + 1)  # tokens still to emit: x[i+2..L-1]
        accepted = 0
        while accepted < min(k, remaining) and bool(hits[accepted, i]):
            accepted += 1
        for d in range(accepted):
            report.accepted_per_pos[d] += 1
        emitted = min(accepted + 1, remaining)
        report.steps += 1
        report.emitted += emitted
        i += emitted


def prompt_length(sample: Sample) -> int:
    """Leading tokens a sample does not learn on (its prompt, as captured by the server)."""
    on = torch.nonzero(sample.loss_mask).flatten()
    return int(on[0]) if len(on) else len(sample)


def _chain_hits(draft: Eagle3Draft, packed: PackedBatch, k: int) -> torch.Tensor:
    """hits [k, n]: pass d at anchor i (teacher-forced TTT) proposes x[i+d+1]."""
    ids, n = packed.input_ids, packed.input_ids.shape[0]
    to_target = draft.draft_to_target_ids().to(ids.device)
    hits = torch.zeros(k, n, dtype=torch.bool, device=ids.device)
    passes = draft_states(
        draft, ids, packed.positions, packed.cu_seqlens, packed.taps, pass_attention, k
    )
    for d, h in passes:
        pred = to_target[draft.logits(h).argmax(-1)]
        idx = torch.arange(n, device=ids.device) + d + 1
        hits[d - 1] = pred == ids[idx.clamp(max=n - 1)]
    return hits


def _block_hits(draft: DFlashDraft, packed: PackedBatch, k: int, chunk: int = 1024) -> torch.Tensor:
    """hits [k, n]: proposal d of the block anchored after position i proposes x[i+d+1] (the
    logits a chunk of rows at a time: the head is the target's whole vocabulary)."""
    ids, cu = packed.input_ids, packed.cu_seqlens
    have = draft.config.proposals
    if k > have:
        raise ValueError(
            f"k={k} proposals, but the {draft.config.kind} draft's blocks of "
            f"{draft.config.block_size} make {have}: estimate with k <= {have}"
        )

    def attn(q, kc, vc, kb, vb):
        return block_draft_attention(q, kc, vc, kb, vb, cu)

    h, source = draft.hidden(ids, packed.taps, cu, attn)
    h, predicted = draft.proposals(h, source, cu)
    n = ids.shape[0]
    hits = torch.zeros(k, n, dtype=torch.bool, device=ids.device)
    for d in range(k):
        for a in range(0, n, chunk):
            at = predicted[d, a : a + chunk]
            want = ids[at.clamp(min=0)]
            previous = ids[(at - 1).clamp(min=0)]
            pred = draft.readout(h[d, a : a + chunk], previous).argmax(-1)
            hits[d, a : a + chunk] = (at >= 0) & (pred == want)
    return hits


@torch.no_grad()
def estimate_acceptance(
    draft: Eagle3Draft | DFlashDraft,
    teacher: Teacher | None,
    sequences: Sequence[tuple[torch.Tensor, int] | Sample],
    k: int = 3,
    token_budget: int = 8192,
) -> AcceptanceReport:
    """sequences: (token ids [L], prompt length P) with x[P:] the target's output, or captured
    Samples (their taps are used; the prompt is where the loss mask starts). The walk is exact
    for greedy output; for sampled output it counts proposals equal to the sampled tokens.
    `teacher` (recompute mode) runs the target for sequences that carry no taps."""
    report = AcceptanceReport(k=k, accepted_per_pos=[0] * k)
    was_training = draft.training
    draft.eval()
    device = teacher.device if teacher is not None else draft.fc.weight.device
    hits_of = _block_hits if isinstance(draft, DFlashDraft) else _chain_hits
    batch: list[tuple[Sample, int]] = []

    def run(items: list[tuple[Sample, int]]) -> None:
        packed = pack([s for s, _ in items]).to(device)
        if packed.taps is None:
            if teacher is None:
                raise ValueError("sequences without taps need a recompute-mode teacher")
            packed = teacher.fill(packed, draft.config.tap_layers)
        hits = hits_of(draft, packed, k)  # type: ignore[arg-type]
        cu = packed.cu_seqlens.tolist()
        for j, (tokens, prompt_len) in enumerate(items):
            a = cu[j]
            walk(hits[:, a : a + len(tokens)].cpu(), prompt_len, len(tokens), report)
            report.sequences += 1

    for item in sequences:
        if isinstance(item, Sample):
            sample, prompt_len = item, prompt_length(item)
        else:
            ids, prompt_len = item
            sample = Sample(torch.as_tensor(ids, dtype=torch.int64))
        if len(sample) <= prompt_len + 1:
            continue
        if batch and sum(len(s) for s, _ in batch) + len(sample) > token_budget:
            run(batch)
            batch = []
        batch.append((sample, int(prompt_len)))
    if batch:
        run(batch)
    draft.train(was_training)
    return report
