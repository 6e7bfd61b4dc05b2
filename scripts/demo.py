"""The codraft demo on a CPU machine: a live server gets a better draft while it serves.

1. prepares SmolLM2-135M-Instruct (converted once from its PyPI package);
2. starts `codraft serve` (vLLM with an untrained draft, EAGLE-3 or with --drafter dflash a
   DFlash block drafter, the tap on) and `codraft learn --server` (online training of the
   kind the server serves, from the tap stream, publishing drafts);
3. drives reasoning-gym prompts through the official openai client for --minutes, showing
   acceptance length and tokens/s per draft version live;
4. stops both cleanly, measures the draft the server was serving at the end (its own copy,
   which no checkpoint retention deletes) against no speculation on held-out prompts (same
   greedy requests, separate vLLM engines), and writes a JSON report and a PNG plot; the
   server's rollbacks (automatic or not, with their reasons) are in the live view and the
   report. A failure on the way is written to the report (`error`) and ends the demo with
   exit status 1 and a one-line message, not a traceback.

    python scripts/demo.py --minutes 12 --out runs/demo
    python scripts/demo.py --minutes 12 --out runs/demo-dflash --drafter dflash
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from codraft.client import CodraftClient, CodraftError
from codraft.drafters import SERVED_DRAFTERS
from codraft.prepare import prepare_smollm2
from codraft.prompts import reasoning_prompts
from codraft.server.offline import ArmSpec, run_arm_subprocess
from codraft.server.serve import free_port


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "w")  # noqa: SIM115 (lives as long as the process)
    return subprocess.Popen([sys.executable, "-m", "codraft.cli", *args], stdout=f, stderr=f)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _acceptance(client: CodraftClient) -> dict[int, float]:
    return client.stats().acceptance_lengths()


def _rollbacks(draft) -> list[dict]:
    return [r.model_dump() for r in draft.rollbacks]


async def drive(args, base_url: str, client: CodraftClient, out: Path) -> tuple:
    """Send prompts with `args.concurrency` in flight until the time is up."""
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await oai.models.list()).data[0].id
    prompts = [p.question for p in reasoning_prompts(2000, seed=args.seed)]
    records: list[dict] = []
    samples: list[dict] = []
    t0 = time.time()
    end = t0 + 60 * args.minutes
    bar = tqdm(desc="requests", unit="req", dynamic_ncols=True)
    queue = iter(prompts)
    failures: list[str] = []

    async def worker() -> None:
        while time.time() < end:
            prompt = next(queue)
            start = time.time()
            try:
                raw = await oai.chat.completions.with_raw_response.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.max_tokens,
                    temperature=0.0,
                )
            except Exception as e:  # counted and reported, the demo goes on
                failures.append(repr(e))
                continue
            resp = raw.parse()
            records.append(
                {
                    "t": time.time() - t0,
                    "seconds": time.time() - start,
                    "tokens": resp.usage.completion_tokens,
                    "version": int(raw.headers.get("x-codraft-draft-version", -1)),
                }
            )
            bar.update(1)

    rollbacks: list[dict] = []

    async def monitor() -> None:
        while time.time() < end:
            await asyncio.sleep(min(10.0, max(0.0, end - time.time())))
            try:
                acc = await asyncio.to_thread(_acceptance, client)
                draft = await asyncio.to_thread(client.draft)
            except CodraftError as e:  # the server is slow or gone: the requests say which
                bar.write(f"monitor: {e}")
                continue
            version = draft.version
            for r in _rollbacks(draft)[len(rollbacks) :]:
                rollbacks.append(r)
                bar.write(f"rollback v{r['from_version']} -> v{r['to_version']}: {r['reason']}")
            recent = [r for r in records if r["t"] > time.time() - t0 - 30]
            tps = sum(r["tokens"] for r in recent) / 30.0
            samples.append({"t": time.time() - t0, "version": version, "acceptance": acc,
                            "tokens_per_s": tps})  # fmt: skip
            bar.set_postfix(
                draft=f"v{version}", accept=f"{acc.get(version, float('nan')):.2f}",
                tok_s=f"{tps:.1f}", rollbacks=len(rollbacks),
            )  # fmt: skip
            (out / "live.json").write_text(
                json.dumps({"samples": samples, "rollbacks": rollbacks}, indent=1)
            )

    await asyncio.gather(monitor(), *(worker() for _ in range(args.concurrency)))
    bar.close()
    await oai.close()
    return records, samples, failures, rollbacks


def plot(samples: list[dict], report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    versions = sorted({int(v) for s in samples for v in s["acceptance"]})
    for v in versions:
        pts = [(s["t"] / 60, s["acceptance"][v]) for s in samples if v in s["acceptance"]]
        a.plot(*zip(*pts, strict=True), marker=".", label=f"draft v{v}")
    a.set_ylabel("acceptance length (tokens/step)")
    a.legend(fontsize=7, ncol=4)
    a.grid(alpha=0.3)
    b.plot([s["t"] / 60 for s in samples], [s["tokens_per_s"] for s in samples])
    b.set_ylabel("served tokens/s (30 s window)")
    b.set_xlabel("minutes")
    b.grid(alpha=0.3)
    speed = report.get("speedup")
    fig.suptitle(
        f"SmolLM2-135M on CPU, {report['drafter']}: served draft "
        f"v{report.get('final_draft_version')} "
        + (f"{speed:.2f}x vs no speculation" if speed else "not measured")
        + f", {report.get('rollbacks', 0)} rollbacks"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=12.0)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--heldout", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--drafter", choices=SERVED_DRAFTERS, default="eagle3", help="the kind of draft to co-train"
    )
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"drafter": args.drafter, "minutes": args.minutes}
    try:
        run(args, out, report)
    except (Exception, KeyboardInterrupt) as e:
        report["error"] = f"{type(e).__name__}: {e}"
    (out / "report.json").write_text(json.dumps(report, indent=2))
    try:
        plot(report.get("samples") or [], report, out / "demo.png")
    except Exception as e:  # a report without a plot still says what happened
        report.setdefault("error", f"plotting failed: {type(e).__name__}: {e}")
        (out / "report.json").write_text(json.dumps(report, indent=2))
    shown = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(shown, indent=2))
    if "error" in report:
        print(f"demo failed: {report['error']} (logs and report.json in {out})", file=sys.stderr)
        return 1
    print(f"plot: {out / 'demo.png'}")
    return 0


def run(args, out: Path, report: dict) -> None:
    """Steps 1-4, filling `report` as they go (what was measured survives a later failure)."""
    model = prepare_smollm2().path
    token_file = out / "control-token"
    token_file.write_text(secrets.token_hex(16))
    os.chmod(token_file, 0o600)
    token = token_file.read_text()
    port, cport, tap = free_port(), free_port(), free_port()
    server = learner = None
    try:
        print(f"[1/4] starting codraft serve (logs: {out / 'server.log'})", flush=True)
        server = _spawn(
            ["serve", "--model", str(model), "--port", str(port), "--control-port", str(cport),
             "--control-token-file", str(token_file), "--tap-endpoint", f"tcp://127.0.0.1:{tap}",
             "--dtype", "float32", "--max-model-len", "2048",
             "--num-speculative-tokens", str(args.k), "--work-dir", str(out / "server"),
             "--drafter", args.drafter,
             # eager: torch.compile costs minutes of start-up on two cores, and the demo's
             # no-speculation arms run eager too
             "--enforce-eager"],
            out / "server.log",
        )  # fmt: skip
        client = CodraftClient(f"http://127.0.0.1:{cport}", token=token)
        client.wait_ready(timeout=600)
        print(f"[2/4] starting codraft learn (logs: {out / 'learner.log'})", flush=True)
        # a DFlash step trains every slot of 8-slot blocks against the whole vocabulary: on two
        # cores it takes about 30 s beside the server, so it publishes after fewer steps
        publish_every = 10 if args.drafter == "eagle3" else 4
        learner = _spawn(
            ["learn", "--server", f"http://127.0.0.1:{cport}", "--tap", f"tcp://127.0.0.1:{tap}",
             "--target", str(model), "--out", str(out / "learner"), "--token-file",
             str(token_file), "--publish-every", str(publish_every), "--token-budget", "2048",
             "--min-buffer-tokens", "2048", "--http-port", "0", "--lr", "1e-3"],
            out / "learner.log",
        )  # fmt: skip
        print(f"[3/4] serving reasoning-gym prompts for {args.minutes:g} minutes", flush=True)
        records, samples, failures, _ = asyncio.run(
            drive(args, f"http://127.0.0.1:{port}", client, out)
        )
        final = client.draft()  # what serves at the end: the draft the held-out run measures
        rollbacks = _rollbacks(final)
        report.update(
            requests=len(records),
            failed_requests=len(failures),
            failures=failures[:5],
            final_draft_version=final.version,
            final_draft_path=final.path,
            highest_draft_version=final.highest_version,
            rollbacks=len(rollbacks),
            auto_rollbacks=sum(bool(r["auto"]) for r in rollbacks),
            rollback_events=rollbacks,
            acceptance_by_version=samples[-1]["acceptance"] if samples else {},
            samples=samples,
        )
    finally:
        _stop(learner)
        _stop(server)
    print(f"[4/4] draft v{final.version} (served at the end) vs no speculation on held-out "
          "prompts", flush=True)  # fmt: skip
    if not final.path or not Path(final.path).is_dir():
        raise RuntimeError(f"the served draft v{final.version}'s folder {final.path} is gone")
    held = [p.question for p in reasoning_prompts(args.heldout, seed=args.seed + 1)]
    common = dict(target=str(model), prompts=held, chat=True, max_tokens=args.max_tokens)
    base = run_arm_subprocess(ArmSpec(**common), out / "arms")
    report["baseline_tokens_per_s"] = base.tokens_per_s
    spec = run_arm_subprocess(
        ArmSpec(**common, draft=final.path, num_speculative_tokens=args.k, method=args.drafter),
        out / "arms",
    )
    report.update(
        heldout_prompts=len(held),
        spec_tokens_per_s=spec.tokens_per_s,
        speedup=spec.tokens_per_s / base.tokens_per_s,
        heldout_acceptance_length=spec.acceptance_length,
        identical_outputs=sum(a == b for a, b in zip(base.token_ids, spec.token_ids, strict=True)),
    )


if __name__ == "__main__":
    raise SystemExit(main())
