"""The draft trainer: TTT steps over packed batches, AdamW with warmup + cosine decay, gradient
clipping, bf16 autocast on GPU, checkpoints with resume (model, optimizer, step, data position).

It takes batches from anywhere (recorded tap files, the live stream) and does not own the data
loop: `Trainer.step(batch)` trains on one PackedBatch, `Trainer.save()` checkpoints, and
`Trainer.resume()` restores the newest checkpoint and returns its saved data position.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from codraft.draft.checkpoint import DraftMeta
from codraft.draft.init import new_draft
from codraft.draft.model import Eagle3Draft
from codraft.drafters import DRAFTERS
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.checkpoints import CheckpointDir
from codraft.learner.data.packing import PackedBatch
from codraft.learner.teacher import Teacher, load_embedding
from codraft.learner.ttt import TTTConfig, ttt_forward
from codraft.models.config import TargetConfig
from codraft.tap.fingerprint import model_fingerprint

if TYPE_CHECKING:
    from codraft.learner.parallel.context import ContextParallel


@dataclass
class TrainConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    total_steps: int = 2000  # length of the cosine schedule (training may stop earlier)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 0.5
    num_passes: int = 3  # TTT passes K
    pass_weights: tuple[float, ...] | None = None
    loss_chunk_tokens: int = TTTConfig.loss_chunk_tokens
    recompute_mlp: bool = TTTConfig.recompute_mlp
    token_budget: int = 4096
    draft_vocab_size: int = 8192
    tap_layers: tuple[int, ...] | None = None  # default: the target's (2, L//2, L-3)
    device: str = "auto"  # "auto": cuda when available
    autocast_bf16: bool = True  # on CUDA only
    # the teacher's head (and, with `recompute`, the target): "auto" is bfloat16 where the step
    # runs under bf16 autocast, the dtype a bf16-served target computes its own logits in (and
    # on an H200 the fp32 head took a fifth of an 8B draft's step); float32 elsewhere
    teacher_dtype: str = "auto"
    keep_checkpoints: int = 3
    seed: int = 0
    recompute: bool = False  # run the target here (ids-only data) instead of streamed features
    drafter: str = "eagle3"  # "eagle3" (TTT passes), "dflash" or "dspark" (block drafters)
    # dflash: slots per block (the anchor and block_size - 1 proposals); dspark: queries per
    # block, each proposing the token after it (block_size proposals)
    block_size: int = 8
    dflash_layers: int = 2  # dflash: draft decoder layers
    mask_token_id: int = 0  # dflash: the token id of every mask slot (a target vocabulary id)
    # dflash, dspark: proposal d's loss weighted exp(-(d - 1) / slot_decay)
    slot_decay: float | None = 4.0
    markov_rank: int = 64  # dspark: the rank of the Markov head's transition bias

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")

    def teacher_torch_dtype(self, device: torch.device) -> torch.dtype:
        """`teacher_dtype` resolved for a step on `device`."""
        if self.teacher_dtype == "auto":
            bf16 = self.autocast_bf16 and device.type == "cuda"
            return torch.bfloat16 if bf16 else torch.float32
        dtype = getattr(torch, self.teacher_dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"teacher_dtype must be 'auto' or a floating torch dtype such as 'float32' or "
                f"'bfloat16', got {self.teacher_dtype!r}"
            )
        return dtype

    def ttt(self) -> TTTConfig:
        return TTTConfig(
            self.num_passes, self.pass_weights, self.loss_chunk_tokens, self.recompute_mlp
        )


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    pass_acc: list[float] = field(default_factory=list)
    seconds: float = 0.0


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class Trainer:
    def __init__(
        self,
        target_dir: str | Path | None,
        out_dir: str | Path,
        config: TrainConfig | None = None,
        *,
        token_counts: torch.Tensor | None = None,
        draft: Eagle3Draft | None = None,
        reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
        parallel: ContextParallel | None = None,
        target_config: TargetConfig | None = None,
        teacher: Teacher | None = None,
        embedding: torch.Tensor | None = None,
    ) -> None:
        """`parallel` (context parallelism, under torchrun) shards every batch over the CP
        ranks, sums gradients over dp x cp and normalises the loss by global counts.

        What the target folder `target_dir` provides can be handed in instead: its parsed
        config.json (`target_config`), a teacher built elsewhere (`teacher`, e.g. a pipeline
        stage's own head) and the token embedding [V, H] (`embedding`). With all three given,
        `target_dir` may be None (a target that exists only in memory)."""
        self.cfg = cfg = config or TrainConfig()
        if target_dir is None and (target_config is None or teacher is None or embedding is None):
            raise ValueError(
                "Trainer without a target folder needs target_config, teacher and embedding"
            )
        self.target_dir = Path(target_dir) if target_dir is not None else None
        self.device = pick_device(cfg.device)
        if target_config is None:
            target_config = TargetConfig.from_pretrained(self.target_dir)
        self.target_config = target_config
        self.fingerprint = model_fingerprint(self.target_config)
        if teacher is None:
            teacher = Teacher.from_pretrained(
                self.target_dir,
                dtype=cfg.teacher_torch_dtype(self.device),
                device=self.device,
                recompute=cfg.recompute,
                config=target_config,
            )
        self.teacher = teacher
        if embedding is None:
            embedding = load_embedding(self.target_dir, device=self.device, config=target_config)
        if draft is None:
            torch.manual_seed(cfg.seed)
            draft = self.new_draft(token_counts)
        self.draft = draft.to(self.device).train()
        self.attach_target(embedding.to(self.device))
        self.opt = torch.optim.AdamW(
            self.draft.parameters(),
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.ckpt = CheckpointDir(out_dir, keep=cfg.keep_checkpoints)
        self.parallel = parallel
        self.reduce_counts = parallel.reduce_counts if parallel is not None else reduce_counts
        self.step_count = 0
        self.draft_version = 0
        self.tokens_seen = 0

    def new_draft(self, token_counts: torch.Tensor | None) -> Any:
        """A fresh draft for the target (an EAGLE-3 draft here)."""
        cfg = self.cfg
        return new_draft(
            self.target_config,
            token_counts,
            draft_vocab_size=min(cfg.draft_vocab_size, self.target_config.vocab_size),
            tap_layers=cfg.tap_layers,
            dtype="float32",
            seed=cfg.seed,
        )

    def attach_target(self, embedding: torch.Tensor) -> None:
        """Share the target's frozen parts with the draft (EAGLE-3: the embedding)."""
        self.draft.set_embedding(embedding)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.draft.config.tap_layers

    def begin_step(self) -> float:
        """Set this step's learning rate and clear the gradients; returns the learning rate."""
        lr = lr_at(self.step_count, self.cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        return lr

    def end_step(self, tokens: int) -> float:
        """Clip, take the optimizer step and count it; returns the norm before clipping. Every
        way of computing the gradients (this trainer, the pipeline learner) ends here."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        self.step_count += 1
        self.tokens_seen += tokens
        return float(grad_norm)

    def step(self, batch: PackedBatch) -> StepMetrics:
        """One optimizer step on a packed batch (features streamed, or recomputed here)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        batch = batch.to(self.device)
        if batch.taps is None or batch.last_hidden is None:
            batch = self.teacher.fill(batch, self.tap_layers)
        shard = self.parallel.shard(batch) if self.parallel is not None else None
        local = shard.batch if shard is not None else batch
        teacher = self.teacher.draft_logits(local.last_hidden, self.draft.t2d)
        lr = self.begin_step()
        use_bf16 = cfg.autocast_bf16 and self.device.type == "cuda"
        taps = local.taps
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16):
            if shard is not None:
                out = self.parallel.ttt_forward(self.draft, shard, teacher, cfg.ttt(), taps=taps)
            else:
                out = ttt_forward(
                    self.draft,
                    local.input_ids,
                    local.positions,
                    local.cu_seqlens,
                    taps,
                    local.loss_mask,
                    pass_attention,
                    cfg.ttt(),
                    teacher,
                    self.reduce_counts,
                )
        out.loss.backward()
        if self.parallel is not None:
            self.parallel.reduce_gradients(self.draft.parameters())
        grad_norm = self.end_step(int(batch.valid.sum()))
        if self.parallel is not None:
            reduced = self.parallel.reduce_metrics(out)
            loss, acc = float(reduced["loss"]), list(reduced["pass_acc"])
        else:
            loss = float(out.loss.detach())
            acc = [
                float(c) / max(1.0, float(v))
                for c, v in zip(out.pass_correct, out.pass_valid, strict=True)
            ]
        return StepMetrics(
            step=self.step_count,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=batch.num_tokens,
            pass_acc=acc,
            seconds=time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ checkpoints
    def save(
        self, data_position: Any = None, counters: dict | None = None, policy_version: int = 0
    ) -> Path:
        """Checkpoint (trainer state + draft). `policy_version`: the newest policy whose data
        the draft has trained on (codraft.json records it; the server's lag metric reads it)."""
        self.draft_version += 1
        meta = DraftMeta(
            version=self.draft_version,
            parent_version=self.draft_version - 1 or None,
            policy_version=policy_version,
            target_fingerprint=self.fingerprint,
            counters={"step": self.step_count, "tokens": self.tokens_seen, **(counters or {})},
        )
        trainer = {
            "draft": self.draft.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
        }
        state = {
            "draft_version": self.draft_version,
            "tokens_seen": self.tokens_seen,
            "data_position": data_position,
            "config": {k: v for k, v in asdict(self.cfg).items()},
        }
        return self.ckpt.save(self.step_count, self.draft, meta, trainer, state)

    def draft_dir(self, checkpoint: Path) -> Path:
        return checkpoint / "draft"

    def resume(self) -> Any:
        """Restore the newest checkpoint, if any; returns its saved data position (or None)."""
        got = self.ckpt.load_latest(self.device)
        if got is None:
            return None
        self.draft.load_state_dict(got.trainer["draft"])
        self.opt.load_state_dict(got.trainer["optimizer"])
        torch.set_rng_state(got.trainer["rng"].cpu())
        self.step_count = int(got.state["step"])
        self.draft_version = int(got.state["draft_version"])
        self.tokens_seen = int(got.state.get("tokens_seen", 0))
        return got.state.get("data_position")
