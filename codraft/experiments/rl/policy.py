"""The policy on CPU: a transformers causal LM, full fine-tune (or its last layers) with AdamW.

`Policy.step` runs one GRPO update over a batch of rollouts in micro-batches; its forward pass
also gives the policy's own log-probs of the sampled tokens before the update, which are compared
with the ones the server reported. `Policy.save` writes the weights as one safetensors file with
exactly the tensor names of the served model folder (a tied lm_head stays out when the folder has
none) plus that folder's config and tokenizer files: the layout `POST /v1/policy` checks
(codraft.server.weights.check_policy) and vLLM's reload streams in.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from codraft.atomic import atomic_write_dir
from codraft.experiments.rl.grpo import GRPOConfig, policy_loss
from codraft.models.llama import safetensors_files


@dataclass(frozen=True)
class PolicyConfig:
    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    train_layers: int | None = None  # only the last N decoder layers and the final norm
    # vLLM 0.32's in-place reload does not keep a tied lm_head in step with the embedding, so a
    # policy that changes a tied embedding is not what the server then serves (docs/rl.md)
    freeze_tied_embedding: bool = True
    micro_batch: int = 4
    grpo: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass
class Rollout:
    """One sampled reply: ids as the server tokenised and sampled them, its log-probs."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # server-reported, one per token of token_ids
    advantage: float = 0.0


@dataclass
class UpdateStats:
    loss: float
    clip_frac: float
    grad_norm: float
    tokens: int
    seconds: float
    recomputed: list[list[float]]  # the policy's log-probs of each rollout, before the update
    entropies: list[list[float]]  # the policy's entropy at each of those positions


# transformers' from_pretrained disables weight init and tying by patching PreTrainedModel and
# torch.nn.init for the duration of the call, which is not thread-safe: two loads in parallel
# threads (arms run side by side) can leave the patches in place for the whole process, and
# every later model then comes up uninitialised and untied. Loads go one at a time.
_LOAD_LOCK = threading.Lock()


class Policy:
    def __init__(self, model_dir: str | Path, cfg: PolicyConfig = PolicyConfig()) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.base = Path(model_dir)
        with _LOAD_LOCK:
            self.model = AutoModelForCausalLM.from_pretrained(str(self.base), dtype=torch.float32)
        self.model.config.use_cache = False
        self.names = self._served_names()
        params = self._trainable()
        self.opt = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.trainable = sum(p.numel() for p in params)

    def _served_names(self) -> list[str]:
        from safetensors import safe_open

        names: list[str] = []
        for file in safetensors_files(self.base):
            with safe_open(str(file), framework="pt") as f:
                names += list(f.keys())
        missing = set(names) - set(self.model.state_dict())
        if missing:
            raise ValueError(f"{self.base}: tensors the policy model lacks: {sorted(missing)[:5]}")
        return names

    def _trainable(self) -> list[torch.nn.Parameter]:
        n = self.cfg.train_layers
        for p in self.model.parameters():
            p.requires_grad_(n is None)
        if n is not None:
            layers = self.model.model.layers
            for module in [*layers[len(layers) - n :], self.model.model.norm]:
                for p in module.parameters():
                    p.requires_grad_(True)
        if self.cfg.freeze_tied_embedding and self.model.config.tie_word_embeddings:
            self.model.get_input_embeddings().weight.requires_grad_(False)
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ log-probs
    def _forward(self, batch: list[Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs [B, T] of every rollout's generated tokens (right-padded), their mask, and
        the (detached) entropy of the policy at each of those positions."""
        seqs = [r.prompt_ids + r.token_ids for r in batch]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=attn).logits.float()
        t = max(len(r.token_ids) for r in batch)
        out = torch.zeros(len(batch), t)
        mask = torch.zeros(len(batch), t)
        ent = torch.zeros(len(batch), t)
        for i, r in enumerate(batch):
            p, n = len(r.prompt_ids), len(r.token_ids)
            rows = logits[i, p - 1 : p - 1 + n]
            target = torch.tensor(r.token_ids)
            lse = torch.logsumexp(rows, dim=-1)
            lp = rows.gather(1, target[:, None])[:, 0] - lse
            out[i, :n] = lp
            mask[i, :n] = 1
            with torch.no_grad():
                ent[i, :n] = lse - (torch.softmax(rows, dim=-1) * rows).sum(-1)
        return out, mask, ent

    @torch.no_grad()
    def logits_at(self, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(token_ids), V] that predicted each of `token_ids`."""
        ids = torch.tensor([prompt_ids + token_ids])
        logits = self.model(input_ids=ids).logits[0].float()
        p = len(prompt_ids)
        return logits[p - 1 : p - 1 + len(token_ids)]

    # ------------------------------------------------------------------ update
    def step(self, rollouts: list[Rollout], update: bool = True) -> UpdateStats:
        """One GRPO update (gradient accumulated over micro-batches, one AdamW step); with
        update=False only the forward pass (log-probs and entropies, no change)."""
        t0 = time.perf_counter()
        self.model.train(update)
        self.opt.zero_grad(set_to_none=True)
        total = sum(len(r.token_ids) for r in rollouts)
        loss_sum = clip_sum = 0.0
        recomputed: list[list[float]] = []
        entropies: list[list[float]] = []
        mb = max(1, self.cfg.micro_batch)
        for lo in range(0, len(rollouts), mb):
            batch = [r for r in rollouts[lo : lo + mb] if r.token_ids]
            if not batch:
                continue
            with torch.set_grad_enabled(update):
                logp, mask, ent = self._forward(batch)
            t = logp.shape[1]
            old = torch.zeros(len(batch), t)
            for i, r in enumerate(batch):
                old[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
            adv = torch.tensor([r.advantage for r in batch])
            loss, info = policy_loss(logp, old, adv, mask, self.cfg.grpo, num_tokens=total)
            if update:
                loss.backward()
            loss_sum += float(loss.detach())
            clip_sum += info["clip_frac"]
            recomputed += [logp[i, : len(r.token_ids)].tolist() for i, r in enumerate(batch)]
            entropies += [ent[i, : len(r.token_ids)].tolist() for i, r in enumerate(batch)]
        grad_norm = 0.0
        if update:
            params = [p for p in self.model.parameters() if p.requires_grad]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm))
            self.opt.step()
        self.model.eval()
        return UpdateStats(
            loss_sum, clip_sum, grad_norm, total, time.perf_counter() - t0, recomputed, entropies
        )

    # ------------------------------------------------------------------ weights
    def load(self, folder: str | Path) -> None:
        """Take the weights of a policy folder written by `save` (replaying a run)."""
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in safetensors_files(Path(folder)):
            tensors.update(load_file(str(file)))
        missing = set(self.names) - set(tensors)
        if missing:
            raise ValueError(f"{folder}: missing tensors {sorted(missing)[:5]}")
        self.model.load_state_dict(tensors, strict=False)

    def save(self, out: str | Path) -> Path:
        """The policy as a model folder in the served layout (written atomically)."""
        from safetensors.torch import save_file

        out = Path(out)
        state = self.model.state_dict()
        with atomic_write_dir(out, overwrite=True) as tmp:
            for f in self.base.iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.suffix != ".pt":
                    if not f.name.endswith(".index.json"):
                        shutil.copy2(f, tmp / f.name)
            tensors = {n: state[n].detach().contiguous().clone() for n in self.names}
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        return out
