"""The soak: 16 clients of the official `openai` package against `codraft serve` while drafts are
swapped in every second (and rolled back now and then) and the learner trains and publishes.

Every greedy response is compared token for token with vLLM without speculation; every sampled
one's log-probs are compared, after the run, with the target's own (transformers, fp32) at the
tokens it sampled; every response must name a draft version that served during it. The same
clients run once more without swaps, for the latency they cost.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from codraft.draft.checkpoint import META_NAME, read_meta, sha256_file
from codraft.draft.init import write_new_draft
from codraft.models.config import TargetConfig

from .stack import API_KEY, TOKEN, Stack

MAX_TOKENS = 32
PROMPTS = [
    "The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,",
    "12 + 30 =", "The three primary colors are", "Water boils at", "import numpy as np\n",
    "Question: What is the capital of France?\nAnswer:", "Tom has 12 apples and gives away 5.",
    "The sun rises in the", "for i in range(10):", "A haiku about the sea:", "Dear Sir or Madam,",
    "The best way to learn a language is", "SELECT name FROM users WHERE", "In 1969, astronauts",
]  # fmt: skip
CHATS = [
    "What is 17 + 25?", "Name three fruits.", "Write a short greeting.", "What color is the sky?",
    "Give me a synonym for happy.", "How many legs does a spider have?", "Say hello in French.",
    "What is the opposite of cold?",
]  # fmt: skip
KINDS = (
    "cmpl_greedy", "cmpl_greedy_stream", "chat_greedy", "cmpl_sampled_n2",
    "cmpl_sampled_stream", "chat_sampled_n2", "greedy_n2_refused", "cmpl_greedy_logprobs",
)  # fmt: skip


@dataclass
class Outcome:
    kind: str
    client: int
    t0: float
    t1: float
    status: int  # HTTP status (0: no response)
    version: str | None = None  # X-Codraft-Draft-Version
    prompt: str = ""
    tokens: list[list[int]] = field(default_factory=list)  # per choice
    logprobs: list[list[float]] = field(default_factory=list)  # per choice
    prompt_ids: list[int] = field(default_factory=list)
    error: str = ""

    @property
    def latency(self) -> float:
        return self.t1 - self.t0


# ------------------------------------------------------------------------------ references
def greedy_references(model: Path, work: Path) -> tuple[dict, dict]:
    """Token ids without speculation: completions of PROMPTS, chats of CHATS."""
    from codraft.server.offline import ArmSpec, run_arm_subprocess

    common = dict(target=str(model), max_tokens=MAX_TOKENS, ignore_eos=True, max_model_len=1024)
    plain = run_arm_subprocess(ArmSpec(prompts=PROMPTS, **common), work / "ref", timeout=900)
    chat = run_arm_subprocess(
        ArmSpec(prompts=CHATS, chat=True, **common), work / "ref", timeout=900
    )
    return dict(zip(PROMPTS, plain.token_ids, strict=True)), dict(
        zip(CHATS, chat.token_ids, strict=True)
    )


# ------------------------------------------------------------------------------ clients
async def _one(oai: Any, model: str, kind: str, i: int, n: int) -> Outcome:
    rng = random.Random(i * 1_000_003 + n)
    greedy = kind in ("cmpl_greedy", "cmpl_greedy_stream", "chat_greedy", "cmpl_greedy_logprobs")
    chat = kind.startswith("chat")
    text = CHATS[n % len(CHATS)] if chat else PROMPTS[(i + n) % len(PROMPTS)]
    out = Outcome(kind, i, time.monotonic(), 0.0, 0, prompt=text)
    extra = {"return_token_ids": True, **({"ignore_eos": True} if greedy else {})}
    args: dict[str, Any] = dict(model=model, max_tokens=MAX_TOKENS, extra_body=extra)
    if greedy:
        args["temperature"] = 0.0
    elif kind == "greedy_n2_refused":
        args.update(temperature=0.0, n=2)
    else:
        args.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.95]), n=2)
    want_logprobs = kind in ("cmpl_sampled_n2", "cmpl_sampled_stream", "chat_sampled_n2",
                             "cmpl_greedy_logprobs")  # fmt: skip
    try:
        if chat:
            if want_logprobs:
                args["logprobs"] = True
            raw = await oai.chat.completions.with_raw_response.create(
                messages=[{"role": "user", "content": text}], **args
            )
            resp = raw.parse()
            out.prompt_ids = list((resp.model_extra or {}).get("prompt_token_ids") or [])
            for ch in sorted(resp.choices, key=lambda c: c.index):
                out.tokens.append(list((ch.model_extra or {}).get("token_ids") or []))
                lp = ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
                out.logprobs.append([x.logprob for x in lp])
        elif kind == "cmpl_greedy_stream" or kind == "cmpl_sampled_stream":
            if want_logprobs:
                args["logprobs"] = 1
            raw = await oai.completions.with_raw_response.create(prompt=text, stream=True, **args)
            per: dict[int, tuple[list[int], list[float]]] = {}
            async for chunk in raw.parse():
                for ch in chunk.choices:
                    ids, lps = per.setdefault(ch.index, ([], []))
                    extra_fields = ch.model_extra or {}
                    ids += extra_fields.get("token_ids") or []
                    if not out.prompt_ids and extra_fields.get("prompt_token_ids"):
                        out.prompt_ids = list(extra_fields["prompt_token_ids"])
                    if ch.logprobs and ch.logprobs.token_logprobs:
                        lps += ch.logprobs.token_logprobs
            out.tokens = [per[j][0] for j in sorted(per)]
            out.logprobs = [per[j][1] for j in sorted(per)]
        else:
            if want_logprobs:
                args["logprobs"] = 1
            raw = await oai.completions.with_raw_response.create(prompt=text, **args)
            resp = raw.parse()
            for ch in sorted(resp.choices, key=lambda c: c.index):
                extra_fields = ch.model_extra or {}
                out.tokens.append(list(extra_fields.get("token_ids") or []))
                out.prompt_ids = list(extra_fields.get("prompt_token_ids") or out.prompt_ids)
                out.logprobs.append(list(ch.logprobs.token_logprobs) if ch.logprobs else [])
        out.status = raw.http_response.status_code
        out.version = raw.headers.get("x-codraft-draft-version")
    except Exception as e:  # the openai package raises its own types for HTTP errors
        out.status = getattr(e, "status_code", 0) or 0
        out.error = f"{type(e).__name__}: {e}"[:300]
        response = getattr(e, "response", None)
        if response is not None:
            out.version = response.headers.get("x-codraft-draft-version")
    out.t1 = time.monotonic()
    return out


async def _client(
    url: str, i: int, stop: asyncio.Event, results: list[Outcome], kinds: tuple[str, ...] = KINDS
) -> None:
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
    model = (await oai.models.list()).data[0].id
    n = 0
    while not stop.is_set():
        kind = kinds[(i + n) % len(kinds)]
        results.append(await _one(oai, model, kind, i, n))
        n += 1
    await oai.close()


# ------------------------------------------------------------------------------ swaps
class Swapper:
    """A new draft every `every_s` seconds (a folder of hard links to one of a pool of drafts
    with its own codraft.json, so each version is a checkpoint of its own), a rollback every
    `rollback_every` ticks; the serving version polled meanwhile (the learner publishes too)."""

    def __init__(self, stack: Stack, work: Path, pool: int = 6, every_s: float = 1.0,
                 rollback_every: int = 15) -> None:  # fmt: skip
        self.stack, self.work, self.every_s, self.rollback_every = (
            stack,
            work,
            every_s,
            rollback_every,
        )
        import torch

        vocab = TargetConfig.from_pretrained(stack.model).vocab_size
        self.pool = [
            write_new_draft(
                work / "pool" / f"d{j}", stack.model,
                torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(j)),
                version=0, draft_vocab_size=min(8192, vocab), seed=j, overwrite=True,
                dtype="float32",
            )
            for j in range(pool)
        ]  # fmt: skip
        self.shas = [sha256_file(p / "model.safetensors") for p in self.pool]
        self.swaps: list[dict[str, Any]] = []
        # (sent, received, version): the version served at some moment between the two
        self.timeline: list[tuple[float, float, int]] = []

    def _folder(self, version: int) -> tuple[Path, str]:
        j = version % len(self.pool)
        src, out = self.pool[j], self.work / "swaps" / f"v{version}"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            os.link(src / name, out / name)
        meta = read_meta(src)
        meta.version = version
        (out / META_NAME).write_text(json.dumps(meta.to_dict()))
        return out, self.shas[j]

    async def run(self, stop: asyncio.Event) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=self.stack.control_url, headers=headers,
                                     timeout=300) as c:  # fmt: skip
            tick = 0
            while not stop.is_set():
                t0 = time.monotonic()
                tick += 1
                now = (await c.get("/v1/draft")).json()
                self.timeline.append((t0, time.monotonic(), now["version"]))
                if tick % self.rollback_every == 0:
                    r = await c.post("/v1/draft/rollback", json={"reason": "soak"})
                    what, version = "rollback", None
                else:
                    version = int(now.get("highest_version") or now["version"]) + 1
                    path, sha = await asyncio.to_thread(self._folder, version)
                    r = await c.post("/v1/draft", json={"version": version, "path": str(path),
                                                         "sha256": sha})  # fmt: skip
                    what = "swap"
                t1 = time.monotonic()
                body = r.json()
                if r.status_code == 200:  # installed between the swap's start and its reply
                    self.timeline.append((t0, t1, body["version"]))
                self.swaps.append({
                    "what": what, "t0": t0, "t1": t1, "status": r.status_code,
                    "version": body.get("version") if r.status_code == 200 else version,
                    "total_ms": (body.get("timing_ms") or {}).get("total_ms"),
                    "detail": body.get("detail") if r.status_code != 200 else None,
                })  # fmt: skip
                await asyncio.sleep(max(0.0, self.every_s - (time.monotonic() - t0)))


async def _poll_versions(stack: Stack, stop: asyncio.Event, timeline: list, polls: dict) -> None:
    """GET /ready every 0.2 s; each answer is an observation (sent, received, version): that
    version served at some moment between the two. A failed poll observes nothing: it is
    counted (by status) with the slowest answer's seconds, not put in the timeline."""
    async with httpx.AsyncClient(timeout=30) as c:
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = await c.get(f"{stack.control_url}/ready")
                status = str(r.status_code)
                version = r.json().get("draft_version") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                status, version = type(e).__name__, None
            took = time.monotonic() - t
            polls["sent"] += 1
            polls["slowest_s"] = max(polls["slowest_s"], took)
            if isinstance(version, int):
                timeline.append((t, t + took, version))
            else:
                polls["failed"][status] = polls["failed"].get(status, 0) + 1
            await asyncio.sleep(0.2)


