"""Benchmark `codraft serve` on SmolLM2-135M-Instruct (CPU): tap cost, swap latency, tap bytes.

Servers run fp32 with an untrained EAGLE-3 draft (k=3) and stream their tap ("full" mode: taps
and last hidden state of every final token) into one `codraft record`, which writes it to disk
as a learner would ingest it. Clients send greedy chat completions (reasoning-gym prompts,
ignore_eos, --max-tokens each) in a closed loop.

1. Throughput, tap on vs off. A shared CPU machine's other load moves a single server's
   throughput by tens of percent between minutes, so two identical servers run side by side,
   each pinned to its own core (VLLM_CPU_OMP_THREADS_BIND), each under the same load, one with
   the tap on and one with it off; the roles alternate every round. Per round the ratio
   on/off of generated tokens per second (vLLM's vllm:generation_tokens_total over a window)
   cancels what both servers share; the geometric mean over rounds cancels the difference
   between the two servers and cores. Also: server CPU seconds (all processes) per token.
2. Swap latency: one server as deployed (both cores), POST /v1/draft round trips idle and under
   --clients closed-loop clients, in two modes: "one call" (the POST reads, checks, stages and
   installs) and "prepared ahead" (POST /v1/draft/prepare first, wait until GET
   /v1/draft/prepare says ready, then time the POST, which only installs). Each swap publishes a
   new version (hard links to one of two different weight files). Before each swap a GET /ready
   (one codraft_info RPC, no work) is timed: under load that is the wait for the running engine
   step, which every swap pays too.
3. Bytes per token streamed: bytes the recorder wrote / tokens in the recorded messages.

Each swap's reply carries the parts of its latency (`timing_ms`: prepare_ms in the worker's
background thread = read_check_ms (read_ms + check_ms, sha256 running meanwhile: hash_ms) +
stage_ms + hash_wait_ms, install_ms between two engine steps, wait_ms = the rest: RPC round
trips and waits for step boundaries, commit_rpcs); the summary has their p50/p99, for the
one-call POST (swap_*) and the commit after a prepare (commit_*).

Writes runs/bench_serve_tap/result.json and result.png (--only swap: part 2 alone, into
swap_result.json). Usage:
    .venv/bin/python scripts/bench_serve_tap.py [--rounds 8] [--window 30] [--clients 16]
    .venv/bin/python scripts/bench_serve_tap.py --only swap [--swaps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="paired rounds (roles alternate)")
    p.add_argument("--window", type=float, default=30.0, help="seconds measured per round")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients per server")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--swaps", type=int, default=20, help="idle swaps, and as many under load")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--out", default="runs/bench_serve_tap")
    p.add_argument(
        "--only",
        choices=("all", "swap"),
        default="all",
        help="swap: only part 2, swap latency (writes swap_result.json)",
    )
    return p.parse_args()


# ------------------------------------------------------------------------------- set-up
def write_drafts(model: Path, out: Path, vocab: int) -> tuple[Path, Path]:
    from codraft.draft.init import write_new_draft
    from codraft.models.config import TargetConfig

    common = dict(version=0, draft_vocab_size=vocab, dtype="float32", overwrite=True)
    common["target_config"] = TargetConfig.from_pretrained(model)
    a = write_new_draft(out / "draft-a", model, seed=0, **common)
    b = write_new_draft(out / "draft-b", model, seed=1, **common)
    return a, b


def publish(src: Path, out: Path, version: int) -> Path:
    """A checkpoint of version `version` sharing `src`'s weights file (hard link)."""
    d = out / f"v{version}"
    d.mkdir(parents=True, exist_ok=True)
    os.link(src / "model.safetensors", d / "model.safetensors")
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    meta = json.loads((src / "codraft.json").read_text())
    meta.update(version=version, parent_version=version - 1)
    (d / "codraft.json").write_text(json.dumps(meta))
    return d


