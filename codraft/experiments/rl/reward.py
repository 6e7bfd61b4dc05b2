"""Reward = answer format + correctness, for reasoning-gym prompts.

The prompt asks for a final line `Answer: <number>`. Format credit is graded so that a group of
samples from a weak model still differs (GRPO learns nothing from a group of equal rewards):
`format_full` when the reply ends with that line, `format_partial` when `Answer:` and a number
appear somewhere, nothing otherwise. Correctness is reasoning-gym's own scorer on the extracted
answer (1.0 right, 0.01 a wrong number), weighted by `correct_weight`. A reply cut off at
max_tokens gets `truncated_penalty` added, which pushes the policy towards short, templated
answers: a visible move of its token distribution within a few steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

INSTRUCTION = "\nFinish your reply with one line of the form 'Answer: <number>'."
_FINAL = re.compile(r"Answer:\s*(-?[\d,]*\.?\d+)\s*\.?\s*$", re.IGNORECASE)
_ANY = re.compile(r"Answer:\s*(-?[\d,]*\.?\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class RewardConfig:
    format_full: float = 1.0
    format_partial: float = 0.4
    correct_weight: float = 1.0
    truncated_penalty: float = -0.3


@dataclass(frozen=True)
class Reward:
    total: float
    format: float
    correct: float
    answer: str | None


def extract_answer(text: str) -> tuple[str | None, bool]:
    """(the number after the last `Answer:`, whether that line ends the reply)."""
    final = _FINAL.search(text.strip())
    if final:
        return final.group(1).replace(",", ""), True
    found = _ANY.findall(text)
    return (found[-1].replace(",", ""), False) if found else (None, False)


def score(
    text: str,
    entry: dict[str, Any],
    scorer: Any | None,
    truncated: bool,
    cfg: RewardConfig = RewardConfig(),
) -> Reward:
    """`scorer` is a reasoning-gym dataset (its `score_answer`), or None for exact match."""
    answer, at_end = extract_answer(text)
    fmt = cfg.format_full if at_end else cfg.format_partial if answer is not None else 0.0
    if answer is None:
        correct = 0.0
    elif scorer is not None:
        correct = float(scorer.score_answer(answer, entry))
    else:
        correct = float(answer.strip() == str(entry["answer"]).strip())
    total = fmt + cfg.correct_weight * correct + (cfg.truncated_penalty if truncated else 0.0)
    return Reward(total, fmt, correct, answer)
