"""Strong scaling of one full TTT draft training step under context parallelism (CP = world size).

One step is what ``codraft.learner.trainer.Trainer.step`` does after sharding: the teacher's
draft-vocab logits from the last hidden states (``Teacher.draft_logits``, in the head's
``TrainConfig.teacher_dtype``, bf16 on CUDA), K TTT passes of the draft under bf16
autocast (``ContextParallel.ttt_forward``: ring attention, boundary rolls, lm_head over the
draft vocab, soft cross-entropy), backward, the gradient all-reduce over the CP ranks, clipping,
AdamW and the metrics all-reduce. The draft is shaped for an 8B-class target
(hidden 4096, 32 / 8 heads of 128, MLP 14336, vocab 128256, draft vocab 32000, 3 taps). Features are
random tensors made on each rank for its own zigzag shard (no target model runs); the target's
head is random too. The global batch is the same at every CP (documents padded to multiples of
16), so runs at CP = 1, 2, 4, 8 are a strong-scaling series.

Methods (``--methods``):

* ``ring``: the learner's CP step (``codraft.learner.parallel.context.ContextParallel``);
* ``gather``: the baseline at the same CP, the same step with another attention: each rank
  all-gathers the trunk's K/V of the whole sequence (per pass, kept for backward) and runs its
  local query chunks against the gathered keys (flash varlen blocks over each chunk's whole
  causal key range: the prefix before the chunk, plus the chunk itself causally); the key
  gradients are reduce-scattered back. The branch (own-anchor keys) is rank-local, as in the
  ring. O(T) keys per rank, no ring;
* ``plain`` (world size 1 only): the single-device trainer path (``pass_attention``, no CP).

Per case (tokens x layout x method): the step's time (median over ``--repeats`` steps after
``--warmup``, each step's time the max over ranks) and peak memory per GPU
(``torch.cuda.max_memory_allocated``, absolute, max over ranks); then the attention alone: K
passes forward + backward of the same per-rank shapes with random q/k/v (same median / max),
whose time divided by the step's is the attention share reported. A case that runs out of
memory is recorded as ``"status": "oom"`` and the run goes on.

    torchrun --standalone --nproc-per-node 8 scripts/bench_cp_train.py \\
        --out docs/bench/cp_train_cp8.json
    python scripts/bench_cp_train.py --out docs/bench/cp_train_cp1.json   # CP = 1
    python scripts/bench_cp_train.py --combine docs/bench/cp_train_cp*.json \\
        --out docs/bench/cp_train.json                 # efficiency, ratios, table, PNG
    torchrun --nproc-per-node 2 scripts/bench_cp_train.py --smoke --out /tmp/x.json

docs/benchmarks.md ("Context-parallel draft training") has the commands per CP and what to expect.

``--smoke``: tiny shapes on CPU in fp32; also checks every method's loss and draft gradients
(summed over ranks) against the single-process step on the whole batch, and exits 1 on a
mismatch. Writes a JSON list of records (rewritten after each) and, where matplotlib exists, a
PNG next to it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from codraft.draft.config import DraftConfig
from codraft.draft.model import Eagle3Draft
from codraft.learner.attention.block import Backend, block_backward, block_forward
from codraft.learner.attention.pass_attention import pass_attention
from codraft.learner.attention.ring import ring_pass_attention
from codraft.learner.attention.ring_branch import (
    branch_backward_into,
    branch_merge_into,
    merge_into,
)
from codraft.learner.data.packing import PackedBatch
from codraft.learner.parallel import memory
from codraft.learner.parallel.context import ContextParallel, Shard
from codraft.learner.parallel.launch import ParallelConfig, init_distributed, shutdown
from codraft.learner.parallel.mesh import ParallelMesh
from codraft.learner.parallel.ring_comm import Ring
from codraft.learner.parallel.zigzag import ZigzagLayout, all_indices, zigzag_layout
from codraft.learner.teacher import Teacher
from codraft.learner.trainer import TrainConfig
from codraft.learner.ttt import PassAttention, TTTConfig, TTTOutput, ttt_forward

GIB = 2**30
DOC_MULTIPLE = 16  # documents padded to this (2 x CP for CP <= 8): one batch for every CP
MAX_GRAD_NORM = 0.5  # TrainConfig's defaults
LR, BETAS = 3e-4, (0.9, 0.95)
SMOKE_TOL = 1e-4  # fp32 relative error bound of the smoke check
R = TypeVar("R")


# ------------------------------------------------------------------------ the gather baseline
@dataclass(frozen=True)
class KeyPrefix:
    """The gathered trunk rows before one local chunk, per document: front or back half."""

    cu: Tensor  # int32 [B + 1]
    index: Tensor | None  # int64 rows of the gathered [T] keys; None: rows 0..length (one doc)
    length: int

    def take(self, x: Tensor) -> Tensor:
        return x[: self.length] if self.index is None else x.index_select(0, self.index)

    def add(self, dst: Tensor, src: Tensor) -> None:
        if self.index is None:
            dst[: self.length].add_(src)
        else:
            dst.index_add_(0, self.index, src.to(dst.dtype))


@dataclass(frozen=True)
class GatherPlan:
    lay: ZigzagLayout
    group: ProcessGroup | None
    order: Tensor  # int64 [T]: global rows in all-gather order (rank 0's rows, rank 1's, ...)
    inverse: Tensor  # int64 [T]: all-gather row of each global row
    front: KeyPrefix
    back: KeyPrefix


def _prefix(starts: list[int], lengths: list[int], device: torch.device) -> KeyPrefix:
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    total = sum(lengths)
    if len(starts) == 1:
        return KeyPrefix(cu, None, total)
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    return KeyPrefix(cu, index.to(device), total)


def gather_plan(lay: ZigzagLayout, group: ProcessGroup | None) -> GatherPlan:
    cp, r, dev = lay.cp_size, lay.cp_rank, lay.index.device
    global_cu = lay.local_cu.to(torch.int64) * cp  # every document is 2 cp chunks long
    starts = global_cu[:-1].tolist()
    order = all_indices(global_cu, cp).to(dev)
    front = _prefix(starts, [r * c for c in lay.chunks], dev)
    back = _prefix(starts, [(2 * cp - 1 - r) * c for c in lay.chunks], dev)
    return GatherPlan(lay, group, order, torch.argsort(order), front, back)


def _all_gather(x: Tensor, plan: GatherPlan) -> Tensor:
    """Every rank's local rows [t, ...] -> the whole trunk [T, ...] in global order."""
    if plan.group is None:
        return x  # CP = 1: local order is global order
    buf = x.new_empty((plan.order.numel(), *x.shape[1:]))
    dist.all_gather_into_tensor(buf, x.contiguous(), group=plan.group)
    return buf.index_select(0, plan.inverse)