def start_recorder(out: Path) -> tuple[subprocess.Popen, str]:
    rec = subprocess.Popen(
        [sys.executable, "-m", "codraft.cli", "record", "--tap", "tcp://127.0.0.1:*"]
        + ["--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    line = rec.stdout.readline()
    m = re.search(r"listening on (tcp://\S+),", line)
    if not m:
        rec.kill()
        raise RuntimeError(f"codraft record did not start: {line}")
    return rec, m.group(1)


def start_server(
    args: argparse.Namespace,
    model: Path,
    draft: Path,
    endpoint: str,
    out: Path,
    log: str,
    cores: str | None = None,
):
    from codraft.server.serve import ServeProcess

    env = {**os.environ}
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    argv = [
        "--model",
        str(model),
        "--draft",
        str(draft),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--num-speculative-tokens",
        str(args.k),
        "--max-num-seqs",
        str(args.clients),
        "--tap-endpoint",
        endpoint,
        "--control-token-file",
        str(out / "token"),
        "--no-resume-draft",  # every run starts from the draft it names
    ]
    return ServeProcess.start(argv, out / log, env=env)


# ------------------------------------------------------------------------------- load
async def closed_loop(
    url: str, model: str, prompts: list[str], clients: int, max_tokens: int, stop: asyncio.Event
) -> int:
    """`clients` clients, each sending one request after the other until `stop`."""
    done = 0

    n = len(prompts)

    async def client(i: int, c: httpx.AsyncClient) -> None:
        nonlocal done
        j = 0
        while not stop.is_set():
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompts[(i + j * clients) % n]}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            r = await c.post(f"{url}/v1/chat/completions", json=body)
            r.raise_for_status()
            done += 1
            j += 1

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        await asyncio.gather(*(client(i, c) for i in range(clients)))
    return done


async def generated_tokens(c: httpx.AsyncClient, url: str) -> float:
    text = (await c.get(f"{url}/metrics")).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    )


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the server process and its children (the engine core)."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def paired_rounds(
    servers: list, args: argparse.Namespace, model: str, prompts: list[str]
) -> list[dict]:
    """Both servers under load; per round one has the tap on, the other off (alternating)."""
    stop = asyncio.Event()
    loads = [
        asyncio.ensure_future(
            closed_loop(s.url, model, prompts, args.clients, args.max_tokens, stop)
        )
        for s in servers
    ]
    rows = []
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
        await asyncio.sleep(10.0)  # every client running, first requests done
        for r in range(args.rounds):
            on = r % 2  # round 0: server 1 on; round 1: server 0 on; ...
            for i, s in enumerate(servers):
                await c.put(f"{s.control_url}/v1/tap", json={"enabled": i == on})
            await asyncio.sleep(3.0)  # requests started under the old setting finish or age
            t0 = time.perf_counter()
            g0 = [await generated_tokens(c, s.url) for s in servers]
            cpu0 = [server_cpu_s(s.proc.pid) for s in servers]
            await asyncio.sleep(args.window)
            g1 = [await generated_tokens(c, s.url) for s in servers]
            cpu1 = [server_cpu_s(s.proc.pid) for s in servers]
            wall = time.perf_counter() - t0
            tokens = [b - a for a, b in zip(g0, g1, strict=True)]
            cpu = [1000 * (b - a) / max(1.0, n) for a, b, n in zip(cpu0, cpu1, tokens, strict=True)]
            tps = [n / wall for n in tokens]
            row = {
                "round": r,
                "tap_on_server": on,
                "tokens_per_s": tps,
                "cpu_ms_per_token": cpu,
                "ratio_on_off": tps[on] / tps[1 - on],
                "cpu_ratio_on_off": cpu[on] / cpu[1 - on],
            }
            rows.append(row)
            print(
                f"[{r + 1}/{args.rounds}] tokens/s {tps[0]:5.1f} | {tps[1]:5.1f} "
                f"(tap on: server {on}); on/off {row['ratio_on_off']:.3f}, "
                f"CPU/token on/off {row['cpu_ratio_on_off']:.3f}",
                flush=True,
            )
    stop.set()
    await asyncio.gather(*loads)
    return rows


