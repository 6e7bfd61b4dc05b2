"""Helpers for the tests that run real processes: a `codraft serve` under greedy load, torchrun
agents and their workers, and the ports they bind. Not a test module (no `test_` prefix)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from codraft.client import CodraftClient
from codraft.server.serve import free_port
from codraft.testing import kill_tree

PROMPTS = [f"{w} {i}" for i in range(4) for w in ("The cat", "def f(x):", "Once upon", "1 2 3")]
STARTUP_S = 150  # rank 0's first line ("listening for taps") comes within seconds, normally


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal a process and wait for it; kill it if it has not exited within a minute."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


kill_group = kill_tree  # torchrun and every worker it started


def listening(procs: list[subprocess.Popen], logs: list[Path]) -> bool:
    """Whether rank 0 logged its start within STARTUP_S (False at once if an agent exited)."""
    deadline = time.time() + STARTUP_S
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if any("listening for taps" in p.read_text() for p in logs):
            return True
        time.sleep(1)
    return False


def rendezvous_port() -> int:
    """A free port below the ephemeral range. torchrun's agent binds the rendezvous store
    seconds after the port is picked; a port of the ephemeral range (what binding port 0
    gives) may meanwhile be taken by any outgoing connection, and the agent would then wait,
    with no output, as the client of a store that never starts."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(20000, max(low, 20001)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range for the rendezvous")


class Load:
    """Greedy completions from two threads until stopped; failures counted. Each thread rests
    as long as its last request took: back to back, the engine's two processes took both of
    this host's cores, and the learners under test (whose start and stop have deadlines)
    starved."""

    def __init__(self, base: str) -> None:
        self.base, self.done, self.failed = base, 0, []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        model = httpx.get(f"{self.base}/v1/models", timeout=30).json()["data"][0]["id"]
        for i in range(2):
            t = threading.Thread(target=self._run, args=(model, i), daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self, model: str, i: int) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as http:
            n = i
            while not self._stop.is_set():
                body = {"model": model, "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 32,
                        "temperature": 0.0}  # fmt: skip
                t0 = time.monotonic()
                r = http.post("/v1/completions", json=body)
                self._stop.wait(max(0.2, time.monotonic() - t0))
                if r.status_code == 200:
                    self.done += 1
                else:
                    self.failed.append((r.status_code, r.text[:200]))
                n += 2

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


@contextmanager
def loaded_server(model: Path, root: Path, token: str, *extra: str) -> Iterator[dict]:
    """`codraft serve` of a tiny model (vLLM on the CPU, eager, fp32, 3 speculative tokens) with
    a tap endpoint, under greedy load from two threads; `extra` adds serve flags. Yields the
    control client, the control and tap ports, the root folder, the load and the model."""
    port, cport, tap = free_port(), free_port(), free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "CODRAFT_NO_PRELOAD": "1"}
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "codraft.cli", "serve", "--model", str(model),
            "--port", str(port), "--control-port", str(cport), "--control-token", token,
            "--tap-endpoint", f"tcp://127.0.0.1:{tap}", "--dtype", "float32",
            "--max-model-len", "512", "--num-speculative-tokens", "3",
            "--work-dir", str(root / "server"), "--enforce-eager", *extra,
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    client = CodraftClient(f"http://127.0.0.1:{cport}", token=token)
    load = Load(f"http://127.0.0.1:{port}")
    try:
        client.wait_ready(timeout=300)
        load.start()
        yield {"client": client, "cport": cport, "tap": tap, "root": root, "load": load,
               "target": model}  # fmt: skip
    finally:
        load.stop()
        stop(proc)
        log.close()