async def drive(
    stack: Stack,
    seconds: float | None,
    swapper: Swapper | None,
    clients: int = 16,
    kinds: tuple[str, ...] = KINDS,
    stop: asyncio.Event | None = None,
) -> dict:
    """Run the clients (and the swapper) for `seconds` (or until `stop` is set); the outcomes
    and the version timeline."""
    stop = stop or asyncio.Event()
    results: list[Outcome] = []
    timeline: list[tuple[float, float, int]] = []
    polls: dict = {"sent": 0, "failed": {}, "slowest_s": 0.0}
    tasks = [
        asyncio.create_task(_client(stack.url, i, stop, results, kinds)) for i in range(clients)
    ]
    tasks.append(asyncio.create_task(_poll_versions(stack, stop, timeline, polls)))
    if swapper is not None:
        tasks.append(asyncio.create_task(swapper.run(stop)))
    if seconds is not None:
        await asyncio.sleep(seconds)
        stop.set()
    await asyncio.gather(*tasks)
    if swapper is not None:
        timeline += swapper.timeline
    return {"results": results, "timeline": sorted(timeline), "ready_polls": polls}


class BackgroundLoad:
    """`drive` in a thread of its own (greedy completions by default), stopped by `stop()`."""

    def __init__(self, stack: Stack, clients: int = 4, kinds: tuple[str, ...] = ("cmpl_greedy",)):
        import threading

        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.run: dict = {}
        started = threading.Event()

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            started.set()
            self.run = await drive(stack, None, None, clients, kinds, self._stop)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self._thread.start()
        started.wait()

    def stop(self) -> dict:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(900)
        return self.run


