"""Hand an ids-only packed batch from the rank that reads the data to every stage of its pipeline.

In recompute mode one rank per pipeline (the last stage, which owns the trainer and its data
position) reads and packs the data; every stage needs the token ids' layout (stage 0 the ids,
all of them positions and document boundaries). Two broadcasts over the pipeline's group: a
3-integer header (is there a batch, tokens, documents), then one int64 tensor holding ids,
positions, loss mask, cu_seqlens and document lengths. `None` is the stop signal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from codraft.learner.data.packing import PackedBatch


def broadcast_batch(
    batch: PackedBatch | None,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
) -> PackedBatch | None:
    """On `src` pass the batch (or None to stop everyone); elsewhere pass None. Returns the
    batch (ids, positions, cu_seqlens, loss_mask, doc_lens; no features) on every rank, or
    None on every rank when `src` sent the stop signal. Collective over `group`; `device` is
    where the broadcast buffers live (the rank's GPU on NCCL)."""
    device = torch.device(device)
    me = dist.get_rank()
    header = torch.zeros(3, dtype=torch.int64, device=device)
    if me == src and batch is not None:
        header[:] = torch.tensor([1, batch.num_tokens, batch.num_docs])
    dist.broadcast(header, src=src, group=group)
    has, n, docs = header.tolist()
    if not has:
        return None
    if me == src:
        body = int_body(batch).to(device)
    else:
        body = torch.empty(int_body_size(n, docs), dtype=torch.int64, device=device)
    dist.broadcast(body, src=src, group=group)
    if me == src:
        return batch
    return from_int_body(body, n, docs)


def int_body(batch: PackedBatch) -> torch.Tensor:
    """A batch's ids, positions, loss mask, cu_seqlens and document lengths in one int64 tensor
    (what crosses between ranks; `from_int_body` takes it apart)."""
    return torch.cat(
        [batch.input_ids.long(), batch.positions.long(), batch.loss_mask.long(),
         batch.cu_seqlens.long(), batch.doc_lens.long()]
    )  # fmt: skip


def int_body_size(tokens: int, docs: int) -> int:
    return 3 * tokens + 2 * docs + 1


def from_int_body(body: torch.Tensor, tokens: int, docs: int, **features) -> PackedBatch:
    """The batch `int_body` made, on the CPU like a freshly packed one (with `features`)."""
    ids, pos, mask, cu, lens = body.cpu().split([tokens, tokens, tokens, docs + 1, docs])
    return PackedBatch(
        input_ids=ids.clone(), positions=pos.clone(), cu_seqlens=cu.to(torch.int32),
        loss_mask=mask.to(torch.uint8), doc_lens=lens.to(torch.int32), **features,
    )  # fmt: skip