async def wait_prepared(c: httpx.AsyncClient, curl: str, ticket: str, poll_s: float) -> float:
    """Poll GET /v1/draft/prepare until `ticket` is no longer preparing; the ms it took."""
    t0 = time.perf_counter()
    while True:
        r = await c.get(f"{curl}/v1/draft/prepare")
        st = r.json() if r.status_code == 200 else {}
        if st.get("ticket") != ticket or st.get("state") != "preparing":
            if st.get("state") == "failed":
                raise RuntimeError(f"prepare failed: {st}")
            return 1000 * (time.perf_counter() - t0)
        await asyncio.sleep(poll_s)


async def swap_series(
    curl: str,
    sources: tuple[Path, Path],
    out: Path,
    first: int,
    n: int,
    gap_s: float,
    ahead: bool = False,
) -> list[dict]:
    """`n` swaps to versions first.., one POST /v1/draft each; with `ahead`, each is prepared
    first (POST /v1/draft/prepare, then GET until ready) and only the commit POST is timed."""
    from codraft.draft.checkpoint import sha256_file

    shas = [sha256_file(s / "model.safetensors") for s in sources]
    rows = []
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as c:
        for i in range(n):
            v = first + i
            path = publish(sources[v % 2], out, v)
            body = {"version": v, "path": str(path), "sha256": shas[v % 2]}
            extra: dict[str, float] = {}
            if ahead:
                t0 = time.perf_counter()
                r = await c.post(f"{curl}/v1/draft/prepare", json=body)
                if r.status_code != 202:
                    raise RuntimeError(f"prepare of v{v} failed: {r.status_code} {r.text}")
                extra["prepare_post_ms"] = 1000 * (time.perf_counter() - t0)
                extra["prepared_after_ms"] = extra["prepare_post_ms"] + await wait_prepared(
                    c, curl, r.json()["ticket"], 0.01
                )
            t0 = time.perf_counter()
            await c.get(f"{curl}/ready")  # one codraft_info RPC: the wait for a step boundary
            probe_ms = 1000 * (time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = await c.post(f"{curl}/v1/draft", json=body)
            ms = 1000 * (time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"swap to v{v} failed: {r.status_code} {r.text}")
            timing = r.json().get("timing_ms") or {}
            if ahead and not timing.get("prepared_ahead"):
                raise RuntimeError(f"v{v} was prepared ahead but the swap prepared it again")
            rows.append(
                {
                    "version": v,
                    "status": r.status_code,
                    "ms": ms,
                    "probe_ms": probe_ms,
                    **extra,
                    **timing,
                }
            )
            await asyncio.sleep(gap_s)
    return rows


async def swaps_under_load(
    server: Any,
    args: argparse.Namespace,
    model: str,
    prompts: list[str],
    sources: tuple[Path, Path],
    out: Path,
    first: int,
) -> dict[str, list[dict]]:
    stop = asyncio.Event()
    load = asyncio.ensure_future(
        closed_loop(server.url, model, prompts, args.clients, args.max_tokens, stop)
    )
    await asyncio.sleep(5.0)  # every client running
    curl = server.control_url
    one = await swap_series(curl, sources, out, first, args.swaps, 0.5)
    ahead = await swap_series(curl, sources, out, first + args.swaps, args.swaps, 0.5, True)
    stop.set()
    await load
    return {"one_call": one, "ahead": ahead}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


# ------------------------------------------------------------------------------- main
def main() -> int:
    from codraft.prepare import prepare_smollm2
    from codraft.prompts import reasoning_prompts

    args = parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = prepare_smollm2().path
    name = str(model)
    a, b = write_drafts(model, out / "drafts", args.draft_vocab)
    prompts = [p.question for p in reasoning_prompts(64)]
    (out / "token").write_text(TOKEN)
    taps_dir = out / f"taps-{stamp}"
    rec, endpoint = start_recorder(taps_dir)
    result: dict[str, Any] = {"args": vars(args), "model": model.name}
    servers: list = []
    try:
        if args.only == "swap":
            result["swaps"] = swap_part(args, model, (a, b), endpoint, out, stamp, servers)
            return finish_swap_only(result, out)
        # 1. two servers, one core each, tap on in one of them per round
        servers = [
            start_server(args, model, a, endpoint, out, f"serve-{i}.log", cores=str(i))
            for i in range(2)
        ]
        for s in servers:
            s.wait_ready(900)
        print("paired servers ready (core 0 | core 1)", flush=True)
        result["rounds"] = asyncio.run(paired_rounds(servers, args, name, prompts))
        for s in servers:
            s.stop()
        servers.clear()
        # 2. swap latency on one server with both cores, as deployed
        result["swaps"] = swap_part(args, model, (a, b), endpoint, out, stamp, servers)
    finally:
        for s in servers:
            s.stop()
        rec.send_signal(signal.SIGINT)
        rec_out = rec.communicate(timeout=300)[0]
    recorder = json.loads(rec_out.strip().splitlines()[-1])
    recorder["files"] = [str(Path(f).relative_to(ROOT)) for f in recorder["files"]]
    result["recorder"] = recorder
    result["tap_tokens"] = count_tap_tokens(taps_dir)
    summarize(result)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "result.png")
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out / 'result.json'} and {out / 'result.png'}")
    return 0