def _reduce_scatter(full: Tensor, plan: GatherPlan) -> Tensor:
    """Partial gradients of the whole trunk [T, ...] -> this rank's rows [t, ...], summed."""
    if plan.group is None:
        return full
    out = full.new_empty((plan.lay.num_local, *full.shape[1:]))
    dist.reduce_scatter_tensor(out, full.index_select(0, plan.order), group=plan.group)
    return out


def _put_half(lay: ZigzagLayout, back: bool, dst: Tensor, src: Tensor) -> None:
    if lay.num_docs == 1:
        dst.narrow(0, lay.chunks[0] if back else 0, lay.chunks[0]).copy_(src)
    else:
        dst.index_copy_(0, lay.back if back else lay.front, src.to(dst.dtype))


def _halves(plan: GatherPlan) -> list[tuple[bool, Callable[[Tensor], Tensor], KeyPrefix]]:
    lay = plan.lay
    return [(False, lay.take_front, plan.front), (True, lay.take_back, plan.back)]


def gather_forward(
    q: Tensor, k: Tensor, v: Tensor, kf: Tensor, vf: Tensor, plan: GatherPlan, scale: float,
    backend: Backend,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Trunk attention of the local queries against the gathered keys kf/vf [T, Hkv, D]:
    -> (out [t, Hq, D], lse [t, Hq]) in fp32. Each chunk: its own rows causally, the document's
    rows before it in full, merged by log-sum-exp."""
    hcu, acc = plan.lay.half_cu, torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty(q.shape, dtype=acc)
    lse = q.new_empty(q.shape[:2], dtype=acc)
    for back, take, prefix in _halves(plan):
        qh = take(q)
        o, l_ = block_forward(
            qh, take(k), take(v), hcu, hcu, causal=True, scale=scale, backend=backend
        )
        oh, lh = o.to(acc), l_.t().contiguous().to(acc)
        if prefix.length:
            o, l_ = block_forward(
                qh, prefix.take(kf), prefix.take(vf), hcu, prefix.cu, causal=False, scale=scale,
                backend=backend,
            )  # fmt: skip
            merge_into(oh, lh, o, l_.t())
        _put_half(plan.lay, back, out, oh)
        _put_half(plan.lay, back, lse, lh)
    return out, lse


def gather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, kf: Tensor, vf: Tensor, out: Tensor,
    lse: Tensor, plan: GatherPlan, scale: float, backend: Backend,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) in fp32 of the trunk's share, replayed with the joint out/lse."""
    lay, hcu = plan.lay, plan.lay.half_cu
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    dkf = torch.zeros(kf.shape, dtype=acc, device=q.device)
    dvf = torch.zeros_like(dkf)
    for back, take, prefix in _halves(plan):
        add = lay.add_back if back else lay.add_front
        qh, dh, oh, lh = take(q), take(dout), take(out), take(lse).t()
        dqh, dkh, dvh = block_backward(
            dh, qh, take(k), take(v), oh, lh, hcu, hcu, causal=True, scale=scale, backend=backend
        )
        add(dq, dqh)
        add(dk, dkh)
        add(dv, dvh)
        if prefix.length:
            dqh, dkh, dvh = block_backward(
                dh, qh, prefix.take(kf), prefix.take(vf), oh, lh, hcu, prefix.cu, causal=False,
                scale=scale, backend=backend,
            )  # fmt: skip
            add(dq, dqh)
            prefix.add(dkf, dkh)
            prefix.add(dvf, dvh)
        del dqh, dkh, dvh
    dk += _reduce_scatter(dkf, plan)
    dv += _reduce_scatter(dvf, plan)
    return dq, dk, dv


class GatherPassAttentionFn(torch.autograd.Function):
    """One TTT pass, gather baseline: trunk over the all-gathered K/V + rank-local branch."""

    @staticmethod
    def forward(ctx, q, plan, scale, backend, *kvs):  # type: ignore[override]
        n = len(kvs) // 2
        ks, vs = kvs[:n], kvs[n:]
        with torch.autocast(q.device.type, enabled=False):
            kf, vf = _all_gather(ks[0], plan), _all_gather(vs[0], plan)
            out, lse = gather_forward(q, ks[0], vs[0], kf, vf, plan, scale, backend)
            if n > 1:
                branch_merge_into(out, lse, q, ks[1:], vs[1:], scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, out, lse, kf, vf, *ks, *vs)
        ctx.opts = (n, plan, scale, backend)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, out, lse, kf, vf, *kvs = ctx.saved_tensors
        n, plan, scale, backend = ctx.opts
        ks, vs = kvs[:n], kvs[n:]
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype).contiguous()
            dq, dk0, dv0 = gather_backward(
                dout, q, ks[0], vs[0], kf, vf, out, lse, plan, scale, backend
            )
            dks, dvs = [dk0.to(ks[0].dtype)], [dv0.to(vs[0].dtype)]
            if n > 1:
                dk_b, dv_b = branch_backward_into(dq, dout, q, ks[1:], vs[1:], out, lse, scale)
                dks += dk_b
                dvs += dv_b
        return (dq.to(q.dtype), None, None, None, *dks, *dvs)


