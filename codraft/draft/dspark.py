"""`DSparkDraft`: DFlash's backbone with DSpark's sequential Markov head, as vLLM's
qwen3_dspark and its DSpark speculator compute it.

The backbone is `DFlashDraft`'s, over blocks of ``block_size`` queries (row i of a document is
the block anchored at position i + 1: slot s holds the anchor token at s = 0, the noise token
after it, at position i + 1 + s). What differs is the read-out: slot s predicts the token at
position i + 2 + s (the one after its own), from

    logits = lm_head(norm(h[s])) + markov_w2 @ markov_w1[previous]

where `previous` is the token proposed at position i + 1 + s (for slot 0, the anchor itself).
vLLM samples the slots left to right, each one's bias from the token it just sampled. A
proposal counts only while every one before it was accepted, and then the token it followed is
the true one, so training and the acceptance estimate feed the true token at i + 1 + s
(teacher forcing) and still score exactly the proposals vLLM would make.

Parameter names are the checkpoint's: the backbone's plus ``markov_head.markov_w1.weight``
([vocab, rank], an embedding) and ``markov_head.markov_w2.weight`` ([vocab, rank], a linear map
rank -> vocab).
"""

from __future__ import annotations

import torch
from torch import nn

from codraft.draft.dflash import DFlashDraft
from codraft.draft.dspark_config import DSparkConfig


class MarkovHead(nn.Module):
    """The low-rank transition bias: token id -> [rank] -> [vocab]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        # starts as no bias at all: an untrained head leaves the backbone's proposals alone
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(ids.to(self.markov_w1.weight.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] token ids -> [..., vocab] bias."""
        return self.markov_w2(self.embed(ids))


def next_in_document(source: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The packed index of the token after each slot's position, -1 where that lies past the
    document (or the slot itself does): source [S, T] from `rows_and_slots`."""
    cu = cu_seqlens.to(source.device).long()
    t = source.shape[1]
    doc = torch.repeat_interleave(
        torch.arange(cu.numel() - 1, device=source.device), cu[1:] - cu[:-1], output_size=t
    )
    nxt = source + 1
    inside = (source >= 0) & (nxt < cu[doc + 1].unsqueeze(0))
    return torch.where(inside, nxt, torch.full_like(source, -1))


class DSparkDraft(DFlashDraft):
    config: DSparkConfig

    def __init__(
        self,
        config: DSparkConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, dtype=dtype, device=device)
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank).to(
            device=device, dtype=dtype or config.torch_dtype
        )

    def proposals(
        self, h: torch.Tensor, source: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state of each proposal [D, T, H], the packed index it proposes [D, T]):
        every slot proposes the token after its own position."""
        return h, next_in_document(source, cu_seqlens)

    def readout(self, h: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:
        """Proposal logits: the backbone's through the target's lm_head, plus the Markov bias
        of `previous` (the token before each proposed one)."""
        if previous is None:
            raise ValueError("a DSpark draft's logits need the token before each proposal")
        base = self.logits(h)
        return base + self.markov_head(previous).to(base.dtype)

    def markov_features(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(markov_w1[previous] [..., rank], markov_w2's weight [vocab, rank]): the bias as one
        more block of features and of head columns, so a chunked loss computes
        ``cat(normed, e) @ cat(lm_head, w2).T`` and never holds the bias [..., vocab]."""
        return self.markov_head.embed(previous), self.markov_head.markov_w2.weight