def swap_part(
    args: argparse.Namespace,
    model: Path,
    drafts: tuple[Path, Path],
    endpoint: str,
    out: Path,
    stamp: str,
    servers: list,
) -> dict[str, list[dict]]:
    """Part 2: swap round trips on one server with both cores, idle then under load."""
    from codraft.prompts import reasoning_prompts

    prompts = [p.question for p in reasoning_prompts(64)]
    server = start_server(args, model, drafts[0], endpoint, out, "serve-swaps.log")
    servers.append(server)
    server.wait_ready(900)
    print("swap server ready", flush=True)
    where = out / f"swaps-{stamp}"
    curl = server.control_url
    asyncio.run(swap_series(curl, drafts, where, 1, 2, 0.2))  # warm-up
    asyncio.run(swap_series(curl, drafts, where, 3, 2, 0.2, True))
    n = args.swaps
    idle = asyncio.run(swap_series(curl, drafts, where, 5, n, 0.2))
    idle_ahead = asyncio.run(swap_series(curl, drafts, where, 5 + n, n, 0.2, True))
    loaded = asyncio.run(
        swaps_under_load(server, args, str(model), prompts, drafts, where, 5 + 2 * n)
    )
    return {
        "idle": idle,
        "under_load": loaded["one_call"],
        "idle_ahead": idle_ahead,
        "under_load_ahead": loaded["ahead"],
    }


SWAP_PARTS = (
    "prepare_ms",
    "read_check_ms",
    "read_ms",
    "check_ms",
    "hash_ms",
    "hash_wait_ms",
    "stage_ms",
    "materialize_ms",
    "load_weights_ms",
    "process_ms",
    "install_ms",
    "wait_ms",
    "commit_rpcs",
)
SWAP_SERIES = (  # key in result["swaps"], prefix, short name
    ("idle", "swap", "idle"),
    ("under_load", "swap", "load"),
    ("idle_ahead", "commit", "idle"),
    ("under_load_ahead", "commit", "load"),
)


