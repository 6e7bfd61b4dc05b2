"""The draft on the last pipeline stage: per microbatch, teacher targets from the stage's head,
the TTT loss and its backward, as the pipeline's consumer.

The loss of a batch is the sum of its microbatches' losses when every microbatch divides by the
same *batch-wide* per-pass counts of valid anchors (and, across data-parallel ranks, the global
ones). Those counts depend on token ids and loss masks only, so `begin` computes them for the
whole batch before the first microbatch arrives; then gradients accumulated over microbatches
are the full batch's, up to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from codraft.draft.model import Eagle3Draft
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel.pipeline import StageOutput
from codraft.learner.teacher import Teacher
from codraft.learner.ttt import PassAttention, TTTConfig, doc_ends, roll_left, ttt_forward

CountReducer = Callable[[torch.Tensor], torch.Tensor]


def valid_counts(batch: PackedBatch, num_passes: int) -> torch.Tensor:
    """Per pass d = 1..K, the anchors whose target position i+d is in the same document and has
    loss_mask 1 (float64 [K]): what `ttt_forward` counts when teacher distributions are given."""
    ends = doc_ends(batch.cu_seqlens, batch.num_tokens)
    usable = batch.loss_mask.to(torch.bool)
    per_pass = [roll_left(usable, d, ends, fill=False).sum() for d in range(1, num_passes + 1)]
    return torch.stack(per_pass).to(torch.float64)


@dataclass
class DraftStepResult:
    loss: float = 0.0  # the batch's TTT loss (sum over microbatches)
    pass_loss: list[float] = field(default_factory=list)
    pass_valid: list[float] = field(default_factory=list)  # local valid anchors per pass
    pass_correct: list[float] = field(default_factory=list)
    pass_global_valid: list[float] = field(default_factory=list)  # the denominators
    microbatches: int = 0

    @property
    def pass_acc(self) -> list[float]:
        return [c / max(1.0, v) for c, v in zip(self.pass_correct, self.pass_valid, strict=True)]


@dataclass
class KeptOutputs:
    """Per microbatch, what the consumer saw (kept only when asked, for checks)."""

    taps: list[torch.Tensor] = field(default_factory=list)
    last_hidden: list[torch.Tensor] = field(default_factory=list)
    teacher_logits: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class DraftStage:
    """Consumer for `Pipeline.run` on the last stage: `begin(batch)`, run the pipeline with this
    object as consumer, then `finish()` -> DraftStepResult (also kept as `result`). Gradients
    accumulate in the draft's `.grad`; zeroing them and the optimizer step are the caller's.
    With `keep`, what each microbatch gave the draft is kept in `kept` (for checks)."""

    def __init__(
        self,
        draft: Eagle3Draft,
        teacher: Teacher,
        ttt: TTTConfig | None = None,
        *,
        attn: PassAttention = pass_attention,
        reduce_counts: CountReducer | None = None,
        autocast_dtype: torch.dtype | None = None,
        keep: bool = False,
    ) -> None:
        self.draft, self.teacher = draft, teacher
        self.ttt = ttt or TTTConfig()
        self.attn = attn
        self.reduce_counts = reduce_counts
        self.autocast_dtype = autocast_dtype
        self.keep = keep
        self.kept = KeptOutputs()
        self._global: torch.Tensor | None = None
        self.result = DraftStepResult()
        self._loss = torch.zeros((), dtype=torch.float64)

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    def begin(self, batch: PackedBatch) -> None:
        """Batch-wide loss denominators (all-reduced by `reduce_counts`), and fresh totals."""
        K = self.ttt.num_passes
        local = valid_counts(batch.to(self.device), K)
        self._global = self.reduce_counts(local.clone()) if self.reduce_counts else local
        self.result = DraftStepResult(
            pass_loss=[0.0] * K, pass_valid=[0.0] * K, pass_correct=[0.0] * K,
            pass_global_valid=[float(x) for x in self._global],
        )  # fmt: skip
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.kept = KeptOutputs()

    def __call__(self, out: StageOutput) -> None:
        if self._global is None:
            raise RuntimeError("DraftStage.begin(batch) must run before the pipeline step")
        if out.taps is None:
            raise ValueError("the draft needs taps: build the pipeline with the draft's tap layers")
        mb = out.batch.to(self.device)
        pad = ~mb.valid[:, None]
        taps = out.taps.to(self.device).masked_fill(pad, 0)  # zero on padding, as `pack` does
        last_hidden = out.last_hidden.to(self.device).masked_fill(pad, 0)
        teacher_logits = self.teacher.draft_logits(last_hidden, self.draft.t2d)
        if self.keep:
            self.kept.taps.append(taps.clone())
            self.kept.last_hidden.append(last_hidden.clone())
            self.kept.teacher_logits.append(teacher_logits.clone())
            self.kept.logits.append(self.teacher.logits(last_hidden))
        global_counts = self._global
        use_autocast = self.autocast_dtype is not None
        ctx = (
            torch.autocast(self.device.type, dtype=self.autocast_dtype)
            if use_autocast
            else nullcontext()
        )
        with ctx:
            res = ttt_forward(
                self.draft,
                mb.input_ids,
                mb.positions,
                mb.cu_seqlens,
                taps,
                mb.loss_mask,
                self.attn,
                self.ttt,
                teacher_logits,
                lambda _local: global_counts,
            )
        res.loss.backward()
        r = self.result
        self._loss += res.loss.detach().to(torch.float64)
        for d in range(self.ttt.num_passes):
            r.pass_loss[d] += float(res.pass_loss[d])
            r.pass_valid[d] += float(res.pass_valid[d])
            r.pass_correct[d] += float(res.pass_correct[d])
        r.microbatches += 1

    def finish(self) -> DraftStepResult:
        self.result.loss = float(self._loss)
        self._global = None
        return self.result
