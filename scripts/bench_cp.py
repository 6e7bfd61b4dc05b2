"""Benchmark context-parallel TTT attention: time and per-GPU memory, K passes forward + backward.

Every measurement runs the K sequential attention calls of one TTT step (pass d attends the
trunk of pass 1 and its own anchor in passes 2..d) over one document of T tokens, then one
backward, with the draft shape of an 8B-class target (32 / 8 heads, head dim 128, bf16).

* ``overhead`` (one device): the ring code at CP = 1 (codraft.learner.attention.ring with a ring of
  one) against the plain single-device path (codraft.learner.attention.pass_attention).
* ``memory`` (one device): one CP rank's share at CP = 1, 2, 4, 8, the other ranks simulated by
  LoopbackRing (same kernels, same buffers, no second GPU): memory held after the forward
  (saved for backward) and the peak, against codraft.learner.parallel.memory's model.
* ``ring`` (under torchrun, WORLD_SIZE > 1): the real ring over NCCL (gloo on CPU) with
  CP = world size; per-rank time and peak; with --smoke also the error against one device.

    python scripts/bench_cp.py --out bench/cp.json                        # 1 GPU: overhead, memory
    torchrun --nproc-per-node 8 scripts/bench_cp.py --out bench/cp8.json  # ring over 8 GPUs
    python scripts/bench_cp.py --smoke --out /tmp/cp_smoke.json           # CPU
    torchrun --nproc-per-node 2 scripts/bench_cp.py --smoke --out /tmp/cp_ring.json  # gloo

Writes a JSON list of records (rewritten after each) and, where matplotlib exists, a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.attention.ring import ring_pass_attention
from codraft.learner.parallel import memory
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, shutdown
from codraft.learner.parallel.ring_comm import LoopbackRing, Ring
from codraft.learner.parallel.zigzag import ZigzagLayout, shard, zigzag_layout

MIB = 2**20
ONE = Ring.of(None)  # a ring of one rank: no communication


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Inputs:
    """Base tensors of K passes (created before the baseline) and their upstream gradients."""

    def __init__(self, t: int, args: argparse.Namespace, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        dt = args.torch_dtype

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=g, device=device, dtype=dt)

        k_ = args.passes
        self.q = [rand(t, args.heads, args.head_dim) for _ in range(k_)]
        self.k = [rand(t, args.kv_heads, args.head_dim) for _ in range(k_)]
        self.v = [rand(t, args.kv_heads, args.head_dim) for _ in range(k_)]
        self.g = [rand(t, args.heads, args.head_dim) for _ in range(k_)]


Attn = Callable[[torch.Tensor, list[torch.Tensor], list[torch.Tensor]], torch.Tensor]


def _step(attn: Attn, x: Inputs, device: torch.device) -> dict[str, float]:
    """K passes forward, one backward. The activations are ``base * p`` (p a scalar leaf), so
    nothing but the attention's own tensors is allocated past the baseline."""
    _sync(device)
    base = _allocated(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    p = torch.ones((), device=device, dtype=x.q[0].dtype, requires_grad=True)
    ks = [k * p for k in x.k]
    vs = [v * p for v in x.v]
    outs = [attn(x.q[d] * p, ks[: d + 1], vs[: d + 1]) for d in range(len(x.q))]
    del ks, vs
    _sync(device)
    saved = _allocated(device) - base
    torch.autograd.backward(outs, x.g)
    _sync(device)
    rec = {"ms": 1e3 * (time.perf_counter() - t0), "saved_mib": saved / MIB}
    if device.type == "cuda":
        rec["peak_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MIB
    return rec


def _measure(attn: Attn, x: Inputs, device: torch.device, repeats: int) -> dict[str, float]:
    _step(attn, x, device)  # warm-up
    runs = [_step(attn, x, device) for _ in range(repeats)]
    out = {k: min(r[k] for r in runs) if k == "ms" else max(r[k] for r in runs) for k in runs[0]}
    return out


def _emit(records: list[dict], rec: dict, out: Path) -> None:
    records.append(rec)
    print(json.dumps(rec), flush=True)
    out.write_text(json.dumps(records, indent=2))


def _shape(args: argparse.Namespace) -> memory.AttnShape:
    b = torch.tensor([], dtype=args.torch_dtype).element_size()
    return memory.AttnShape(args.heads, args.kv_heads, args.head_dim, b)


def run_overhead(args, device, records) -> None:
    for t in args.tokens:
        cu = torch.tensor([0, t], dtype=torch.int32, device=device)
        lay = zigzag_layout(cu, 1, 0)
        x = Inputs(t, args, device)
        methods: dict[str, Attn] = {
            "plain": lambda q, ks, vs, cu=cu: pass_attention(q, ks, vs, cu),
            "ring_cp1": lambda q, ks, vs, lay=lay: ring_pass_attention(q, ks, vs, lay, ONE),
        }
        with torch.no_grad():
            a = methods["plain"](x.q[-1], x.k, x.v).float()
            b = methods["ring_cp1"](x.q[-1], x.k, x.v).float()
        err = (a - b).abs().max().item()
        for name, fn in methods.items():
            rec = {"mode": "overhead", "method": name, "tokens": t, "passes": args.passes}
            rec.update(_measure(fn, x, device, args.repeats), max_err_vs_plain=err)
            _emit(records, rec, args.out)
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_memory(args, device, records) -> None:
    shape = _shape(args)
    t = args.mem_tokens
    for cp in args.cps:
        ranks = sorted({0, cp - 1})
        for r in ranks:
            n_local = memory.local_tokens(t, cp)
            cu = torch.tensor([0, n_local * cp], dtype=torch.int32, device=device)
            lay = zigzag_layout(cu, cp, r)
            ring = LoopbackRing(cp, r) if cp > 1 else Ring.of(None)
            x = Inputs(n_local, args, device)

            def attn(q, ks, vs, lay: ZigzagLayout = lay, ring: Ring = ring) -> torch.Tensor:
                return ring_pass_attention(q, ks, vs, lay, ring)

            rec = {"mode": "memory", "cp": cp, "rank": r, "tokens": t, "passes": args.passes}
            rec.update(_measure(attn, x, device, 1))
            rec["model_saved_mib"] = memory.saved_bytes(t, cp, args.passes, shape) / MIB
            rec["model_peak_mib"] = memory.peak_bytes(t, cp, args.passes, shape) / MIB
            _emit(records, rec, args.out)
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()


def run_ring(args, device, records, mesh) -> None:
    """The real ring (CP = world size): per-rank time and peak, max over ranks."""
    ring = Ring.of(mesh.cp_group)
    cp, r = ring.size, ring.rank
    for t in args.tokens:
        n = memory.local_tokens(t, cp) * cp
        cu = torch.tensor([0, n], dtype=torch.int32, device=device)
        lay = zigzag_layout(cu, cp, r)
        full = Inputs(n, args, device) if args.smoke else None
        x = Inputs(n // cp, args, device, seed=1 + r)
        if full is not None:  # same global tensors on every rank; this rank's rows
            for name in ("q", "k", "v", "g"):
                setattr(x, name, [shard(y, lay) for y in getattr(full, name)])

        def attn(q, ks, vs, lay: ZigzagLayout = lay) -> torch.Tensor:
            return ring_pass_attention(q, ks, vs, lay, ring)

        rec = {"mode": "ring", "cp": cp, "tokens": n, "passes": args.passes}
        rec.update(_measure(attn, x, device, args.repeats))
        if full is not None:
            with torch.no_grad():
                got = attn(x.q[-1], x.k, x.v).float()
                want = pass_attention(full.q[-1], full.k, full.v, cu).float()
            rec["max_err_vs_one_device"] = (got - shard(want, lay)).abs().max().item()
        vals = torch.tensor([rec.get(k, 0.0) for k in ("ms", "saved_mib", "peak_mib")])
        vals = vals.to(device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        rec.update(zip(("ms", "saved_mib", "peak_mib"), vals.tolist(), strict=True))
        if "max_err_vs_one_device" in rec:
            err = torch.tensor([rec["max_err_vs_one_device"]], device=device)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            rec["max_err_vs_one_device"] = err.item()
        if mesh.is_main:
            _emit(records, rec, args.out)


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    over = [r for r in records if r["mode"] == "overhead"]
    for name in ("plain", "ring_cp1"):
        rs = [r for r in over if r["method"] == name]
        if rs:
            axes[0].plot([r["tokens"] for r in rs], [r["ms"] for r in rs], marker="o", label=name)
    axes[0].set(title="K passes fwd + bwd, one GPU", xlabel="tokens", ylabel="ms", xscale="log")
    mem = [r for r in records if r["mode"] == "memory"]
    if mem:
        cps = sorted({r["cp"] for r in mem})
        peak = [max(r.get("peak_mib", 0) for r in mem if r["cp"] == c) / 1024 for c in cps]
        saved = [max(r["saved_mib"] for r in mem if r["cp"] == c) / 1024 for c in cps]
        model_p = [next(r["model_peak_mib"] for r in mem if r["cp"] == c) / 1024 for c in cps]
        model_s = [next(r["model_saved_mib"] for r in mem if r["cp"] == c) / 1024 for c in cps]
        axes[1].plot(cps, peak, "o-", label="measured peak")
        axes[1].plot(cps, model_p, "x--", label="model peak S + W")
        axes[1].plot(cps, saved, "o-", label="measured saved")
        axes[1].plot(cps, model_s, "x--", label="model saved S")
        tok = mem[0]["tokens"]
        axes[1].set(title=f"per-GPU memory, {tok} tokens", xlabel="CP", ylabel="GiB", xscale="log")
        axes[1].set_xticks(cps, [str(c) for c in cps])
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["overhead", "memory"])
    ap.add_argument("--tokens", type=ints, default=[16384, 65536, 262144])
    ap.add_argument("--mem-tokens", type=int, default=262144)
    ap.add_argument("--cps", type=ints, default=[1, 2, 4, 8])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_cp.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in fp32")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.mem_tokens, args.cps, args.repeats = [64, 256], 256, [1, 2, 4], 1
        args.heads, args.kv_heads, args.head_dim, args.dtype = 4, 2, 16, "fp32"
    args.torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype
    ]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_name = "cpu" if args.smoke else "auto"
    mesh, device = init_distributed(ParallelConfig(cp=world, device=device_name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    try:
        if world > 1:
            run_ring(args, device, records, mesh)
        else:
            if "overhead" in args.modes:
                run_overhead(args, device, records)
            if "memory" in args.modes:
                run_memory(args, device, records)
        if mesh.is_main and records:
            plot(records, args.out.with_suffix(".png"))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