def swap_summary(swaps: dict[str, list[dict]]) -> dict[str, float]:
    """p50/p99 of each series: swap_* for the one-call POST, commit_* for the POST after a
    prepare (prepared_after_ms: from the prepare POST until GET says ready)."""
    out: dict[str, float] = {}
    for key, prefix, short in SWAP_SERIES:
        rows = swaps.get(key) or []
        probe = "probe_rpc_ms" if prefix == "swap" else f"{prefix}_probe_rpc_ms"
        cols = [("ms", f"{prefix}_ms"), ("probe_ms", probe)]
        cols += [(p, f"{prefix}_{p}") for p in SWAP_PARTS]
        cols += [(p, f"{prefix}_{p}") for p in ("prepare_post_ms", "prepared_after_ms")]
        for col, name in cols:
            vals = [r[col] for r in rows if col in r]
            if vals:
                out[f"{name}_{short}_p50"] = pct(vals, 50)
                out[f"{name}_{short}_p99"] = pct(vals, 99)
    return out


def finish_swap_only(result: dict, out: Path) -> int:
    result["summary"] = swap_summary(result["swaps"])
    (out / "swap_result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {out / 'swap_result.json'}")
    return 0


def count_tap_tokens(taps_dir: Path) -> dict[str, int]:
    from codraft.tap import read_taps

    tokens = generated = messages = 0
    for m in read_taps(taps_dir):
        messages += 1
        tokens += m.header.num_tokens
        generated += m.header.num_tokens - m.header.prompt_len + 1
    return {"messages": messages, "tokens": tokens, "generated_tokens": generated}


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


def summarize(result: dict) -> None:
    rounds = result["rounds"]
    ratios = [r["ratio_on_off"] for r in rounds]
    cpu_ratios = [r["cpu_ratio_on_off"] for r in rounds]
    taps = result["tap_tokens"]
    nbytes = result["recorder"]["bytes_written"]
    result["summary"] = {
        "throughput_on_off_geomean": geomean(ratios),
        "throughput_loss_pct": 100 * (1 - geomean(ratios)),
        "throughput_ratio_min_max": [min(ratios), max(ratios)],
        "cpu_per_token_overhead_pct": 100 * (geomean(cpu_ratios) - 1),
        "tokens_per_s_per_server_mean": statistics.mean(
            t for r in rounds for t in r["tokens_per_s"]
        ),
        "tap_bytes_per_token": nbytes / taps["tokens"] if taps["tokens"] else None,
        "tap_bytes_per_generated_token": nbytes / taps["generated_tokens"]
        if taps["generated_tokens"]
        else None,
        "tap_messages": taps["messages"],
        "recorder_rejected": result["recorder"]["rejected"],
        **swap_summary(result["swaps"]),
        "swaps": sum(len(rows) for rows in result["swaps"].values()),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rounds = result["rounds"]
    s = result["summary"]
    ax1.bar(range(len(rounds)), [r["ratio_on_off"] - 1 for r in rounds], bottom=1.0)
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(0.98, color="grey", ls="--", lw=1, label="goal: 2% loss")
    ax1.axhline(s["throughput_on_off_geomean"], color="tab:orange", lw=1.5, label="geomean")
    ax1.set_xlabel("round (paired servers, roles alternate)")
    ax1.set_ylabel("tokens/s, tap on / tap off")
    ax1.set_title(
        f"tap cost: {s['throughput_loss_pct']:.1f}% throughput loss (geomean of rounds)",
        fontsize=10,
    )
    ax1.legend(fontsize=8)
    for key, label in (
        ("idle", "one call, idle"),
        ("under_load", "one call, under load"),
        ("idle_ahead", "prepared ahead, idle"),
        ("under_load_ahead", "prepared ahead, under load"),
    ):
        ms = sorted(r["ms"] for r in result["swaps"].get(key) or [])
        if ms:
            ax2.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], marker=".", label=label)
    ax2.axvline(100, color="grey", ls="--", lw=1)
    ax2.set_xscale("log")
    ax2.set_xlabel("POST /v1/draft round trip (ms)")
    ax2.set_ylabel("fraction of swaps")
    ax2.set_title("live draft swap latency (CDF)", fontsize=10)
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"codraft serve, {result['model']}, CPU, fp32, {result['args']['clients']} clients"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