# ------------------------------------------------------------------------------ checks
def served_between(
    timeline: list[tuple[float, float, int]], t0: float, t1: float, slack: float = 1.0
) -> set:
    """The versions that may have served at some moment of [t0 - slack, t1 + slack].

    `timeline` holds observations (sent, received, version), sorted: the version served at
    some moment between the two times. Between two observations nothing is known, so the
    version of observation k may have served from the previous observation's start to the
    next one's end; it counts when that span meets the window. Dense observations make the
    span tight; a gap (polls that failed or were slow) widens it instead of blaming the
    response."""
    lo, hi = t0 - slack, t1 + slack
    seen = set()
    for k, (_, _, version) in enumerate(timeline):
        start = timeline[k - 1][0] if k > 0 else float("-inf")
        end = timeline[k + 1][1] if k + 1 < len(timeline) else float("inf")
        if start <= hi and end >= lo:
            seen.add(version)
    return seen


class PolicyScorer:
    """The target's log-probabilities of given tokens (transformers, fp32, CPU)."""

    def __init__(self, model: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()

    def logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        torch = self.torch
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].double()
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def check(run: dict, refs: tuple[dict, dict], scorer: PolicyScorer | None) -> dict:
    """The figures of one phase: requests, failures, lossless, versions, log-prob agreement,
    latencies."""
    plain, chat = refs
    results: list[Outcome] = run["results"]
    failures, mismatches, bad_versions, lp_diffs = [], [], [], []
    refused = lossless = greedy = sampled = 0
    for o in results:
        if o.kind == "greedy_n2_refused":
            if o.status == 400 and "n must be 1" in o.error:
                refused += 1
            else:
                failures.append(f"{o.kind}: expected a 400, got {o.status} {o.error}")
            continue
        if o.status != 200:
            failures.append(f"{o.kind} (client {o.client}): {o.status} {o.error}")
            continue
        try:
            version = int(o.version or "")
        except ValueError:
            bad_versions.append(f"{o.kind}: header {o.version!r}")
        else:
            seen = served_between(run["timeline"], o.t0, o.t1)
            if version not in seen:
                near = [
                    (round(ts - o.t0, 2), round(tr - o.t0, 2), v)
                    for ts, tr, v in run["timeline"]
                    if o.t0 - 10 <= ts <= o.t1 + 10
                ]
                bad_versions.append(
                    f"{o.kind}: v{version} did not serve in its window of {o.t1 - o.t0:.2f} s "
                    f"(seen {sorted(seen)}; observed (sent, received: s from its start; version): "
                    f"{near[:40]})"
                )
        if o.kind in ("cmpl_greedy", "cmpl_greedy_stream", "chat_greedy", "cmpl_greedy_logprobs"):
            greedy += 1
            want = (chat if o.kind == "chat_greedy" else plain)[o.prompt]
            if o.tokens == [want]:
                lossless += 1
            else:
                mismatches.append(
                    {"kind": o.kind, "prompt": o.prompt, "got": o.tokens, "want": want}
                )
        if o.logprobs and any(o.logprobs) and scorer is not None:
            sampled += o.kind != "cmpl_greedy_logprobs"
            for toks, lps in zip(o.tokens, o.logprobs, strict=True):
                if len(toks) != len(lps) or not o.prompt_ids:
                    failures.append(f"{o.kind}: {len(toks)} tokens, {len(lps)} log-probs")
                    continue
                ref = scorer.logprobs(o.prompt_ids, toks)
                lp_diffs += [abs(a - b) for a, b in zip(lps, ref, strict=True)]
    lat = np.array([o.latency for o in results if o.status == 200]) if results else np.zeros(1)
    greedy_lat = np.array(
        [o.latency for o in results if o.kind == "cmpl_greedy" and o.status == 200]
    )
    diffs = np.array(lp_diffs) if lp_diffs else np.zeros(1)
    return {
        "requests": len(results),
        "failures": len(failures),
        "failure_examples": failures[:5],
        "refused_as_expected": refused,
        "greedy_checked": greedy,
        "lossless": lossless,
        "lossless_pct": 100.0 * lossless / greedy if greedy else None,
        "mismatch_examples": mismatches[:3],
        "bad_versions": len(bad_versions),
        "bad_version_examples": bad_versions[:5],
        "versions_named": len({o.version for o in results if o.version}),
        "ready_polls": run.get("ready_polls"),
        "sampled_checked": sampled,
        "logprob_tokens_checked": len(lp_diffs),
        "logprob_max_abs_diff": float(diffs.max()),
        "logprob_p99_abs_diff": float(np.quantile(diffs, 0.99)),
        "latency_p50_s": float(np.quantile(lat, 0.5)),
        "latency_p99_s": float(np.quantile(lat, 0.99)),
        "greedy_latency_p50_s": float(np.quantile(greedy_lat, 0.5)) if len(greedy_lat) else None,
        "greedy_latency_p99_s": float(np.quantile(greedy_lat, 0.99)) if len(greedy_lat) else None,
        "by_kind": {k: sum(o.kind == k for o in results) for k in KINDS},
    }


def swap_figures(swapper: Swapper) -> dict:
    swaps = [s for s in swapper.swaps if s["what"] == "swap"]
    rollbacks = [s for s in swapper.swaps if s["what"] == "rollback"]
    ms = np.array([s["total_ms"] for s in swaps if s["status"] == 200 and s["total_ms"]] or [0.0])
    versions = [v for *_, v in sorted(swapper.timeline)]
    ok = [s["version"] for s in swaps if s["status"] == 200]
    return {
        "swaps_ok": sum(s["status"] == 200 for s in swaps),
        "swaps_refused": dict(Counter(str(s["status"]) for s in swaps if s["status"] != 200)),
        "refusal_examples": [s["detail"] for s in swaps if s["status"] != 200][:3],
        "rollbacks_ok": sum(s["status"] == 200 for s in rollbacks),
        "rollbacks_refused": sum(s["status"] != 200 for s in rollbacks),
        "swap_ms_p50": float(np.quantile(ms, 0.5)),
        "swap_ms_p99": float(np.quantile(ms, 0.99)),
        "distinct_versions_served": len(set(versions)),
        "swap_versions_increasing": all(a < b for a, b in zip(ok, ok[1:], strict=False)),
    }  # fmt: skip
