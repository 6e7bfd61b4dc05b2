"""Packing samples into THD batches: documents back to back, described by `cu_seqlens`.

Every document is padded at its end to a multiple of `pad_multiple` (context parallelism asks for
2*CP, so each document splits into 2*CP equal zigzag chunks). Padding positions hold token id 0,
loss mask 0 and zero features; their RoPE positions continue the document's (L, L+1, ...), and
because they come last in their document, causal attention keeps them out of every real token's
view. `cu_seqlens` holds the padded boundaries; `doc_lens` the lengths before padding.

A document longer than the budget is TRUNCATED to its first `token_budget` tokens (rounded down
to the pad multiple), not split: a piece split off the back would lack the prefix its features
were computed with. Truncations are counted in `PackerStats.truncated` (and logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

log = logging.getLogger(__name__)

_FEATURES = ("taps", "last_hidden", "teacher_logits")


@dataclass
class Sample:
    """One document. token_ids int [T]; loss_mask [T] of 0/1 (None: learn on every token);
    taps [T, n_taps*H] (pre-norm residual streams), last_hidden [T, H] (the target's final
    hidden state, after the final norm), teacher_logits [T, V'] optional. `cursor` is an
    opaque resume token, the data position just after this sample (e.g. a TapPosition dict)."""

    token_ids: torch.Tensor
    loss_mask: torch.Tensor | None = None
    taps: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    request_id: str = ""
    cursor: Any = None

    def __post_init__(self) -> None:
        ids = self.token_ids
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool or not len(ids):
            raise ValueError(
                f"token_ids must be a non-empty 1-D integer tensor, got {ids.dtype} "
                f"{list(ids.shape)}"
            )
        T = len(ids)
        if self.loss_mask is None:
            self.loss_mask = torch.ones(T, dtype=torch.uint8, device=ids.device)
        if self.loss_mask.shape != (T,):
            raise ValueError(f"loss_mask must be [{T}], got {list(self.loss_mask.shape)}")
        self.loss_mask = self.loss_mask.to(torch.uint8)
        for name in _FEATURES:
            t = getattr(self, name)
            if t is not None and (t.dim() != 2 or t.shape[0] != T):
                raise ValueError(f"{name} must be [{T}, width], got {list(t.shape)}")

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def from_tap(cls, msg: Any, cursor: Any = None) -> Sample:
        """From a decoded `codraft.tap.TapMessage`."""
        return cls(
            token_ids=msg.token_ids,
            loss_mask=msg.loss_mask,
            taps=msg.taps,
            last_hidden=msg.last_hidden,
            request_id=msg.header.request_id,
            cursor=cursor,
        )

    def truncated(self, n: int) -> Sample:
        """The first n tokens (and their rows of every feature)."""
        cut = {
            name: t[:n] if (t := getattr(self, name)) is not None else None for name in _FEATURES
        }
        return replace(self, token_ids=self.token_ids[:n], loss_mask=self.loss_mask[:n], **cut)

    def kind(self) -> tuple:
        """Samples of one kind (same features, widths and dtypes) can share a batch."""
        return tuple(
            None if (t := getattr(self, name)) is None else (t.shape[1], t.dtype)
            for name in _FEATURES
        )


@dataclass
class PackedBatch:
    """Documents packed back to back (N tokens including padding).

    input_ids int64 [N]; positions int64 [N] (0.. per document); cu_seqlens int32 [docs + 1]
    (padded boundaries); loss_mask uint8 [N] (0 on padding); doc_lens int32 [docs] (before
    padding); taps [N, n_taps*H], last_hidden [N, H] (post-norm), teacher_logits [N, V'] or None
    (zero on padding); cursor: the cursor of the last document (resume point after this batch).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    doc_lens: torch.Tensor
    taps: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    request_ids: list[str] = field(default_factory=list)
    pad_multiple: int = 1
    cursor: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_docs(self) -> int:
        return len(self.doc_lens)

    @property
    def padded_lens(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int32)

    @property
    def max_seqlen(self) -> int:
        return int(self.padded_lens.max()) if self.num_docs else 0

    @property
    def valid(self) -> torch.Tensor:
        """bool [N]: True on real tokens, False on padding."""
        ends = torch.repeat_interleave(self.doc_lens.long(), self.padded_lens.long())
        return self.positions < ends.to(self.positions.device)

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            f.name: t.to(device) if isinstance(t := getattr(self, f.name), torch.Tensor) else t
            for f in fields(self)
        }
        return PackedBatch(**moved)


def padded_len(n: int, pad_multiple: int) -> int:
    return -(-n // pad_multiple) * pad_multiple


def pack(
    samples: Sequence[Sample], *, token_budget: int | None = None, pad_multiple: int = 1
) -> PackedBatch:
    """Pack all `samples` (one kind, see `Sample.kind`) into one batch, each padded to a multiple
    of pad_multiple. Raises ValueError when they need more than token_budget tokens."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if not samples:
        raise ValueError("pack needs at least one sample")
    kinds = {s.kind() for s in samples}
    if len(kinds) > 1:
        raise ValueError(
            f"samples of different kinds cannot share a batch (features/widths/dtypes): {kinds}"
        )
    lens = [len(s) for s in samples]
    plens = [padded_len(n, pad_multiple) for n in lens]
    N = sum(plens)
    if token_budget is not None and N > token_budget:
        raise ValueError(
            f"{len(samples)} samples need {N} tokens after padding to multiples of "
            f"{pad_multiple}, over the budget of {token_budget}: pack fewer (Packer does that)"
        )
    device = samples[0].token_ids.device
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(plens).cumsum(0)
    ids = torch.zeros(N, dtype=torch.int64, device=device)
    mask = torch.zeros(N, dtype=torch.uint8, device=device)
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(plens))
    positions = (torch.arange(N, dtype=torch.int64) - starts).to(device)
    feats: dict[str, torch.Tensor | None] = {}
    for name in _FEATURES:
        first = getattr(samples[0], name)
        feats[name] = (
            None
            if first is None
            else torch.zeros(N, first.shape[1], dtype=first.dtype, device=device)
        )
    for s, start, n in zip(samples, cu[:-1].tolist(), lens, strict=True):
        ids[start : start + n] = s.token_ids
        mask[start : start + n] = s.loss_mask
        for name in _FEATURES:
            out = feats[name]
            if out is not None:
                out[start : start + n] = getattr(s, name)
    return PackedBatch(
        input_ids=ids,
        positions=positions,
        cu_seqlens=cu.to(device),
        loss_mask=mask,
        doc_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        request_ids=[s.request_id for s in samples],
        pad_multiple=pad_multiple,
        cursor=samples[-1].cursor,
        **feats,
    )


def unpack(batch: PackedBatch, packed: torch.Tensor) -> list[torch.Tensor]:
    """Split a per-token tensor [N, ...] of `batch` into its documents, padding dropped."""
    starts = batch.cu_seqlens[:-1].tolist()
    return [packed[a : a + n] for a, n in zip(starts, batch.doc_lens.tolist(), strict=True)]


@dataclass
class PackerStats:
    samples: int = 0  # samples accepted into batches
    batches: int = 0
    truncated: int = 0  # documents cut to the budget
    dropped_empty: int = 0  # documents without a single loss token (after truncation)
    tokens: int = 0  # real tokens emitted
    pad_tokens: int = 0  # padding tokens emitted


class Packer:
    """Greedy packer over a stream: fills a batch in arrival order until the next sample would
    overflow token_budget (padded tokens count), then emits it. Order is kept, so a batch's
    `cursor` is a correct resume point. A change of sample kind closes the current batch."""

    def __init__(
        self,
        token_budget: int,
        *,
        pad_multiple: int = 1,
        max_docs: int | None = None,
        drop_empty: bool = True,
    ) -> None:
        if pad_multiple < 1 or token_budget < pad_multiple:
            raise ValueError(
                f"need pad_multiple >= 1 and token_budget >= pad_multiple, got "
                f"budget {token_budget}, pad_multiple {pad_multiple}"
            )
        self.token_budget = token_budget
        self.pad_multiple = pad_multiple
        self.max_docs = max_docs
        self.drop_empty = drop_empty
        self.max_doc_len = token_budget // pad_multiple * pad_multiple
        self.stats = PackerStats()
        self._pending: list[Sample] = []
        self._pending_tokens = 0

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    def add(self, sample: Sample) -> list[PackedBatch]:
        """Take one sample; return the batches it completed (usually none, at most one)."""
        if len(sample) > self.max_doc_len:
            if not self.stats.truncated:
                log.warning(
                    "document of %d tokens truncated to the token budget (%d); raise the "
                    "budget to keep long documents whole (counted in PackerStats.truncated)",
                    len(sample),
                    self.max_doc_len,
                )
            self.stats.truncated += 1
            sample = sample.truncated(self.max_doc_len)
        if self.drop_empty and not bool(sample.loss_mask.any()):
            self.stats.dropped_empty += 1
            return []
        out = []
        n = padded_len(len(sample), self.pad_multiple)
        full = self._pending and (
            self._pending_tokens + n > self.token_budget
            or sample.kind() != self._pending[0].kind()
            or (self.max_docs is not None and len(self._pending) >= self.max_docs)
        )
        if full:
            out.append(self._emit())
        self._pending.append(sample)
        self._pending_tokens += n
        return out

    def flush(self) -> PackedBatch | None:
        """Emit what is pending (None when nothing is)."""
        return self._emit() if self._pending else None

    def _emit(self) -> PackedBatch:
        batch = pack(self._pending, token_budget=self.token_budget, pad_multiple=self.pad_multiple)
        real = int(batch.doc_lens.sum())
        self.stats.samples += batch.num_docs
        self.stats.batches += 1
        self.stats.tokens += real
        self.stats.pad_tokens += batch.num_tokens - real
        self._pending, self._pending_tokens = [], 0
        return batch


def pack_stream(
    samples: Iterable[Sample], *, token_budget: int, pad_multiple: int = 1, **kw: Any
) -> Iterator[PackedBatch]:
    """Batches of a sample stream (see `Packer`); the last, partial batch is emitted too."""
    packer = Packer(token_budget, pad_multiple=pad_multiple, **kw)
    for s in samples:
        yield from packer.add(s)
    last = packer.flush()
    if last is not None:
        yield last
