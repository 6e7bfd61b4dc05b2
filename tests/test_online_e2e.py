"""The online loop end to end: `codraft serve` (vLLM) and `codraft learn --server` as real
processes on 127.0.0.1, real ZeroMQ and HTTP, a tiny random Llama, greedy fp32.

The server starts with an untrained draft; greedy requests flow through the official openai
client; the learner trains on the captured features and publishes drafts. Checked: at least two
versions are published, the final draft's acceptance length (the server's own count) is clearly
above the initial draft's, no request fails, every output equals generation without
speculation, and a learner killed with SIGKILL resumes from its checkpoint with versions still
increasing and no publish refused by the server (a half-written checkpoint would fail its
sha256 check with 422). The server may roll a new draft back automatically when its acceptance
collapses against the previous one's; that is allowed here, the versions still have to climb.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live import stop

from codraft.client import CodraftClient
from codraft.server.offline import ArmSpec, run_arm_subprocess
from codraft.server.serve import free_port

pytestmark = pytest.mark.vllm

TOKEN = "e2e-token"
PROMPTS = [f"{w} {i}" for i in range(6) for w in ("The cat", "def f(x):", "Once upon", "1 2 3")]
MAX_TOKENS = 32


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "CODRAFT_NO_PRELOAD": "1"}
    f = open(log, "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(
        [sys.executable, "-m", "codraft.cli", *args], stdout=f, stderr=subprocess.STDOUT, env=env
    )


async def _round(base_url: str) -> list[tuple[str, int]]:
    """All prompts once, 4 at a time: (text, draft version that served it)."""
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(4)

    async def one(p: str) -> tuple[str, int]:
        async with sem:
            raw = await oai.completions.with_raw_response.create(
                model=oai_model, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0
            )
            return raw.parse().choices[0].text, int(raw.headers["x-codraft-draft-version"])

    models = await oai.models.list()
    oai_model = models.data[0].id
    out = await asyncio.gather(*(one(p) for p in PROMPTS))
    await oai.close()
    return list(out)


def _acceptance(client: CodraftClient) -> dict[int, float]:
    return client.stats().acceptance_lengths()


def _serve_args(target: Path, tmp_path: Path, port: int, cport: int, tap: int) -> list[str]:
    return [
        "serve", "--model", str(target), "--port", str(port),
        "--control-port", str(cport), "--control-token", TOKEN,
        "--tap-endpoint", f"tcp://127.0.0.1:{tap}", "--dtype", "float32",
        "--max-model-len", "512", "--num-speculative-tokens", "3",
        "--work-dir", str(tmp_path / "server"),
        "--enforce-eager",  # compiled engines: test_server_engine.py; here, start-up time
    ]  # fmt: skip


def _assert_lossless(target: Path, tmp_path: Path, texts: list[str]) -> None:
    """Every output (whole rounds of PROMPTS, in order) equals generation without
    speculation (the same greedy requests)."""
    ref = run_arm_subprocess(
        ArmSpec(target=str(target), prompts=PROMPTS, max_tokens=MAX_TOKENS, max_model_len=512),
        tmp_path / "arms",
    )
    for i, text in enumerate(texts):
        assert text == ref.texts[i % len(PROMPTS)], f"prompt {i % len(PROMPTS)} differs"


def test_online_loop(tiny_llama_dir: Path, tmp_path: Path) -> None:
    port, cport, tap = free_port(), free_port(), free_port()
    args = _serve_args(tiny_llama_dir, tmp_path, port, cport, tap)
    server = _spawn(args, tmp_path / "server.log")
    learn_args = [
        "learn", "--server", f"http://127.0.0.1:{cport}", "--tap", f"tcp://127.0.0.1:{tap}",
        "--target", str(tiny_llama_dir), "--out", str(tmp_path / "learner"), "--token", TOKEN,
        "--publish-every", "15", "--min-buffer-tokens", "300", "--token-budget", "1024",
        "--lr", "3e-3", "--http-port", "0", "--device", "cpu", "--max-seconds", "600",
    ]  # fmt: skip
    learner = None
    try:
        client = CodraftClient(f"http://127.0.0.1:{cport}", token=TOKEN)
        client.wait_ready(timeout=300)
        base = f"http://127.0.0.1:{port}"
        first = asyncio.run(_round(base))
        assert {v for _, v in first} == {0}
        learner = _spawn(learn_args, tmp_path / "learner.log")
        seen: set[int] = set()
        outputs: list[str] = []
        killed = False
        highest = 0
        deadline = time.time() + 420
        while time.time() < deadline:
            got = asyncio.run(_round(base))
            outputs += [t for t, _ in got]
            seen |= {v for _, v in got}
            version = client.draft().version or 0
            highest = max(highest, version)
            if version >= 1 and not killed:  # crash the learner once, mid-training
                learner.send_signal(signal.SIGKILL)
                learner.wait()
                killed_at = version
                learner = _spawn(learn_args, tmp_path / "learner2.log")
                killed = True
            if killed and version >= killed_at + 2:
                break
        assert killed, (
            "the learner published nothing: " + (tmp_path / "learner.log").read_text()[-3000:]
        )
        stop(learner)  # no more publishes: the final round runs on one draft
        assert highest >= killed_at + 2, "no publish after the restart"
        final = asyncio.run(_round(base))
        # a learned draft serves (the server may have rolled the newest back to its parent)
        assert min(v for _, v in final) >= 1, [v for _, v in final]
        acc = _acceptance(client)
        learned = max(a for v, a in acc.items() if v >= 1)
        print("acceptance by version", acc)
        assert learned > acc[0] + 0.3, f"acceptance by version: {acc}"
    finally:
        if learner is not None:
            stop(learner)
        stop(server)
    _assert_lossless(tiny_llama_dir, tmp_path, [t for t, _ in first + final] + outputs)
    assert "HTTP/1.1 422" not in (tmp_path / "learner2.log").read_text()  # no refused request


def test_online_loop_with_a_dflash_draft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The same loop with `codraft serve --drafter dflash`: the server captures the DFlash
    draft's tap layers, the learner (no --drafter: it trains the kind the server serves) trains
    a DFlash draft on them and publishes it, the server swaps it in; a learned version
    serves, accepts clearly more than the untrained one, and every output is unchanged."""
    port, cport, tap = free_port(), free_port(), free_port()
    args = [*_serve_args(tiny_llama_dir, tmp_path, port, cport, tap), "--drafter", "dflash"]
    server = _spawn(args, tmp_path / "server.log")
    learner = None
    outputs: list[str] = []
    try:
        client = CodraftClient(f"http://127.0.0.1:{cport}", token=TOKEN)
        client.wait_ready(timeout=300)
        assert client.draft().kind == "dflash"
        base = f"http://127.0.0.1:{port}"
        first = asyncio.run(_round(base))
        learner = _spawn(
            [
                "learn", "--server", f"http://127.0.0.1:{cport}", "--tap",
                f"tcp://127.0.0.1:{tap}", "--target", str(tiny_llama_dir), "--out",
                str(tmp_path / "learner"), "--token", TOKEN, "--publish-every", "15",
                "--min-buffer-tokens", "300", "--token-budget", "1024", "--lr", "3e-3",
                "--http-port", "0", "--device", "cpu", "--max-seconds", "600",
            ],
            tmp_path / "learner.log",
        )  # fmt: skip
        deadline = time.time() + 360
        while time.time() < deadline and (client.draft().version or 0) < 2:
            outputs += [t for t, _ in asyncio.run(_round(base))]
        stop(learner)
        log = (tmp_path / "learner.log").read_text()
        assert (client.draft().version or 0) >= 1, "nothing was published: " + log[-3000:]
        assert "published draft v" in log and "HTTP/1.1 422" not in log
        final = asyncio.run(_round(base))
        assert min(v for _, v in final) >= 1, [v for _, v in final]
        assert client.draft().kind == "dflash"
        acc = _acceptance(client)
        print("DFlash acceptance by version", acc)
        assert max(a for v, a in acc.items() if v >= 1) > acc[0] + 0.2, acc
    finally:
        if learner is not None:
            stop(learner)
        stop(server)
    _assert_lossless(tiny_llama_dir, tmp_path, [t for t, _ in first + final] + outputs)
