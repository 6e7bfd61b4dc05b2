"""Microbatches of a packed batch for the pipeline: whole documents, contiguous, balanced by tokens.

Attention never crosses a document, so a microbatch made of whole documents computes exactly what
the full batch computes for those tokens; the plan depends on the batch alone, so every stage
derives the same one locally and no shapes need to travel.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from codraft.learner.data.packing import PackedBatch


def plan_microbatches(doc_tokens: list[int], n: int) -> list[range]:
    """Split documents (their padded token counts, in order) into min(n, len(docs)) contiguous,
    non-empty groups with token totals as even as whole documents allow. Returns doc ranges."""
    if n < 1:
        raise ValueError(f"the number of microbatches must be >= 1, got {n}")
    if not doc_tokens:
        raise ValueError("cannot plan microbatches for a batch without documents")
    n = min(n, len(doc_tokens))
    total = sum(doc_tokens)
    cuts, acc, k = [0], 0, 1
    for i, t in enumerate(doc_tokens):
        acc += t
        left_docs = len(doc_tokens) - (i + 1)
        left_groups = n - k
        if k < n and (acc * n >= k * total or left_docs == left_groups) and left_docs > 0:
            cuts.append(i + 1)
            k += 1
    cuts.append(len(doc_tokens))
    return [range(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def slice_docs(batch: PackedBatch, docs: range) -> PackedBatch:
    """The documents `docs` of a packed batch as a batch of their own (cu_seqlens from 0)."""
    cu = batch.cu_seqlens
    a, b = int(cu[docs.start]), int(cu[docs.stop])

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[a:b]

    return replace(
        batch,
        input_ids=batch.input_ids[a:b],
        positions=batch.positions[a:b],
        cu_seqlens=cu[docs.start : docs.stop + 1] - cu[docs.start],
        loss_mask=batch.loss_mask[a:b],
        doc_lens=batch.doc_lens[docs.start : docs.stop],
        taps=rows(batch.taps),
        last_hidden=rows(batch.last_hidden),
        teacher_logits=rows(batch.teacher_logits),
        request_ids=batch.request_ids[docs.start : docs.stop],
        cursor=batch.cursor if docs.stop == batch.num_docs else None,
    )


def split_batch(batch: PackedBatch, n: int) -> list[PackedBatch]:
    """`batch` as min(n, num_docs) microbatches of whole documents (see `plan_microbatches`)."""
    plan = plan_microbatches(batch.padded_lens.tolist(), n)
    return [slice_docs(batch, docs) for docs in plan]