def gather_pass_attention(
    q: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], plan: GatherPlan
) -> Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    return GatherPassAttentionFn.apply(q, plan, scale, "auto", *ks, *vs)


class GatherParallel(ContextParallel):
    """ContextParallel with the gather baseline's attention (same sharding, rolls, reductions).
    Its plan is made once per batch, like the zigzag layout (outside the timed step)."""

    _last: tuple[ZigzagLayout, GatherPlan] | None = None

    def attention(self, layout: ZigzagLayout) -> PassAttention:
        if self._last is None or self._last[0] is not layout:
            self._last = (layout, gather_plan(layout, self.mesh.cp_group))
        plan = self._last[1]
        return lambda q, ks, vs, cu_seqlens: gather_pass_attention(q, ks, vs, plan)


# ------------------------------------------------------------------------ batch and model
@dataclass
class Case:
    """One rank's shard of a packed batch with its streamed features."""

    shard: Shard
    taps: Tensor  # [t, n_taps * H], the stream's dtype (bf16 on GPU)
    last_hidden: Tensor  # [t, H]


def doc_lengths(tokens: int, layout: str, docs: int, multiple: int) -> list[int]:
    """Padded document lengths: one document, or ``docs`` of uneven length (fixed seed)."""
    if tokens % multiple:
        raise ValueError(f"--tokens must be multiples of {multiple}, got {tokens}")
    units = tokens // multiple
    if layout == "single" or docs <= 1:
        return [tokens]
    w = 0.5 + torch.rand(min(docs, units), generator=torch.Generator().manual_seed(1234))
    n = [max(1, int(x)) for x in (w / w.sum() * units).tolist()]
    n[n.index(max(n))] += units - sum(n)
    return [u * multiple for u in n]


