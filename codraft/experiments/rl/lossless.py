"""Checks that speculation changed nothing: served tokens and log-probs are the policy's.

- Greedy probes: every served token must be the policy's argmax under teacher forcing (the
  policy recomputed here in fp32). A token that is not the argmax but whose logit is within
  `tie_tol` of it is a near-tie (two fp32 implementations may order those differently) and is
  counted apart; `mismatches` counts the rest.
- Sampled rollouts: the server's log-probs against the policy's own, recomputed in the update's
  forward pass with the same weights.
- Sampling distribution (T = 1): for a token drawn from the policy's p_t, z = log p_t(x) + H(p_t)
  has mean 0 (H the entropy). The mean z over a step's tokens, in units of its standard error,
  tests whether the server samples from the policy at all - the log-prob check cannot see a
  sampler that picks the wrong tokens, since it only compares numbers for the tokens picked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from codraft.experiments.rl.policy import Policy


@dataclass
class GreedyCheck:
    tokens: int
    mismatches: int
    near_ties: int
    max_gap: float

    def to_json(self) -> dict:
        return asdict(self)


def check_greedy(
    policy: Policy, replies: list[tuple[list[int], list[int]]], tie_tol: float = 1e-3
) -> GreedyCheck:
    """`replies` = (prompt ids, served token ids) per probe."""
    tokens = mismatches = ties = 0
    max_gap = 0.0
    for prompt_ids, token_ids in replies:
        if not token_ids:
            continue
        logits = policy.logits_at(prompt_ids, token_ids)
        chosen = logits.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
        gap = logits.max(dim=-1).values - chosen
        tokens += len(token_ids)
        max_gap = max(max_gap, float(gap.max()))
        ties += int(((gap > 0) & (gap <= tie_tol)).sum())
        mismatches += int((gap > tie_tol).sum())
    return GreedyCheck(tokens, mismatches, ties, max_gap)


@dataclass
class LogprobCheck:
    tokens: int
    mean_abs: float
    max_abs: float
    within_tol: bool

    def to_json(self) -> dict:
        return asdict(self)


def check_logprobs(
    served: list[list[float]], recomputed: list[list[float]], tol: float = 1e-2
) -> LogprobCheck:
    """Mean |served - recomputed| must be below `tol` (the max is reported, not judged: one
    token deep in a distribution's tail can differ more between two fp32 kernels)."""
    diffs = [
        abs(a - b)
        for s, r in zip(served, recomputed, strict=True)
        for a, b in zip(s, r, strict=True)
    ]
    if not diffs:
        return LogprobCheck(0, 0.0, 0.0, True)
    mean = sum(diffs) / len(diffs)
    return LogprobCheck(len(diffs), mean, max(diffs), mean < tol)


@dataclass
class SamplingCheck:
    tokens: int
    mean_z: float
    std_err: float
    exact: bool  # |mean_z| < `sigmas` standard errors

    def to_json(self) -> dict:
        return asdict(self)


def check_sampling(
    logprobs: list[list[float]], entropies: list[list[float]], sigmas: float = 4.0
) -> SamplingCheck:
    """Only meaningful for temperature 1, top-p 1 (the policy's own distribution)."""
    z = torch.tensor(
        [a + h for lp, ent in zip(logprobs, entropies, strict=True)
         for a, h in zip(lp, ent, strict=True)]
    )  # fmt: skip
    if len(z) < 2:
        return SamplingCheck(len(z), 0.0, 0.0, True)
    mean, se = float(z.mean()), float(z.std() / len(z) ** 0.5)
    return SamplingCheck(len(z), mean, se, abs(mean) < sigmas * se)
