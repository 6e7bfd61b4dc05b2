"""Co-train an EAGLE-3 draft ONLINE for a fixed time: `codraft serve` + `codraft learn --server`.

What scripts/demo.py does on a CPU, for the GPU run (no reasoning-gym, no openai client there):

1. prepares the target (SmolLM2-135M-Instruct, `codraft prepare smollm2`'s cache);
2. starts `codraft serve` (vLLM, EAGLE-3 with the untrained draft, the tap on, bfloat16,
   gpu_memory_utilization 0.3 so the learner shares the GPU) and `codraft learn --server`
   (online training on the tap stream, bf16 autocast on CUDA, publishing drafts the server
   swaps in while it serves);
3. sends the `train` questions of scripts/gpu_vllm/prompts.json.gz as greedy chat requests,
   `--concurrency` in flight, for `--minutes` (cycled), sampling every `--sample-every` s the
   server's acceptance length per draft version and the served tokens/s;
4. stops the learner, copies the newest draft the server serves to `<work>/draft-final` (the
   benchmark's `--draft`), stops the server, and writes `<out>/cotrain.json` and
   `cotrain.png` (acceptance per draft version and served tokens/s over time).

    .gpu_venv/bin/python scripts/gpu_vllm/cotrain.py --minutes 3 --work runs/gpu_work/cotrain \\
        --out "$OUT"

With `--engine sglang` (run in the SGLang venv, `--target` a prepared folder) the server is
`codraft serve --engine sglang` (codraft.server.sglang.serve; the control routes on their own
port, as with vLLM; --gpu-mem is SGLang's --mem-fraction-static, --max-num-seqs its
--max-running-requests).

Exit status 0 when a trained draft (version > 0) was published and copied, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_prompts


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen(
        [sys.executable, "-m", "codraft.cli", *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
    )


def _stop(proc: subprocess.Popen | None, timeout: float = 60.0) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return ""


async def drive(
    args: argparse.Namespace, base_url: str, control: Any, questions: list[str], out: Path
) -> tuple[list[dict], list[dict], list[str]]:
    """Send chat requests with `args.concurrency` in flight until the time is up."""
    import httpx

    records: list[dict] = []
    samples: list[dict] = []
    failures: list[str] = []
    t0 = time.time()
    end = t0 + 60 * args.minutes
    counter = iter(range(10**9))
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def worker() -> None:
            while time.time() < end:
                q = questions[next(counter) % len(questions)]
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": q}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0.0,
                }
                start = time.time()
                try:
                    r = await http.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                except Exception as e:  # counted and reported; the load goes on
                    failures.append(repr(e)[:300])
                    await asyncio.sleep(0.5)
                    continue
                records.append(
                    {
                        "t": time.time() - t0,
                        "seconds": time.time() - start,
                        "tokens": r.json()["usage"]["completion_tokens"],
                        "version": int(r.headers.get("x-codraft-draft-version", "-1") or -1),
                    }
                )

        async def monitor() -> None:
            while time.time() < end:
                await asyncio.sleep(min(args.sample_every, max(end - time.time(), 0.1)))
                now = time.time() - t0
                try:
                    acc = (await asyncio.to_thread(control.stats)).acceptance_lengths()
                    version = (await asyncio.to_thread(control.draft)).version
                except Exception as e:
                    failures.append(f"monitor: {e!r}"[:300])
                    continue
                window = [r for r in records if r["t"] > now - args.sample_every]
                tps = sum(r["tokens"] for r in window) / args.sample_every
                samples.append(
                    {"t": now, "version": version, "acceptance": acc, "tokens_per_s": tps}
                )
                print(
                    f"  {now:6.0f}s draft v{version} acceptance "
                    f"{acc.get(version or 0, float('nan')):.2f} served {tps:8.1f} tok/s "
                    f"({len(records)} requests, {len(failures)} failures)",
                    flush=True,
                )
                (out / "cotrain-live.json").write_text(json.dumps({"samples": samples}))

        await asyncio.gather(monitor(), *(worker() for _ in range(args.concurrency)))
    return records, samples, failures


def plot(samples: list[dict], report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    versions = sorted({int(v) for s in samples for v in s["acceptance"]})
    for v in versions:
        pts = [(s["t"] / 60, s["acceptance"][v]) for s in samples if v in s["acceptance"]]
        a.plot(*zip(*pts, strict=True), marker=".", label=f"v{v}")
    serving = [
        (s["t"] / 60, s["acceptance"][s["version"]])
        for s in samples
        if s.get("version") in s["acceptance"]
    ]
    if serving:
        a.plot(*zip(*serving, strict=True), "k-", lw=2, alpha=0.5, label="serving")
    a.set_ylabel("acceptance length\n(server, per draft version)")
    if versions:
        a.legend(fontsize=6, ncol=8)
    a.grid(alpha=0.3)
    b.plot([s["t"] / 60 for s in samples], [s["tokens_per_s"] for s in samples])
    b.set_ylabel("served tokens/s")
    b.set_xlabel("minutes of co-training")
    b.grid(alpha=0.3)
    fig.suptitle(
        f"online co-training on {report.get('device')}: {report.get('requests')} requests, "
        f"final draft v{report.get('final_draft_version')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="co-training (load) time")
    p.add_argument("--work", default="runs/gpu_work/cotrain", help="server, learner, drafts")
    p.add_argument("--out", default=None, help="cotrain.json/.png here (default: --work)")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-mem", type=float, default=0.3, help="the server's share of the GPU")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--publish-every", type=int, default=50, help="learner steps per candidate")
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per learner step")
    p.add_argument("--min-buffer-tokens", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--learner-device", default="auto")
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--prompts", default=None, help="prompts file (default: prompts.json.gz)")
    p.add_argument("--ready-timeout", type=float, default=420.0)
    p.add_argument("--engine", default="vllm", choices=("vllm", "sglang"))
    p.add_argument(
        "--vllm-arg", "--engine-arg", action="append", default=[],
        help="more flags for the engine's own parser",
    )  # fmt: skip
    args = p.parse_args(argv)

    from make_prompts import DEFAULT, load_prompts

    from codraft.client import CodraftClient
    from codraft.prepare import resolve_model
    from codraft.server.serve import free_port

    work = Path(args.work).resolve()
    out = Path(args.out).resolve() if args.out else work
    for d in (work, out):
        d.mkdir(parents=True, exist_ok=True)
    for old in ("learner", "server", "draft-final"):
        shutil.rmtree(work / old, ignore_errors=True)  # a fixed-time run starts from scratch
    questions = load_prompts(Path(args.prompts) if args.prompts else DEFAULT)["train"]
    t_start = time.time()
    model = resolve_model(args.target)
    token_file = work / "control-token"
    token_file.write_text(secrets.token_hex(16))
    os.chmod(token_file, 0o600)
    port, cport, tap = free_port(), free_port(), free_port()
    report: dict[str, Any] = {"minutes": args.minutes, "args": vars(args), "target": str(model)}
    server = learner = None
    samples: list[dict] = []
    final = None
    try:
        print(f"[cotrain] codraft serve (log {work / 'server.log'})", flush=True)
        if args.engine == "sglang":
            engine = ["--engine", "sglang", "--mem-fraction-static", str(args.gpu_mem),
                      "--max-running-requests", str(args.max_num_seqs)]  # fmt: skip
        else:
            engine = ["--gpu-memory-utilization", str(args.gpu_mem),
                      "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
        server = _spawn(
            ["serve", "--model", str(model), "--port", str(port), "--control-port", str(cport),
             *engine,
             "--control-token-file", str(token_file), "--tap-endpoint", f"tcp://127.0.0.1:{tap}",
             "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--num-speculative-tokens", str(args.k), "--work-dir", str(work / "server"),
             *args.vllm_arg],
            work / "server.log",
        )  # fmt: skip
        control = CodraftClient(f"http://127.0.0.1:{cport}", token=token_file.read_text())
        t0 = time.time()
        while True:  # in short slices, so that a server that died is seen at once
            try:
                control.wait_ready(timeout=5.0)
                break
            except Exception as e:
                dead = server.poll() is not None
                if dead or time.time() - t0 > args.ready_timeout:
                    why = f"exited with {server.returncode}" if dead else f"not ready ({e!r})"
                    tail = _tail(work / "server.log")
                    raise RuntimeError(f"codraft serve {why}; its log ends:\n{tail}") from e
        report["server_ready_s"] = time.time() - t0
        print(f"[cotrain] server ready in {report['server_ready_s']:.0f}s", flush=True)
        print(f"[cotrain] codraft learn (log {work / 'learner.log'})", flush=True)
        learner = _spawn(
            ["learn", "--server", f"http://127.0.0.1:{cport}", "--tap", f"tcp://127.0.0.1:{tap}",
             "--target", str(model), "--out", str(work / "learner"), "--token-file",
             str(token_file), "--publish-every", str(args.publish_every), "--token-budget",
             str(args.token_budget), "--min-buffer-tokens", str(args.min_buffer_tokens),
             "--http-port", "0", "--lr", str(args.lr), "--k", str(args.k), "--device",
             args.learner_device],
            work / "learner.log",
        )  # fmt: skip
        print(
            f"[cotrain] {args.minutes:g} min of greedy chat requests, {args.concurrency} in "
            f"flight, {len(questions)} questions",
            flush=True,
        )
        records, samples, failures = asyncio.run(
            drive(args, f"http://127.0.0.1:{port}", control, questions, out)
        )
        if learner.poll() is not None:
            failures.append(f"the learner exited early ({learner.returncode})")
        report["learner_exit"] = _stop(learner)
        learner = None
        final = control.draft()
        try:
            report["tap"] = control.tap().model_dump()
        except Exception as e:
            report["tap"] = repr(e)
        report.update(
            requests=len(records),
            failed_requests=len(failures),
            failures=failures[:20],
            output_tokens=sum(r["tokens"] for r in records),
            served_tokens_per_s=sum(r["tokens"] for r in records) / (60 * args.minutes),
            mean_request_s=(sum(r["seconds"] for r in records) / len(records)) if records else None,
            final_draft_version=final.version,
            final_draft_source=final.path,
            acceptance_by_version=samples[-1]["acceptance"] if samples else {},
            samples=samples,
        )
        if final.version and final.path and Path(final.path).is_dir():
            shutil.copytree(final.path, work / "draft-final")
            report["draft_final"] = str(work / "draft-final")
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        print(f"[cotrain] FAILED: {report['error']}", flush=True)
    finally:
        report["learner_exit"] = report.get("learner_exit", _stop(learner))
        report["server_exit"] = _stop(server)
        report["learner_log_tail"] = _tail(work / "learner.log", 1500)
        report["wall_s"] = time.time() - t_start
    try:
        import torch

        report["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:
        report["device"] = "?"
    (out / "cotrain.json").write_text(json.dumps(report, indent=2, default=str))
    plot(samples, report, out / "cotrain.png")
    (out / "cotrain-live.json").unlink(missing_ok=True)
    ok = "draft_final" in report
    print(
        f"[cotrain] {'done' if ok else 'NO TRAINED DRAFT'}: {report.get('requests')} requests, "
        f"final draft v{report.get('final_draft_version')}, acceptance by version "
        f"{report.get('acceptance_by_version')}; report {out / 'cotrain.json'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