def make_case(
    lengths: list[int], cp: int, rank: int, args: argparse.Namespace, device: torch.device
) -> Case:
    """This rank's shard. Smoke: the same global features everywhere, sharded (so one device
    can check the result); otherwise each rank draws its own rows only."""
    total = sum(lengths)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    lay = zigzag_layout(cu.to(torch.int32).to(device), cp, rank)
    starts = torch.repeat_interleave(cu[:-1], torch.tensor(lengths))
    positions = (torch.arange(total) - starts).to(device)[lay.index]
    rows = total if args.smoke else lay.num_local
    g = torch.Generator(device=device).manual_seed(args.seed + (0 if args.smoke else 1 + rank))
    dt = args.feature_dtype

    def rand(*shape: int) -> Tensor:
        x = torch.randn(shape, generator=g, device=device, dtype=dt)
        return x.index_select(0, lay.index) if args.smoke else x

    ids = torch.randint(0, args.vocab, (rows,), generator=g, device=device)
    ids = ids.index_select(0, lay.index) if args.smoke else ids
    taps, last_hidden = rand(rows, args.taps * args.hidden), rand(rows, args.hidden)
    batch = PackedBatch(
        input_ids=ids,
        positions=positions,
        cu_seqlens=lay.local_cu,
        loss_mask=torch.ones(lay.num_local, dtype=torch.uint8, device=device),
        doc_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
    )
    return Case(Shard(batch, lay, cu.to(torch.int32).to(device)), taps, last_hidden)


def build_draft(args: argparse.Namespace, device: torch.device) -> Eagle3Draft:
    """A draft as the trainer makes it (fp32 parameters), with a random frozen embedding."""
    cfg = DraftConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
        rope_theta=500000.0, max_position_embeddings=262144, target_hidden_size=args.hidden,
        tap_layers=tuple(range(1, args.taps + 1)), dtype="float32",
    )  # fmt: skip
    torch.manual_seed(args.seed)
    with torch.device(device):
        draft = Eagle3Draft(cfg).train()
        embed = torch.randn(args.vocab, args.hidden) * 0.02
    draft.set_embedding(embed)
    return draft


def build_teacher(args: argparse.Namespace, device: torch.device) -> Teacher:
    """The streamed-mode teacher (the target's lm_head, random), in the dtype the trainer
    gives it (TrainConfig.teacher_dtype; fp32 in the smoke check)."""
    torch.manual_seed(args.seed + 7)
    with torch.device(device):
        head = nn.Linear(args.hidden, args.vocab, bias=False)
    nn.init.normal_(head.weight, std=0.02)
    train = TrainConfig(teacher_dtype=args.teacher_dtype, autocast_bf16=not args.smoke)
    head.to(train.teacher_torch_dtype(device)).requires_grad_(False)
    return Teacher(head.eval())


# ------------------------------------------------------------------------ the step
@dataclass
class Step:
    """What one training step needs besides the batch."""

    draft: Eagle3Draft
    opt: torch.optim.Optimizer
    teacher: Teacher
    parallel: ContextParallel  # ring or gather; reductions are the same
    method: str
    config: TTTConfig
    bf16: bool


def forward_backward(s: Step, case: Case) -> TTTOutput:
    """Trainer.step up to the gradient all-reduce, on an already sharded batch."""
    teacher = s.teacher.draft_logits(case.last_hidden, s.draft.t2d)
    taps = case.taps
    s.draft.zero_grad(set_to_none=True)  # = Trainer's opt.zero_grad: the optimizer holds them all
    b = case.shard.batch
    with torch.autocast(taps.device.type, dtype=torch.bfloat16, enabled=s.bf16):
        if s.method == "plain":
            out = ttt_forward(
                s.draft, b.input_ids, b.positions, case.shard.global_cu, taps, b.loss_mask,
                pass_attention, s.config, teacher,
            )  # fmt: skip
        else:
            out = s.parallel.ttt_forward(s.draft, case.shard, teacher, s.config, taps=taps)
    out.loss.backward()
    s.parallel.reduce_gradients(s.draft.parameters())
    return out


def train_step(s: Step, case: Case) -> float:
    out = forward_backward(s, case)
    torch.nn.utils.clip_grad_norm_(s.draft.parameters(), MAX_GRAD_NORM)
    s.opt.step()
    return float(s.parallel.reduce_metrics(out)["loss"])


def attention_fn(method: str, case: Case, mesh: ParallelMesh) -> PassAttention:
    lay = case.shard.layout
    if method == "plain":
        return pass_attention
    if method == "gather":
        plan = gather_plan(lay, mesh.cp_group)
        return lambda q, ks, vs, cu: gather_pass_attention(q, ks, vs, plan)
    ring = Ring.of(mesh.cp_group)
    return lambda q, ks, vs, cu: ring_pass_attention(q, ks, vs, lay, ring)


def attention_step(attn: PassAttention, case: Case, args: argparse.Namespace) -> Callable:
    """K passes of attention alone, forward + backward, at this rank's shapes (random q/k/v)."""
    t, dev, dt = case.shard.layout.num_local, case.taps.device, args.attn_dtype
    g = torch.Generator(device=dev).manual_seed(args.seed + 99)

    def rand(h: int) -> Tensor:
        return torch.randn(t, h, args.head_dim, generator=g, device=dev, dtype=dt)

    k_ = args.passes
    q, dout = [rand(args.heads) for _ in range(k_)], [rand(args.heads) for _ in range(k_)]
    k, v = [rand(args.kv_heads) for _ in range(k_)], [rand(args.kv_heads) for _ in range(k_)]
    cu = case.shard.batch.cu_seqlens  # what pass_attention reads at world size 1 (the whole batch)

    def run() -> None:
        p = torch.ones((), device=dev, dtype=dt, requires_grad=True)
        ks, vs = [x * p for x in k], [x * p for x in v]
        outs = [attn(q[d] * p, ks[: d + 1], vs[: d + 1], cu) for d in range(k_)]
        torch.autograd.backward(outs, dout)

    return run


