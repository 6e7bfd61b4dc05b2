"""The processes the reliability run drives: one `codraft serve` and one `codraft learn`, started
as a user would start them, killed as a node would kill them, started again with the same
command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from codraft.client import CodraftClient
from codraft.server.serve import free_port
from codraft.testing import stop_tree

TOKEN = "reliability-control-token-0123456789"
API_KEY = "reliability-openai-key-0123456789"


@dataclass
class Stack:
    """A server of `model` with its learner; ports picked once, so a restart reuses them."""

    model: Path
    out: Path
    k: int = 3
    max_num_seqs: int = 16
    publish_every: int = 10
    port: int = field(default_factory=free_port)
    cport: int = field(default_factory=free_port)
    tap: int = field(default_factory=free_port)
    learner_http: int = field(default_factory=free_port)
    server: subprocess.Popen | None = None
    learner: subprocess.Popen | None = None
    learner_out: Path | None = None
    starts: dict[str, int] = field(default_factory=lambda: {"serve": 0, "learn": 0})

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.token_file = self.out / "control-token"
        self.token_file.write_text(TOKEN)
        os.chmod(self.token_file, 0o600)
        self.learner_out = self.out / "learner"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.cport}"

    def client(self) -> CodraftClient:
        return CodraftClient(self.control_url, token=TOKEN)

    def serve_argv(self) -> list[str]:
        return [
            sys.executable, "-m", "codraft.cli", "serve", "--model", str(self.model),
            "--port", str(self.port), "--control-port", str(self.cport),
            "--control-token-file", str(self.token_file), "--api-key", API_KEY,
            "--tap-endpoint", f"tcp://127.0.0.1:{self.tap}", "--dtype", "float32",
            "--max-model-len", "1024", "--num-speculative-tokens", str(self.k),
            "--max-num-seqs", str(self.max_num_seqs), "--work-dir", str(self.out / "server"),
            "--enforce-eager",
        ]  # fmt: skip

    def learn_argv(self, out: Path | None = None) -> list[str]:
        return [
            sys.executable, "-m", "codraft.cli", "learn", "--server", self.control_url,
            "--tap", f"tcp://127.0.0.1:{self.tap}", "--target", str(self.model),
            "--out", str(out or self.learner_out), "--token-file", str(self.token_file),
            "--publish-every", str(self.publish_every), "--token-budget", "2048",
            "--min-buffer-tokens", "2048", "--http-port", str(self.learner_http),
            "--lr", "1e-3",
        ]  # fmt: skip

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        self.starts[name] += 1
        log = open(self.out / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        log.write(f"\n===== start {self.starts[name]} at {time.time():.3f}\n".encode())
        log.flush()
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        }
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            log.close()

    def start_server(self, timeout: float = 900.0) -> float:
        """Start `codraft serve` and wait until /ready; the seconds it took."""
        t0 = time.monotonic()
        self.server = self._spawn(self.serve_argv(), "serve")
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"codraft serve exited; see {self.out / 'serve.log'}")
            try:
                if httpx.get(f"{self.control_url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"codraft serve not ready in {timeout:.0f} s")

    def start_learner(self, out: Path | None = None, timeout: float = 300.0) -> float:
        """Start `codraft learn` and wait until its tap socket is bound."""
        t0 = time.monotonic()
        log = self.out / "learn.log"
        seen = log.read_text(errors="replace").count("listening for taps") if log.exists() else 0
        self.learner = self._spawn(self.learn_argv(out), "learn")
        while time.monotonic() < t0 + timeout:
            if self.learner.poll() is not None:
                raise RuntimeError(f"codraft learn exited; see {log}")
            if log.read_text(errors="replace").count("listening for taps") > seen:
                return time.monotonic() - t0
            time.sleep(0.2)
        raise TimeoutError(f"codraft learn did not bind its tap in {timeout:.0f} s")

    def learner_metrics(self) -> dict[str, float]:
        """The learner's Prometheus samples, name{labels} -> value."""
        text = httpx.get(f"http://127.0.0.1:{self.learner_http}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eE]+|NaN)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        stop_tree(self.learner)
        stop_tree(self.server)
