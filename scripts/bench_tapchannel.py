"""Benchmark the target pipeline's step time with TapChannel on and off.

"off": the pipeline alone (no taps requested). "on": the same pipeline while every tap-making stage
puts its taps on TapChannel and the last stage takes them (the draft's input). The difference is
what tap traffic costs the pipeline; docs/architecture.md (Parallelism) asks for none beyond the
bytes themselves, since taps travel over their own process groups into pre-posted landing slots.

The target is a random Llama-shaped model built stage by stage on the device (no weights file):
by default an 8B-class shape (32 layers, H 4096, 32/8 heads, bf16). Every rank builds only its
stage. Modes alternate (off, on, off, on, ...) so drift hits both alike; a step's time is the
slowest rank's, from a barrier to the last stage's end of step.

    torchrun --nproc-per-node 4 scripts/bench_tapchannel.py --out bench/tapchannel_pp4.json
    torchrun --nproc-per-node 2 scripts/bench_tapchannel.py --smoke   # CPU, gloo, tiny model

Needs torch only (and this repository). Prints one JSON summary on rank 0 and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from codraft.learner.data.packing import Sample, pack
from codraft.learner.parallel import host_staged
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, shutdown
from codraft.learner.parallel.pipeline import Pipeline, PipelineConfig
from codraft.learner.parallel.pipeline_mesh import PipelineGroups
from codraft.learner.parallel.stage import TargetStage, split_layers
from codraft.learner.parallel.tapchannel import TapChannelConfig
from codraft.models.config import TargetConfig, default_tap_layers
from codraft.models.layers import RotaryEmbedding
from codraft.models.llama import TargetModel


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """The random target's shape (8B-class by default) and the batch size in tokens."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_arguments(p)
    p.add_argument("--docs", type=int, default=16, help="documents per batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--slots", type=int, default=2, help="TapChannel landing slots per source")
    p.add_argument("--no-verify", action="store_true", help="no TapChannel headers")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo), few steps")
    p.add_argument("--out", default=None, help="JSON file for the summary")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab = 4, 64, 128, 2, 1, 512
        a.tokens, a.docs, a.microbatches, a.steps, a.warmup, a.rounds = 512, 8, 4, 3, 1, 1
        a.dtype = "float32"
    return a


def random_stage(cfg: TargetConfig, index: int, num: int, dtype, device) -> TargetStage:
    """Stage `index` of a random target, materialized on `device` alone (same on every run):
    weights N(0, 0.02), norms 1, drawn on the device itself (seconds, even for 8B-class)."""
    with torch.device("meta"):
        model = TargetModel(cfg)
    stage = TargetStage.from_model(model, index, num).to(dtype)
    stage.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1234 + index)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    stage.__dict__["rotary"] = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(device)
    return stage.requires_grad_(False).eval()


def connect_p2p(groups: PipelineGroups, sources: Sequence[int], device: torch.device) -> None:
    """Open every point-to-point path of the step (activations s -> s+1 on the pipeline group,
    taps source -> last on the tap group, credits last -> source on the credit group) one at a
    time, in the same order on every rank, before the first step. NCCL connects two ranks on
    their first send/recv in a group (torch may first create a 2-rank communicator), blocking the
    host until the peer joins too: left to the first step, stage 0's first activation send and
    the last stage's first tap receive (posted before it waits for activations) could each wait
    for the other (not yet seen on GPUs). Collective over the pipeline; costs nothing on gloo.
    Goes through `codraft.learner.parallel.host_staged` like the pipeline's own transfers."""
    ranks, last, me = groups.stage_ranks, groups.stage_ranks[-1], dist.get_rank()
    edges = [(groups.pp_group, a, b) for a, b in zip(ranks[:-1], ranks[1:], strict=True)]
    edges += [(groups.tap_group, s, last) for s in sources]
    edges += [(groups.credit_group, last, s) for s in sources]
    for group, src, dst in edges:
        if me == src:
            host_staged.send(torch.zeros(1, device=device), dst, group)
        elif me == dst:
            host_staged.recv(torch.zeros(1, device=device), src, group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def make_batch(a: argparse.Namespace):
    g = torch.Generator().manual_seed(0)
    cuts = sorted(torch.randperm(a.tokens - 1, generator=g)[: a.docs - 1].add(1).tolist())
    lens = [b - c for c, b in zip([0, *cuts], [*cuts, a.tokens], strict=True)]
    return pack([Sample(torch.randint(0, a.vocab, (n,), generator=g)) for n in lens])


def main() -> int:
    a = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # every rank a stage of one pipeline
    mesh, device = init_distributed(ParallelConfig(pp=world, device="cpu" if a.smoke else "auto"))
    dtype = getattr(torch, a.dtype)
    cfg = TargetConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
    )  # fmt: skip
    groups = PipelineGroups.build(mesh)
    P = groups.num_stages
    stage = random_stage(cfg, groups.stage, P, dtype, device)
    taps = default_tap_layers(a.layers)
    ranges = split_layers(a.layers, P)
    channel = groups.tap_channel(
        taps, ranges, dtype=dtype, device=device,
        config=TapChannelConfig(slots=a.slots, verify=not a.no_verify),
    )  # fmt: skip
    connect_p2p(groups, groups.tap_sources(taps, ranges), device)
    pcfg = PipelineConfig(a.microbatches)
    pipes = {
        "off": Pipeline(stage, groups, (), None, pcfg),
        "on": Pipeline(stage, groups, taps, channel, pcfg),
    }
    batch = make_batch(a)
    seen: dict[str, list[torch.Tensor]] = {"off": [], "on": []}

    def consumer(mode: str):
        def take(out) -> None:
            if a.smoke:
                seen[mode].append(out.last_hidden.clone())

        return take

    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(a.rounds):
        for mode in ("off", "on"):
            for i in range(a.warmup + a.steps):
                dist.barrier()
                t0 = time.perf_counter()
                pipes[mode].run(batch, consumer(mode) if groups.is_last else None)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= a.warmup:
                    times[mode].append(float(dt))
    if channel is not None:
        channel.close()
    summary = {
        "world": P, "layers": a.layers, "hidden": a.hidden, "tokens": a.tokens,
        "microbatches": a.microbatches, "slots": a.slots, "verify": not a.no_verify,
        "dtype": a.dtype, "device": str(device), "tap_layers": list(taps),
        "tap_sources": groups.tap_sources(taps, ranges),
        "tap_bytes_per_step": a.tokens * len(taps) * a.hidden * torch.finfo(dtype).bits // 8,
    }  # fmt: skip
    for mode, ts in times.items():
        summary[f"{mode}_median_s"] = statistics.median(ts)
        summary[f"{mode}_p90_s"] = sorted(ts)[int(0.9 * (len(ts) - 1))]
    summary["overhead"] = summary["on_median_s"] / summary["off_median_s"] - 1
    if channel is not None:
        stats = torch.tensor([channel.stats.put_blocked_s, channel.stats.get_wait_s], device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        n = a.rounds * (a.warmup + a.steps)
        summary["max_put_blocked_s_per_step"] = float(stats[0]) / n
        summary["max_get_wait_s_per_step"] = float(stats[1]) / n
    if a.smoke and groups.is_last:  # non-interference: the pipeline's own results are unchanged
        same = all(torch.equal(x, y) for x, y in zip(seen["off"], seen["on"], strict=True))
        summary["last_hidden_equal_on_off"] = same
    if dist.get_rank() == P - 1:
        print(json.dumps(summary, indent=2))
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(summary, indent=2) + "\n")
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
