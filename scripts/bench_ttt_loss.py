"""Memory and time of the TTT loss: the draft's logits and soft cross-entropy over K passes.

Two ways, each in a process of its own (peak resident memory is per process), forward and
backward of K passes' loss against a soft teacher over the draft vocab:

* ``whole``: lm_head over every anchor, log-softmax in fp32, kept by autograd for backward (what
  codraft's TTT did before its loss was chunked; the way most EAGLE-3 trainers compute it);
* ``chunked``: codraft.learner.chunked_loss.cross_entropy, the product's loss, at
  ``--chunks`` rows per chunk (logits of one chunk at a time, recomputed in backward).

Reported per arm: peak resident memory above what the inputs take, and the time of forward +
backward (median of ``--repeats``). Gradients of both arms are compared (they must agree).

    .venv/bin/python scripts/bench_ttt_loss.py --out docs/bench/ttt_loss_cpu.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from codraft.learner.chunked_loss import cross_entropy


def inputs(args: argparse.Namespace) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hs = [torch.randn(args.tokens, args.hidden, generator=g) for _ in range(args.passes)]
    w = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    t = torch.empty(args.tokens, args.vocab).uniform_(generator=g)  # in place: no transient
    t /= t.sum(-1, keepdim=True)  # that would lift the peak before the arm runs
    return [h.requires_grad_() for h in hs], w.requires_grad_(), t


def loss_of(arm: str, chunk: int, hs: list[torch.Tensor], w: torch.Tensor, t: torch.Tensor):
    total = torch.zeros(())
    for h in hs:
        if arm == "whole":
            total = total - (t * F.log_softmax(h @ w.t(), dim=-1)).sum()
        else:
            total = total + cross_entropy(h, w, t, hard=False, chunk=chunk, acc=torch.float32)[0]
    return total


def worker(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    hs, w, t = inputs(args)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, inputs made
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loss = loss_of(args.arm, args.chunk, hs, w, t)
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = torch.cat([h.grad.flatten()[:1000] for h in hs] + [w.grad.flatten()[:1000]])
    return {"arm": args.arm, "chunk": args.chunk, "loss": float(loss),
            "extra_mib": (peak - base) / 1024, "seconds": statistics.median(times),
            "grad_sample": grads.tolist()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/ttt_loss.json")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--chunks", default="512,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.arm:
        print(json.dumps(worker(args)))
        return 0
    common = [f"--{k}={getattr(args, k)}" for k in
              ("tokens", "hidden", "vocab", "passes", "repeats", "threads")]  # fmt: skip
    arms = [("whole", 0)] + [("chunked", int(c)) for c in args.chunks.split(",")]
    results = []
    for arm, chunk in arms:
        cmd = [sys.executable, __file__, f"--arm={arm}", f"--chunk={chunk}", *common]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{arm:8s} chunk {chunk:5d}: +{r['extra_mib']:.0f} MiB, {r['seconds']:.2f} s")
    ref = torch.tensor(results[0]["grad_sample"])
    for r in results:
        r["max_grad_diff_vs_whole"] = float((torch.tensor(r.pop("grad_sample")) - ref).abs().max())
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    report = {
        "command": " ".join(["python scripts/bench_ttt_loss.py", *(argv or sys.argv[1:])]),
        "geometry": {k: getattr(args, k) for k in ("tokens", "hidden", "vocab", "passes")},
        "fp32_logits_of_one_pass_mib": logits_mib,
        "device": "cpu",
        "arms": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