# ------------------------------------------------------------------------ measurement
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(vals: list[float], device: torch.device, op: dist.ReduceOp) -> list[float]:
    if not dist.is_initialized():
        return vals
    t = torch.tensor(vals, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def agreed(fn: Callable[[], R], device: torch.device) -> R | None:
    """fn() on every rank, or None on every rank when any rank ran out of memory. (Ranks do
    the same work, so they run out at the same point; one that failed alone inside a ring
    exchange would leave the others waiting until --timeout.)"""
    try:
        got = fn()
    except torch.cuda.OutOfMemoryError:
        got = None
    if got is None:  # the failed frames are gone once the except block has ended
        gc.collect()
        torch.cuda.empty_cache()
    ok = _reduce([float(got is not None)], device, dist.ReduceOp.MIN)[0] == 1
    return got if ok else None


def _timed(setup: Callable[[], Callable[[], object]], device: torch.device, args) -> list[float]:
    """This rank's step times (ms), then memory before the steps and its peak (GiB)."""
    fn = setup()
    for _ in range(args.warmup):
        fn()
    _sync(device)
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    return [*times, base / GIB, peak / GIB]


def measure(setup: Callable[[], Callable[[], object]], device, args) -> dict:
    """Median step time (each step's: the max over ranks) and peak memory per GPU (max over
    ranks; ``extra_gib`` above what was held before the steps), or status "oom"."""
    vals = agreed(lambda: _timed(setup, device, args), device)
    if vals is None:
        return {"status": "oom"}
    vals = _reduce(vals, device, dist.ReduceOp.MAX)
    ms, (base, peak) = vals[:-2], vals[-2:]
    return {"status": "ok", "ms": statistics.median(ms), "ms_steps": ms, "base_gib": base,
            "peak_gib": peak, "extra_gib": peak - base}  # fmt: skip


def check(
    steps: dict[str, Step], lengths: list[int], args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Loss and draft gradients of each method against the single-process step on the whole
    batch (max relative error over ranks and parameters), from the same initial weights."""
    whole = make_case(lengths, 1, 0, args, device)
    one = ContextParallel(ParallelMesh.single())
    s0 = next(iter(steps.values()))
    ref = replace(s0, draft=copy.deepcopy(s0.draft), method="plain", parallel=one)
    ref_loss = float(forward_backward(ref, whole).loss.detach())
    errs: dict[str, float] = {}
    for name, s in steps.items():
        case = make_case(lengths, args.world, s.parallel.mesh.cp_rank, args, device)
        s = replace(s, draft=copy.deepcopy(s.draft))
        loss = s.parallel.reduce_metrics(forward_backward(s, case))["loss"]
        err = [abs(loss - ref_loss) / abs(ref_loss)]
        for p, r in zip(s.draft.parameters(), ref.draft.parameters(), strict=True):
            err.append(float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp(min=1e-30)))
        errs[f"{name}_loss_rel_err"], errs[f"{name}_grad_rel_err"] = _reduce(
            [err[0], max(err[1:])], device, dist.ReduceOp.MAX
        )
    return errs


def run_case(
    head: dict,
    lengths: list[int],
    steps: dict[str, Step],
    mesh: ParallelMesh,
    device: torch.device,
    args: argparse.Namespace,
    records: list[dict],
    ooms: dict[tuple[str, str, str], int],
) -> None:
    """Every method's training step on one batch, then its attention alone. A measurement that
    ran out of memory at fewer tokens (``ooms``) is recorded as such without being tried."""
    case = agreed(lambda: make_case(lengths, args.world, mesh.cp_rank, args, device), device)
    kinds = ("step", "attention") if args.attention else ("step",)
    for kind, method in [(k, m) for k in kinds for m in steps]:
        rec = {**head, "kind": kind, "method": method, "status": "oom"}
        key = (kind, method, head["layout"])
        if case is None or head["tokens"] >= ooms.get(key, head["tokens"] + 1):
            rec["skipped"] = case is not None
        else:
            if kind == "step":  # setup() returns the step to time
                setup = partial(partial, train_step, steps[method], case)
                if args.profile and mesh.is_main:
                    profile(setup(), device, args.profile, f"{method}-{head['tokens']}")
                if args.memory_history and mesh.is_main:
                    name = f"{method}-{head['tokens']}{'-recompute' if args.recompute_mlp else ''}"
                    memory_history(setup(), device, args.memory_history, name)
            else:
                setup = partial(attention_step, attention_fn(method, case, mesh), case, args)
            rec.update(measure(setup, device, args))
        if rec["status"] == "oom":
            ooms[key] = min(ooms.get(key, head["tokens"]), head["tokens"])
        _emit(records, rec, args.out, mesh)


def profile(step: Callable[[], object], device: torch.device, out: Path, name: str) -> None:
    """One warm step under torch.profiler: ``<out>/<name>.txt``, the operators by device
    time, where the step's time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))


def memory_history(step: Callable[[], object], device: torch.device, out: Path, name: str) -> None:
    """One warm step with CUDA's allocator history recorded: ``<out>/<name>-peak.json``, what
    is live at the step's peak above what was allocated before it, summed by the innermost
    frame of this project's code that allocated it (where the peak beyond the memory model
    goes). CUDA only; the snapshot itself stays on this machine."""
    if device.type != "cuda":
        return
    root = str(Path(__file__).resolve().parents[1])
    step()
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snap["device_traces"] for e in trace]

    def replay(stop: int) -> tuple[dict[int, dict], int, int]:
        """The blocks live after event `stop`, the peak bytes and its event up to there."""
        live: dict[int, dict] = {}
        total = peak = peak_at = 0
        for i, ev in enumerate(events[: stop + 1]):
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev
                total += ev["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif ev["action"] in ("free_requested", "free_completed") and ev["addr"] in live:
                total -= live.pop(ev["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay(len(events) - 1)
    at_peak, _, _ = replay(peak_at)

    def where(ev: dict) -> str:
        mine = [f for f in ev.get("frames", []) if f["filename"].startswith(root)]
        if not mine:
            return "(no frame of this project)"
        return " < ".join(f"{f['filename'][len(root) + 1 :]}:{f['line']} {f['name']}"
                          for f in mine[:3])  # fmt: skip

    groups: dict[str, int] = {}
    for ev in at_peak.values():
        groups[where(ev)] = groups.get(where(ev), 0) + ev["size"]
    rows = sorted(groups.items(), key=lambda kv: -kv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-peak.json").write_text(json.dumps({
        "peak_above_start_gib": peak / GIB,
        "by_frame_gib": [{"where": w, "gib": b / GIB} for w, b in rows[:60]],
    }, indent=1))  # fmt: skip


def model_gib(
    args: argparse.Namespace, tokens: int, bf16: bool, teacher_dtype: torch.dtype
) -> tuple[float, float]:
    """What the whole-step memory model says one rank keeps for backward and its peak above
    the step's inputs (GiB), to set beside the measured ones (codraft.learner.parallel.memory:
    step_saved_bytes_per_token, step_peak_bytes; the peak's model is bf16 autocast's)."""
    shape = memory.StepShape(
        args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim,
        args.taps * args.hidden, args.draft_vocab, args.feature_dtype.itemsize,
        teacher_dtype.itemsize,
    )  # fmt: skip
    per_token = memory.step_saved_bytes_per_token(
        args.passes, shape, autocast=bf16, recompute_mlp=args.recompute_mlp, cp=args.world
    )
    saved = memory.local_tokens(tokens, args.world) * per_token / GIB
    peak = memory.step_peak_bytes(
        tokens, args.passes, shape, recompute_mlp=args.recompute_mlp,
        loss_chunk=args.loss_chunk, cp=args.world,
    ) / GIB  # fmt: skip
    return saved, peak


def run(args: argparse.Namespace, mesh: ParallelMesh, device: torch.device) -> list[dict]:
    records: list[dict] = []
    draft = build_draft(args, device)
    opt = torch.optim.AdamW(draft.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    teacher = build_teacher(args, device)
    cfg = TTTConfig(
        args.passes, loss_chunk_tokens=args.loss_chunk, recompute_mlp=args.recompute_mlp
    )
    bf16 = device.type == "cuda" and not args.smoke
    parallels = {"ring": ContextParallel(mesh), "gather": GatherParallel(mesh)}
    parallels["plain"] = parallels["ring"]
    steps = {m: Step(draft, opt, teacher, parallels[m], m, cfg, bf16) for m in args.methods}
    multiple = math.lcm(DOC_MULTIPLE, 2 * args.world)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    failed, ooms = False, {}
    for tokens in sorted(args.tokens):
        for layout in args.layouts:
            lengths = doc_lengths(tokens, layout, args.docs, multiple)
            saved, peak = model_gib(args, tokens, bf16, teacher.dtype)
            head = {"cp": args.world, "tokens": tokens, "layout": layout, "docs": len(lengths),
                    "passes": args.passes, "loss_chunk": args.loss_chunk,
                    "recompute_mlp": args.recompute_mlp, "device": name,
                    "teacher_dtype": str(teacher.dtype).removeprefix("torch."),
                    "model_saved_gib": saved, "model_peak_gib": peak}  # fmt: skip
            if args.smoke:
                cp_steps = {m: s for m, s in steps.items() if m != "plain"}
                errs = check(cp_steps, lengths, args, device)
                failed |= any(e > SMOKE_TOL for e in errs.values())
                _emit(records, {**head, "kind": "check", **errs}, args.out, mesh)
            run_case(head, lengths, steps, mesh, device, args, records, ooms)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if failed:
        raise SystemExit(f"smoke check failed: an error above {SMOKE_TOL} (see {args.out})")
    return records


def _emit(records: list[dict], rec: dict, out: Path, mesh: ParallelMesh) -> None:
    if not mesh.is_main:
        return
    records.append(rec)
    print(json.dumps({k: v for k, v in rec.items() if k != "ms_steps"}), flush=True)
    out.write_text(json.dumps(records, indent=2))


# ------------------------------------------------------------------------ combine, table, plot
def summarize(records: list[dict]) -> list[dict]:
    """One row per (layout, tokens, cp): times, strong-scaling efficiency against the smallest
    CP that fitted (same method), ring vs gather ratios, the attention's share and scaling."""
    by = {(r["kind"], r["method"], r["layout"], r["tokens"], r["cp"]): r for r in records
          if r["kind"] in ("step", "attention")}  # fmt: skip

    def get(kind: str, method: str, lay: str, tok: int, cp: int) -> dict | None:
        r = by.get((kind, method, lay, tok, cp))
        return r if r is not None and r["status"] == "ok" else None

    def eff(kind: str, method: str, lay: str, tok: int, cp: int) -> float | None:
        r = get(kind, method, lay, tok, cp)
        fits = sorted(c for (k, m, la, t, c) in by if (k, m, la, t) == (kind, method, lay, tok)
                      and get(kind, method, lay, tok, c))  # fmt: skip
        if r is None or not fits:
            return None
        b = get(kind, method, lay, tok, fits[0])
        return b["ms"] * b["cp"] / (r["ms"] * cp)

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and b[key] else None

    rows = []
    for lay, tok, cp in sorted({(k[2], k[3], k[4]) for k in by}):
        ring, gat = get("step", "ring", lay, tok, cp), get("step", "gather", lay, tok, cp)
        a_ring, a_gat = (
            get("attention", "ring", lay, tok, cp),
            get("attention", "gather", lay, tok, cp),
        )
        plain = get("step", "plain", lay, tok, 1)
        rows.append({
            "layout": lay, "tokens": tok, "cp": cp,
            "ring_ms": ring and ring["ms"], "gather_ms": gat and gat["ms"],
            "ring_eff": eff("step", "ring", lay, tok, cp),
            "gather_eff": eff("step", "gather", lay, tok, cp),
            "ring_eff_vs_plain_cp1": ratio(plain, ring, "ms") / cp if plain and ring else None,
            "time_ratio_gather_over_ring": ratio(gat, ring, "ms"),
            "ring_peak_gib": ring and ring["peak_gib"], "gather_peak_gib": gat and gat["peak_gib"],
            "mem_ratio_gather_over_ring": ratio(gat, ring, "peak_gib"),
            "ring_extra_gib": ring and ring["extra_gib"],
            "gather_extra_gib": gat and gat["extra_gib"],
            "attn_ring_ms": a_ring and a_ring["ms"], "attn_gather_ms": a_gat and a_gat["ms"],
            "attn_share_ring": ratio(a_ring, ring, "ms"),
            "attn_ring_eff": eff("attention", "ring", lay, tok, cp),
            "attn_ring_extra_gib": a_ring and a_ring["extra_gib"],
            "attn_gather_extra_gib": a_gat and a_gat["extra_gib"],
            "attn_mem_ratio_gather_over_ring": ratio(a_gat, a_ring, "extra_gib"),
            "attn_time_ratio_gather_over_ring": ratio(a_gat, a_ring, "ms"),
        })  # fmt: skip
    return rows


TABLE = [  # (header, row key, format)
    ("layout", "layout", "{}"), ("tokens", "tokens", "{}"), ("CP", "cp", "{}"),
    ("ring ms", "ring_ms", "{:.0f}"), ("ring eff", "ring_eff", "{:.0%}"),
    ("gather ms", "gather_ms", "{:.0f}"), ("gather / ring time", "time_ratio_gather_over_ring",
    "{:.2f}"), ("ring peak GiB", "ring_peak_gib", "{:.1f}"), ("gather peak GiB",
    "gather_peak_gib", "{:.1f}"), ("gather / ring mem", "mem_ratio_gather_over_ring", "{:.2f}"),
    ("attn share", "attn_share_ring", "{:.0%}"), ("attn eff", "attn_ring_eff", "{:.0%}"),
    ("attn gather / ring mem", "attn_mem_ratio_gather_over_ring", "{:.2f}"),
]  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _, _ in TABLE) + " |", "|" + "---:|" * len(TABLE)]
    for r in rows:
        cells = [f.format(r[k]) if r[k] is not None else "OOM/-" for _, k, f in TABLE]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ring_ms", "gather_ms", "step ms", "log"), ("ring_eff", "attn_ring_eff",
              "efficiency vs smallest CP", "linear"), ("ring_peak_gib", "gather_peak_gib",
              "peak GiB per GPU", "log")]  # fmt: skip
    lays = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(len(lays), 3, figsize=(15, 4.2 * len(lays)), squeeze=False)
    for i, lay in enumerate(lays):
        for ax, (a, b, title, yscale) in zip(axes[i], panels, strict=True):
            for tok in sorted({r["tokens"] for r in rows}):
                rs = [r for r in rows if r["layout"] == lay and r["tokens"] == tok]
                for key, style in ((a, "o-"), (b, "x--")):
                    pts = [(r["cp"], r[key]) for r in rs if r[key]]
                    if pts:
                        size = f"{tok // 1024}K" if tok >= 1024 else str(tok)
                        ax.plot(*zip(*pts, strict=True), style, label=f"{key} {size}")
            ax.set(title=f"{title} ({lay})", xlabel="CP", yscale=yscale)
            ax.set_xscale("log", base=2)
            cps = sorted({r["cp"] for r in rows})
            ax.set_xticks(cps, [str(c) for c in cps])
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def combine(files: list[Path], out: Path) -> None:
    records = [r for f in files for r in json.loads(f.read_text())]
    rows = summarize(records)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    plot(rows, out.with_suffix(".png"))
    print(table(rows))


