"""What codraft survives, measured: a soak under live swaps, faults injected, bad input fuzzed,
security checked (docs/reliability.md).

One `codraft serve` of SmolLM2-135M-Instruct on the CPU (vLLM, EAGLE-3, k=3, fp32, eager, an
OpenAI API key and a control token) with one `codraft learn` training from its tap stream and
publishing, then, in this order:

1. soak: 16 clients of the `openai` package (completions and chat, streamed and not, greedy and
   sampled with n=2, log-probs, greedy n=2 that vLLM must refuse) for --baseline-minutes
   without swaps, then for --soak-minutes with a new draft swapped in every second and a
   rollback every 15 s. Greedy responses against vLLM without speculation, token for token;
   sampled log-probs against the target's own (transformers, fp32); every response's
   X-Codraft-Draft-Version against the versions that served during it.
2. security: every control route without and with a wrong token, every route of the OpenAI
   port's schema without and with a wrong API key (and the main ones with the right one),
   cross-site requests, the probes under 300 idle sockets, every listening socket, size limits,
   a scan of the network code for pickle.
3. checkpoints: broken draft checkpoints POSTed, the old draft serving after each.
4. fuzz: schemathesis (every check) on the control port's /openapi.json.
5. taps: --tap-frames malformed tap messages into the learner, then ten valid ones.
6. faults: the learner SIGKILLed --kills times, gone for --unreachable-s, on a full disk, with
   its newest checkpoint damaged; the server SIGKILLed mid-swap and started again.

    python scripts/bench_reliability.py --out runs/reliability      # ~40 min on 2 cores

Writes `report.json` in --out (and the processes' logs); prints the summary table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from reliability import faults, inputs, security, soak
from reliability.stack import Stack

from codraft.prepare import prepare_smollm2

PARTS = ("soak", "security", "checkpoints", "fuzz", "taps", "faults")
REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/reliability")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--soak-minutes", type=float, default=10.0)
    p.add_argument("--baseline-minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--unreachable-s", type=float, default=60.0)
    p.add_argument("--tap-frames", type=int, default=100_000)
    p.add_argument("--fuzz-examples", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; expected some of {PARTS}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = prepare_smollm2().path
    report: dict = {"model": "SmolLM2-135M-Instruct", "args": vars(args), "started": time.time()}
    t0 = time.monotonic()
    print("[reliability] greedy references without speculation", flush=True)
    refs = soak.greedy_references(model, out)
    stack = Stack(model, out / "stack")
    try:
        print("[reliability] codraft serve + codraft learn", flush=True)
        report["server_start_s"] = stack.start_server()
        report["learner_start_s"] = stack.start_learner()
        swapper = soak.Swapper(stack, out / "drafts")
        if "soak" in parts:
            print(f"[reliability] baseline: {args.baseline_minutes} min, no swaps", flush=True)
            base = asyncio.run(soak.drive(stack, 60 * args.baseline_minutes, None, args.clients))
            print(f"[reliability] soak: {args.soak_minutes} min, a swap a second", flush=True)
            live = asyncio.run(soak.drive(stack, 60 * args.soak_minutes, swapper, args.clients))
            print("[reliability] checking log-probs against transformers", flush=True)
            scorer = soak.PolicyScorer(model)
            report["soak"] = {
                "baseline": soak.check(base, refs, scorer),
                "swaps": soak.check(live, refs, scorer),
                "swapper": soak.swap_figures(swapper),
                "learner": {
                    k: v
                    for k, v in stack.learner_metrics().items()
                    if k.startswith(
                        (
                            "codraft_learner_published",
                            "codraft_learner_steps",
                            "codraft_learner_publish_failures",
                        )
                    )
                },
            }
            del scorer
            _save(out, report)
        steps = {
            "security": lambda: security.run(stack, REPO),
            "checkpoints": lambda: inputs.checkpoint_matrix(stack, out),
            "fuzz": lambda: inputs.fuzz_control(stack, args.fuzz_examples, out),
            "taps": lambda: inputs.tap_frames(stack, args.tap_frames, args.seed),
            "faults": lambda: faults.run(
                stack, swapper, refs, out, args.kills, args.unreachable_s, args.seed
            ),
        }
        for name, step in steps.items():
            if name not in parts:
                continue
            print(f"[reliability] {name}", flush=True)
            try:
                report[name] = step()
            except Exception as e:  # a part that breaks is reported; the others still run
                report[name] = {"error": f"{type(e).__name__}: {e}"}
                print(f"[reliability] {name} failed: {e}", flush=True)
            _save(out, report)
    finally:
        stack.stop()
        report["seconds"] = time.monotonic() - t0
        _save(out, report)
    print(json.dumps(summary(report), indent=1))
    return 0


def _save(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


def summary(r: dict) -> dict:
    """The figures docs/reliability.md tabulates."""
    s: dict = {}
    if "soak" in r:
        for phase in ("baseline", "swaps"):
            f = r["soak"][phase]
            s[phase] = {
                k: f[k]
                for k in (
                    "requests",
                    "failures",
                    "refused_as_expected",
                    "lossless_pct",
                    "bad_versions",
                    "logprob_max_abs_diff",
                    "latency_p50_s",
                    "latency_p99_s",
                    "greedy_latency_p50_s",
                    "greedy_latency_p99_s",
                )
            }
        s["swapper"] = r["soak"]["swapper"]
    if "security" in r:
        sec = r["security"]
        s["security"] = {
            k: sec[k]
            for k in (
                "control_all_401",
                "openai_key_enforced",
                "all_loopback",
                "cross_site_refused",
                "probes_answered_under_slowloris",
            )
        }
        s["security"]["pickle_findings"] = sec["pickle"]["findings"]
    if "checkpoints" in r:
        s["checkpoints"] = {c["case"]: c["status"] for c in r["checkpoints"]["cases"]}
    if "fuzz" in r:
        s["fuzz"] = {
            k: r["fuzz"][k] for k in ("cases", "failures", "server_errors_5xx", "exit_code")
        }
    if "taps" in r:
        s["taps"] = {
            k: r["taps"][k] for k in ("sent", "rejected", "valid_after_accepted", "learner_alive")
        }
    if "faults" in r:
        f = r["faults"]
        s["faults"] = {
            "learner_kills": {
                k: f["learner_kills"][k]
                for k in ("kills", "resumed_at_newest_checkpoint", "versions_monotonic")
            },
            "learner_unreachable": f["learner_unreachable"],
            "full_disk": {
                k: f["full_disk"].get(k)
                for k in (
                    "checkpoint_failures",
                    "learner_alive",
                    "checkpoints_whole",
                    "torn_or_temp",
                    "skipped",
                )
            },
            "corrupt_newest_checkpoint": f["corrupt_newest_checkpoint"],
            "load_during_learner_faults": {
                k: f["load_during_learner_faults"][k]
                for k in ("requests", "failures", "lossless_pct")
            },
            "server_restart_mid_swap": f["server_restart_mid_swap"],
        }
    return s


if __name__ == "__main__":
    sys.exit(main())
