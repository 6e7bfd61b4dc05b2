"""Rollouts through the server's OpenAI API with the official `openai` client.

`sample_groups` sends one chat completion per prompt with n = G samples, logprobs=True and
vLLM's `return_token_ids` (prompt and completion token ids, so the update trains on exactly the
tokens the server sampled), all prompts at once; `greedy` does the same at temperature 0 for the
fixed probe set. Each response's `X-Codraft-Draft-Version` header names the draft that served it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from codraft.prompts import chat


@dataclass
class Completion:
    prompt_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    draft_version: int | None


@dataclass(frozen=True)
class SamplingConfig:
    group_size: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0


def _extra(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def _parse(raw: Any, index: int) -> list[Completion]:
    resp = raw.parse()
    header = raw.headers.get("x-codraft-draft-version")
    version = int(header) if header and header.lstrip("-").isdigit() else None
    prompt_ids = list(_extra(resp, "prompt_token_ids") or [])
    out = []
    for c in resp.choices:
        ids = list(_extra(c, "token_ids") or [])
        lps = [t.logprob for t in (c.logprobs.content or [])] if c.logprobs else []
        if len(lps) != len(ids):
            raise ValueError(f"server sent {len(ids)} token ids but {len(lps)} log-probs")
        text = c.message.content or ""
        out.append(Completion(index, prompt_ids, ids, lps, text, c.finish_reason, version))
    return out


async def _requests(
    base_url: str, questions: list[str], n: int, max_tokens: int, temperature: float,
    top_p: float, seed: int | None,
) -> tuple[list[list[Completion]], float]:  # fmt: skip
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=1800)
    try:
        model = (await oai.models.list()).data[0].id

        async def one(i: int, q: str) -> list[Completion]:
            raw = await oai.chat.completions.with_raw_response.create(
                model=model,
                messages=chat(q),
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                logprobs=True,
                seed=None if seed is None else seed + i,
                extra_body={"return_token_ids": True},
            )
            return _parse(raw, i)

        t0 = time.perf_counter()
        groups = await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))
        return list(groups), time.perf_counter() - t0
    finally:
        await oai.close()


def sample_groups(
    base_url: str, questions: list[str], cfg: SamplingConfig, seed: int | None = None
) -> tuple[list[list[Completion]], float]:
    """G samples per question, all questions in flight together: (groups, wall seconds).
    `seed` (+ the question's index) seeds each request; None leaves sampling unseeded."""
    return asyncio.run(
        _requests(
            base_url, questions, cfg.group_size, cfg.max_tokens, cfg.temperature, cfg.top_p, seed
        )
    )


def greedy(base_url: str, questions: list[str], max_tokens: int) -> tuple[list[Completion], float]:
    """One temperature-0 reply per question: (replies, wall seconds)."""
    groups, wall = asyncio.run(_requests(base_url, questions, 1, max_tokens, 0.0, 1.0, None))
    return [g[0] for g in groups], wall
