"""Real prompts, offline: reasoning-gym's procedural generators (GSM8K-style by default)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    question: str
    answer: str
    source: str


def reasoning_prompts(
    n: int, *, dataset: str = "gsm_symbolic", seed: int = 0, offset: int = 0
) -> list[Prompt]:
    """`n` prompts from a reasoning-gym generator; `seed`/`offset` choose disjoint splits."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(dataset, size=n + offset, seed=seed)
    items = [ds[i] for i in range(offset, offset + n)]
    return [Prompt(str(x["question"]), str(x["answer"]), dataset) for x in items]


def chat(question: str) -> list[dict[str, str]]:
    """The chat messages codraft sends for a question."""
    return [{"role": "user", "content": question}]