# ------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",")]

    def names(s: str) -> list[str]:
        return s.split(",")

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=ints, default=[32768, 65536, 131072, 262144])
    ap.add_argument("--layouts", type=names, default=["packed", "single"])
    ap.add_argument("--docs", type=int, default=8, help="documents in the packed layout")
    ap.add_argument("--methods", type=names, default=None,
                    help="ring,gather (+ plain at world size 1, the default there)")  # fmt: skip
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument(
        "--loss-chunk", type=int, default=TTTConfig.loss_chunk_tokens,
        help="anchors whose draft logits exist at once (TTTConfig.loss_chunk_tokens)",
    )  # fmt: skip
    ap.add_argument(
        "--recompute-mlp", action="store_true",
        help="each pass's o_proj + MLP recomputed in backward (TTTConfig.recompute_mlp)",
    )  # fmt: skip
    ap.add_argument("--teacher-dtype", default=TrainConfig.teacher_dtype,
                    help="the teacher head's (TrainConfig.teacher_dtype)")  # fmt: skip
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--taps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-attention", dest="attention", action="store_false",
                    help="skip the attention-only measurement")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=Path, default=None,
                    help="folder: a step of each case under torch.profiler")  # fmt: skip
    ap.add_argument("--memory-history", type=Path, default=None,
                    help="folder: what is live at each step's peak, and where from")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    ap.add_argument("--out", type=Path, default=Path("bench_cp_train.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, fp32, checked")
    ap.add_argument("--combine", type=Path, nargs="+", help="record files -> summary at --out")
    args = ap.parse_args(argv)
    if args.combine:
        combine(args.combine, args.out)
        return
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.methods is None:
        args.methods = ["plain", "ring", "gather"] if args.world == 1 else ["ring", "gather"]
    if set(args.methods) - {"plain", "ring", "gather"} or set(args.layouts) - {"packed", "single"}:
        ap.error(f"unknown --methods {args.methods} or --layouts {args.layouts}")
    if args.world > 1 and "plain" in args.methods:
        ap.error("--methods plain runs at world size 1 only")
    args.feature_dtype = args.attn_dtype = torch.bfloat16
    if args.smoke:
        args.tokens, args.docs, args.warmup, args.repeats = [96, 160], 3, 1, 2
        args.hidden, args.intermediate, args.heads, args.kv_heads = 64, 128, 4, 2
        args.head_dim, args.vocab, args.draft_vocab = 16, 512, 128
        args.feature_dtype = args.attn_dtype = torch.float32
    device_name = "cpu" if args.smoke else "auto"
    cfg = ParallelConfig(cp=args.world, device=device_name, timeout_s=args.timeout)
    mesh, device = init_distributed(cfg)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        records = run(args, mesh, device)
        if mesh.is_main:
            rows = summarize(records)
            print(table(rows))
            plot(rows, args.out.with_suffix(".png"))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
