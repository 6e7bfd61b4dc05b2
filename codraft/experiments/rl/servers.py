"""One arm's server for the RL loop, as child processes on 127.0.0.1.

- `CodraftArm`: `codraft serve` with an EAGLE-3 draft (the tap on when a learner runs), and
  optionally `codraft learn --server` alongside, started from the same draft (its checkpoint
  folder is seeded so the learner resumes that draft, not a fresh one). Policies go in through
  `POST /v1/policy`; acceptance comes from the server's per-version counters in /metrics.
- `PlainArm`: no speculation. `codraft serve` always runs EAGLE-3 (its worker extension refuses
  an engine without a draft), so this arm is the same vLLM started plainly, with the same engine
  flags, in dev mode: a policy goes in through vLLM's own `/collective_rpc reload_weights`
  (the same `GPUModelRunner.reload_weights` the codraft extension calls) and
  `/reset_prefix_cache`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from codraft.client import CodraftClient
from codraft.server.serve import free_port
from codraft.server.vllm_env import preload_env


@dataclass(frozen=True)
class EngineFlags:
    dtype: str = "float32"
    max_model_len: int = 1024
    max_num_seqs: int = 32
    num_speculative_tokens: int = 3


@dataclass(frozen=True)
class LearnerFlags:
    lr: float = 1e-3
    publish_every: int = 5
    token_budget: int = 1024
    min_buffer_tokens: int = 512
    threads: int = 1  # torch/OpenMP threads of the learner (it shares the CPU with the server)


@dataclass
class SpecCounters:
    """Cumulative verification counters by draft version (empty without speculation)."""

    drafts: dict[int, float]
    accepted: dict[int, float]

    def minus(self, before: SpecCounters) -> SpecCounters:
        return SpecCounters(
            {v: n - before.drafts.get(v, 0.0) for v, n in self.drafts.items()},
            {v: n - before.accepted.get(v, 0.0) for v, n in self.accepted.items()},
        )

    def acceptance_length(self) -> float | None:
        drafts = sum(self.drafts.values())
        return 1.0 + sum(self.accepted.values()) / drafts if drafts > 0 else None

    def by_version(self) -> dict[int, float]:
        return {v: 1.0 + self.accepted.get(v, 0.0) / n for v, n in self.drafts.items() if n > 0}


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    f = open(log, "ab")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen | None, timeout: float = 60.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def _tail(log: Path, chars: int = 4000) -> str:
    try:
        return log.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return ""


class ArmServer:
    """Common shape: start, wait_ready, load_policy, counters, draft, stop."""

    name = "arm"
    speculative = False

    def __init__(self, model: Path, work: Path, flags: EngineFlags) -> None:
        self.model, self.work, self.flags = Path(model), Path(work), flags
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.work / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout: float = 600.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited; log:\n{_tail(self.log)}")
            try:
                if self._ready():
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} server not ready in {timeout:.0f} s:\n{_tail(self.log)}")

    def load_policy(self, version: int, path: Path) -> None:
        raise NotImplementedError

    def counters(self) -> SpecCounters:
        return SpecCounters({}, {})

    def draft(self) -> dict | None:
        return None

    def stop(self) -> None:
        _stop(self.proc)


class PlainArm(ArmServer):
    name = "nospec"

    def start(self) -> PlainArm:
        env = preload_env({**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
        f = self.flags
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", f.dtype,
            "--max-model-len", str(f.max_model_len), "--max-num-seqs", str(f.max_num_seqs),
            "--enforce-eager", "--no-enable-prefix-caching",
        ]  # fmt: skip
        self.proc = _spawn(argv, self.log, env)
        return self

    def _ready(self) -> bool:
        return httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200

    def load_policy(self, version: int, path: Path) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        r = httpx.post(f"{self.url}/collective_rpc", json=body, timeout=600)
        r.raise_for_status()
        httpx.post(f"{self.url}/reset_prefix_cache", timeout=60).raise_for_status()


class CodraftArm(ArmServer):
    speculative = True

    def __init__(
        self,
        model: Path,
        work: Path,
        flags: EngineFlags,
        draft: Path,
        learner: LearnerFlags | None = None,
        token: str = "rl-cotrain",
    ) -> None:
        super().__init__(model, work, flags)
        self.name = "cotrain" if learner else "frozen"
        self.draft_path, self.learner_flags, self.token = Path(draft), learner, token
        self.control_port = free_port()
        self.tap_port = free_port() if learner else None
        self.client = CodraftClient(f"http://127.0.0.1:{self.control_port}", token=token)
        self.learner: subprocess.Popen | None = None
        self.learner_log = self.work / "learner.log"

    def start(self) -> CodraftArm:
        env = preload_env({**os.environ})
        f = self.flags
        argv = [
            sys.executable, "-m", "codraft.cli", "serve", "--model", str(self.model),
            "--draft", str(self.draft_path), "--port", str(self.port),
            "--control-port", str(self.control_port), "--control-token", self.token,
            "--dtype", f.dtype, "--max-model-len", str(f.max_model_len),
            "--num-speculative-tokens", str(f.num_speculative_tokens),
            "--work-dir", str(self.work / "serve"), "--max-num-seqs", str(f.max_num_seqs),
            "--no-enable-prefix-caching", "--enforce-eager",  # as the plain arm: same engine mode
            "--no-resume-draft",  # each arm serves the draft it is given
        ]  # fmt: skip
        if self.tap_port is not None:
            argv += ["--tap-endpoint", f"tcp://127.0.0.1:{self.tap_port}"]
        self.proc = _spawn(argv, self.log, env)
        return self

    def _ready(self) -> bool:
        r = httpx.get(f"http://127.0.0.1:{self.control_port}/ready", timeout=2.0)
        return r.status_code == 200

    def start_learner(self) -> None:
        """`codraft learn --server` from the served draft (call once the server is ready)."""
        lf = self.learner_flags
        if lf is None:
            return
        out = self.work / "learner"
        seed_learner(self.draft_path, out, self.model)
        env = {**os.environ, "OMP_NUM_THREADS": str(lf.threads), "CODRAFT_NO_PRELOAD": "1"}
        argv = [
            sys.executable, "-m", "codraft.cli", "learn",
            "--server", f"http://127.0.0.1:{self.control_port}",
            "--tap", f"tcp://127.0.0.1:{self.tap_port}", "--target", str(self.model),
            "--out", str(out), "--token", self.token, "--publish-every", str(lf.publish_every),
            "--token-budget", str(lf.token_budget), "--min-buffer-tokens",
            str(lf.min_buffer_tokens), "--lr", str(lf.lr), "--http-port", "0", "--device", "cpu",
        ]  # fmt: skip
        self.learner = _spawn(argv, self.learner_log, env)

    def load_policy(self, version: int, path: Path) -> None:
        self.client.load_policy(version, str(path))

    def counters(self) -> SpecCounters:
        acceptance = self.client.stats().acceptance  # fresh (/metrics is cached)
        return SpecCounters(
            {v: float(a.drafts) for v, a in acceptance.items()},
            {v: float(a.accepted_tokens) for v, a in acceptance.items()},
        )

    def draft(self) -> dict | None:
        info = self.client.draft()
        out = {"version": info.version, "path": info.path}
        meta = Path(info.path or "") / "codraft.json"
        if info.path and meta.is_file():
            out["sidecar_policy_version"] = json.loads(meta.read_text()).get("policy_version")
        return out

    def learner_alive(self) -> bool | None:
        return None if self.learner is None else self.learner.poll() is None

    def stop(self) -> None:
        _stop(self.learner)
        _stop(self.proc)
        self.client.close()


def seed_learner(draft: Path, out: Path, target: Path) -> None:
    """Make `out` a learner checkpoint folder whose newest checkpoint is `draft`.

    A draft inside a learner checkpoint (`ckpt-N/draft` next to trainer.pt and state.json) is
    copied with its optimizer state; any other codraft draft gets a fresh trainer state saved
    around its weights (same version, so the learner publishes version + 1 next)."""
    if (out / "latest").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    ckpt = draft.parent
    if (
        draft.name == "draft"
        and (ckpt / "trainer.pt").is_file()
        and (ckpt / "state.json").is_file()
    ):
        shutil.copytree(ckpt, out / ckpt.name)
        (out / "latest").write_text(ckpt.name)
        return
    from codraft.draft.checkpoint import load_draft, read_meta
    from codraft.learner.trainer import TrainConfig, Trainer

    model, _ = load_draft(draft)
    trainer = Trainer(target, out, TrainConfig(device="cpu"), draft=model)
    trainer.draft_version = read_meta(draft).version - 1
    trainer.save()
