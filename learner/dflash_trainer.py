"""The trainer of a block drafter (DFlash, DSpark): the Trainer's schedule, optimizer,
checkpoints and resume, with a block step instead of TTT passes.

One step over a packed batch: every row is a block (`codraft.learner.attention.block_draft`),
the draft runs once over all of them, and the loss (`codraft.learner.block_draft_loss`) is
taken against the target's distribution at every proposed position (its logits from the
streamed final hidden states, or from the recomputed target). Context parallelism is not wired
for DFlash yet: the attention is (`ring_block_draft`), the rolls of the labels are not.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from codraft.draft.dflash import DFlashDraft
from codraft.draft.init import new_dflash_draft
from codraft.learner.attention.block_draft import block_draft_attention
from codraft.learner.block_draft_loss import block_draft_loss
from codraft.learner.data.packing import PackedBatch
from codraft.learner.trainer import StepMetrics, Trainer


class DFlashTrainer(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("parallel") is not None:
            raise NotImplementedError(
                "context parallelism is not wired for DFlash drafts yet: run the DFlash "
                "learner in one process (without torchrun --cp)"
            )
        super().__init__(*args, **kwargs)

    def new_draft(self, token_counts: torch.Tensor | None) -> DFlashDraft:
        """A fresh DFlash (or DSpark) draft for the target (token counts are not used: it
        reads out with the target's whole vocabulary)."""
        cfg = self.cfg
        return new_dflash_draft(
            self.target_config, mask_token_id=cfg.mask_token_id,
            num_hidden_layers=cfg.dflash_layers, block_size=cfg.block_size,
            tap_layers=cfg.tap_layers, dtype="float32", seed=cfg.seed,
            markov_rank=cfg.markov_rank if cfg.drafter == "dspark" else None,
        )  # fmt: skip

    def attach_target(self, embedding: torch.Tensor) -> None:
        """The target's embedding and its lm_head (the teacher's), both frozen."""
        head = self.teacher.lm_head.weight.detach().to(self.device)
        self.draft.set_target_head(embedding, head)

    def step(self, batch: PackedBatch) -> StepMetrics:
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = batch.to(self.device)
        want = self.draft.fc.in_features
        if batch.taps is not None and batch.taps.shape[-1] != want:
            if self.teacher.mode != "recompute":
                raise ValueError(
                    f"the batch's taps are {batch.taps.shape[-1]} wide, but this DFlash draft "
                    f"reads {want} ({len(self.tap_layers)} taps at layers "
                    f"{list(self.tap_layers)}): record taps at those layers (the server's "
                    "tap layers follow the draft it serves), or train with --recompute so the "
                    "learner runs the target itself"
                )
            batch = replace(batch, taps=None)
        if batch.taps is None or batch.last_hidden is None:
            batch = self.teacher.fill(batch, self.tap_layers)
        teacher = self.teacher.logits(batch.last_hidden)  # [N, V]: predicts the next token
        lr = self.begin_step()
        use_bf16 = cfg.autocast_bf16 and self.device.type == "cuda"
        cu = batch.cu_seqlens

        def attn(q, kc, vc, kb, vb):
            return block_draft_attention(q, kc, vc, kb, vb, cu)

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            h, source = self.draft.hidden(batch.input_ids, batch.taps, cu, attn)
            h, predicted = self.draft.proposals(h, source, cu)
            out = block_draft_loss(
                h, self.draft.norm, self.draft.head_weight(), predicted, batch.input_ids,
                batch.loss_mask.bool(), teacher_logits=teacher, gamma=cfg.slot_decay,
                chunk=cfg.loss_chunk_tokens, markov=self.draft.markov_features,
            )  # fmt: skip
        out.loss.backward()
        grad_norm = self.end_step(int(batch.valid.sum()))
        return StepMetrics(
            step=self.step_count,
            loss=float(out.loss.detach()),
            lr=lr,
            grad_norm=grad_norm,
            tokens=batch.num_tokens,
            pass_acc=[c / max(1, n) for c, n in zip(out.correct, out.tokens, strict=True)],
            seconds=time.perf_counter() - t0,
        )


def make_trainer(*args: Any, **kwargs: Any) -> Trainer:
    """The trainer for the given draft's kind (else `config.drafter`): `Trainer` (EAGLE-3) or
    `DFlashTrainer` (DFlash, DSpark); the same arguments as `Trainer`."""
    config = kwargs.get("config", args[2] if len(args) > 2 else None)
    draft = kwargs.get("draft")
    kind = draft.config.kind if draft is not None else getattr(config, "drafter", "eagle3")
    if kind in ("dflash", "dspark"):
        return DFlashTrainer(*args, **kwargs)
    return Trainer(*args, **kwargs)
