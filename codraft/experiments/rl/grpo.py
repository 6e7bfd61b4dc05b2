"""GRPO: group-normalised advantages and a token-level clipped policy-gradient loss.

Every prompt gets a group of G sampled replies; a reply's advantage is its reward minus the
group's mean, over the group's standard deviation (plus `eps`). The loss is the PPO-clip
objective summed over all generated tokens of the batch and divided by their number (token
level, as in DAPO), with the rollout's own log-probs - the ones the server reported - as the old
log-probs. The KL penalty against a reference model is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GRPOConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    eps: float = 1e-4


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]; a group of equal rewards gives zeros."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig = GRPOConfig(),
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """logp, old_logp, mask [B, T]; advantages [B]. `num_tokens` is the token count of the
    whole batch when this is one micro-batch of it (so micro-batch losses add up)."""
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = float(num_tokens) if num_tokens is not None else float(mask.sum().clamp(min=1))
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_frac = (((unclipped - clipped).abs() > 0).to(logp.dtype) * mask).sum() / n
    return loss, {"clip_frac": float(clip_frac)}
