"""Benchmark TTT branch attention (forward + backward): time and peak memory.

Methods, all computing the same K-pass TTT attention over a packed batch of uneven documents:

* ``ttt_pass``    what the trainer runs: K sequential calls of
                  codraft.learner.attention.pass_attention.pass_attention (one flash trunk call and
                  a branch per pass, merged by lse in one autograd Function; on CUDA the branch
                  rows run as the Triton kernels of codraft.learner.attention.branch_triton);
* ``ttt_pass_compile`` the same with the branch rows compiled by torch.compile instead;
* ``ttt_pass_eager`` the same with the branch rows run as eager PyTorch ops;
* ``branch``      codraft.learner.attention.branch_attention (flash trunk + [K, T, H, K-1] branch);
* ``sdpa_dense``  F.scaled_dot_product_attention over all passes' keys with a materialised
                  [K*T, K*T] bool mask (skipped above --dense-limit mask elements);
* ``flex``        flex_attention with a block mask over the same K*T keys (compiled on CUDA);
* ``k_flash``     K calls of plain causal varlen flash over the trunk only (a lower bound: it does
                  not even compute the branch; only its pass 0 is checked against ``branch``).

Each record has the time of one forward + backward, the peak extra CUDA memory (gradients of
q/k/v included, the same for every method) and ``saved_mib``: what is held between forward and
backward (outputs + saved activations), the method's own memory. Writes a JSON list of records
and a PNG plot. ``--smoke`` runs a tiny size on CPU (fp32) and
checks that every method agrees with ``branch``.

    python scripts/bench_ttt_attention.py --out bench/ttt_attention.json      # GPU
    python scripts/bench_ttt_attention.py --smoke --out ttt_smoke.json         # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from codraft.learner.attention import block_attention, branch_attention
from codraft.learner.attention.pass_attention import pass_attention


def _doc_lengths(tokens: int, mean_len: int, gen: torch.Generator) -> list[int]:
    """Uneven document lengths (uniform in [1, 2 * mean_len]) summing to ``tokens``."""
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(torch.randint(1, 2 * mean_len + 1, (1,), generator=gen)))
    out[-1] -= sum(out) - tokens
    return [n for n in out if n > 0]


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def _doc_ids(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)


def _dense_mask(passes: int, doc: torch.Tensor) -> torch.Tensor:
    """bool [K*T, K*T] pass-major TTT mask (trunk causal within documents + branch diagonal)."""
    t = doc.numel()
    mask = torch.zeros(passes * t, passes * t, dtype=torch.bool, device=doc.device)
    trunk = (doc[:, None] == doc[None, :]).tril_()
    idx = torch.arange(t, device=doc.device)
    for p in range(passes):
        mask[p * t : (p + 1) * t, :t] = trunk
        for e in range(1, p + 1):
            mask[p * t + idx, e * t + idx] = True
    return mask


def _methods(
    passes: int, lengths: list[int], device: torch.device, compile_flex: bool
) -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """name -> fn(q [K,T,Hq,D], k, v [K,T,Hkv,D]) -> out [K,T,Hq,D]; building masks is setup."""
    cu = _cu(lengths, device)
    doc = _doc_ids(lengths, device)
    t = doc.numel()

    def branch(q, k, v):
        return branch_attention(q, k, v, cu)

    def ttt_pass(q, k, v):  # what the trainer runs: K sequential calls of pass_attention
        ks, vs = list(k.unbind(0)), list(v.unbind(0))
        return [pass_attention(q[p], ks[: p + 1], vs[: p + 1], cu) for p in range(passes)]

    def k_flash(q, k, v):  # per-pass outputs as the trainer keeps them (no stacked copy)
        return [block_attention(q[p], k[0], v[0], cu, cu, causal=True)[0] for p in range(passes)]

    def flat(x):  # [K, T, H, D] -> [1, H, K*T, D]
        return x.reshape(passes * t, x.shape[2], x.shape[3]).transpose(0, 1).unsqueeze(0)

    def unflat(y, hq):
        return y[0].transpose(0, 1).reshape(passes, t, hq, y.shape[-1])

    mask_cache: dict[str, object] = {}

    def sdpa_dense(q, k, v):
        if "dense" not in mask_cache:
            mask_cache["dense"] = _dense_mask(passes, doc)
        o = F.scaled_dot_product_attention(
            flat(q), flat(k), flat(v), attn_mask=mask_cache["dense"], enable_gqa=True
        )
        return unflat(o, q.shape[2])

    def flex(q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "flex" not in mask_cache:

            def mask_mod(b, h, qi, kj):
                qp, qt, kp, kt = qi // t, qi % t, kj // t, kj % t
                trunk = (kp == 0) & (doc[kt] == doc[qt]) & (kt <= qt)
                return trunk | ((kp >= 1) & (kp <= qp) & (kt == qt))

            n = passes * t
            # _compile avoids materialising the [n, n] mask while building the block mask
            mask_cache["flex"] = create_block_mask(
                mask_mod, None, None, n, n, device=device.type, _compile=compile_flex
            )
            mask_cache["fn"] = torch.compile(flex_attention) if compile_flex else flex_attention
        fn = mask_cache["fn"]
        o = fn(flat(q), flat(k), flat(v), block_mask=mask_cache["flex"], enable_gqa=True)
        return unflat(o, q.shape[2])

    return {
        "ttt_pass": ttt_pass,
        "ttt_pass_compile": ttt_pass,  # row kernels chosen by BRANCH_KERNEL (forward + backward)
        "ttt_pass_eager": ttt_pass,
        "branch": branch,
        "sdpa_dense": sdpa_dense,
        "flex": flex,
        "k_flash": k_flash,
    }


# CODRAFT_BRANCH_KERNEL while a method runs (its forward AND its backward).
BRANCH_KERNEL = {"ttt_pass": "auto", "ttt_pass_compile": "compile", "ttt_pass_eager": "eager"}


@contextlib.contextmanager
def _branch_kernel(method: str):
    old = os.environ.get("CODRAFT_BRANCH_KERNEL")
    os.environ["CODRAFT_BRANCH_KERNEL"] = BRANCH_KERNEL.get(method, "auto")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CODRAFT_BRANCH_KERNEL")
        else:
            os.environ["CODRAFT_BRANCH_KERNEL"] = old


def _grad_err(fn, ref_grads, q, k, v, g) -> float:
    """Max abs difference of the q/k/v gradients from the reference method's."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(_outputs(fn(*xs)), xs, list(g.unbind(0)))
    return max((a.float() - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _outputs(y: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return list(y.unbind(0)) if isinstance(y, torch.Tensor) else list(y)


def _measure(
    fn, q, k, v, g, repeats: int, device: torch.device
) -> tuple[float, float | None, float | None]:
    """Mean seconds of one forward + backward; on CUDA also the peak extra memory and the memory
    held between forward and backward (saved activations + outputs), both in MiB."""
    grads = list(g.unbind(0))
    held: list[float] = []

    def step():
        for x in (q, k, v):
            x.grad = None
        outs = _outputs(fn(q, k, v))
        if device.type == "cuda":
            held.append(torch.cuda.memory_allocated(device))
        torch.autograd.backward(outs, grads)

    step()  # warm-up (compilation, mask construction)
    _sync(device)
    held.clear()
    if device.type == "cuda":
        for x in (q, k, v):
            x.grad = None
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / repeats
    if device.type != "cuda":
        return seconds, None, None
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    saved = (held[0] - base) / 2**20  # first timed step: no stale .grad held yet
    return seconds, peak, saved


def _profile(fn, q, k, v, g, out: Path, name: str, tokens: int, passes: int) -> None:
    """One forward + backward under torch.profiler: the kernel table, next to the JSON."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with profile(activities=acts) as prof:
        _measure(fn, q, k, v, g, 1, q.device)
    key = "cuda_time_total" if q.is_cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    path = out.with_name(f"{out.stem}.{name}.{tokens}.{passes}.prof.txt")
    path.write_text(table)
    print(table, flush=True)


def _emit(records: list[dict], rec: dict, out: Path) -> None:
    """Keep a record, print it, and rewrite the JSON (partial results survive a kill)."""
    records.append(rec)
    print(rec, flush=True)
    out.write_text(json.dumps(records, indent=2))


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    records: list[dict] = []
    for tokens in args.tokens:
        for passes in args.passes:
            gen = torch.Generator().manual_seed(0)
            lengths = _doc_lengths(tokens, args.doc_len, gen)
            shape_q = (passes, tokens, args.heads, args.head_dim)
            shape_k = (passes, tokens, args.kv_heads, args.head_dim)
            q, k, v = (
                torch.randn(s, generator=gen).to(device, dtype).requires_grad_()
                for s in (shape_q, shape_k, shape_k)
            )
            g = torch.randn(shape_q, generator=gen).to(device, dtype)
            methods = _methods(passes, lengths, device, compile_flex=device.type == "cuda")
            with torch.no_grad():
                expected = torch.stack(_outputs(methods["branch"](q, k, v))).float()
            ref_grads = None
            if args.check_grads:
                xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                ref = _outputs(methods["branch"](*xs))
                ref_grads = [x.float() for x in torch.autograd.grad(ref, xs, list(g.unbind(0)))]
                del xs, ref
            for name in args.methods:
                rec = {"method": name, "tokens": tokens, "passes": passes, "docs": len(lengths)}
                rec.update(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
                if name == "sdpa_dense" and (passes * tokens) ** 2 > args.dense_limit:
                    rec["status"] = "skipped: mask too large"
                    _emit(records, rec, args.out)
                    continue
                try:
                    with torch.no_grad(), _branch_kernel(name):
                        got = torch.stack(
                            _outputs(methods[name](q.detach(), k.detach(), v.detach()))
                        )
                    # k_flash has no branch: only pass 0 (trunk alone) must agree
                    n = 1 if name == "k_flash" else passes
                    rec["max_err"] = (got[:n].float() - expected[:n]).abs().max().item()
                    del got
                    if ref_grads is not None and name in BRANCH_KERNEL:
                        with _branch_kernel(name):
                            rec["max_grad_err"] = _grad_err(methods[name], ref_grads, q, k, v, g)
                    with _branch_kernel(name):
                        seconds, peak, saved = _measure(
                            methods[name], q, k, v, g, args.repeats, device
                        )
                    rec.update(status="ok", ms=1e3 * seconds, peak_mib=peak, saved_mib=saved)
                    if args.profile:
                        with _branch_kernel(name):
                            _profile(methods[name], q, k, v, g, args.out, name, tokens, passes)
                except NotImplementedError as e:  # e.g. flex_attention has no CPU backward
                    rec["status"] = f"unsupported: {str(e).splitlines()[0]}"
                except torch.OutOfMemoryError:
                    rec["status"] = "oom"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                _emit(records, rec, args.out)
            del methods
    return records


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = sorted({r["passes"] for r in records})
    fig, axes = plt.subplots(2, len(passes), figsize=(5 * len(passes), 8), squeeze=False)
    for col, kp in enumerate(passes):
        for name in sorted({r["method"] for r in records}):
            ok = [r for r in records if r["passes"] == kp and r["method"] == name]
            ok = [r for r in ok if r.get("status") == "ok"]
            if not ok:
                continue
            xs = [r["tokens"] for r in ok]
            axes[0][col].plot(xs, [r["ms"] for r in ok], marker="o", label=name)
            if all(r["peak_mib"] is not None for r in ok):
                axes[1][col].plot(xs, [r["peak_mib"] for r in ok], marker="o", label=name)
        axes[0][col].set(title=f"K = {kp}: forward + backward", ylabel="ms", xscale="log")
        axes[1][col].set(title=f"K = {kp}: peak extra memory", ylabel="MiB", xscale="log")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("tokens per batch")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=ints, default=[8192, 32768, 131072])
    ap.add_argument("--passes", type=ints, default=[3, 7])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-len", type=int, default=2048, help="mean document length")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    methods = "ttt_pass,branch,sdpa_dense,flex,k_flash"
    ap.add_argument("--methods", type=lambda s: s.split(","), default=methods.split(","))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dense-limit", type=float, default=2.0**33, help="max dense mask elements")
    ap.add_argument("--out", type=Path, default=Path("bench_ttt_attention.json"))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in fp32")
    ap.add_argument("--profile", action="store_true", help="write a kernel table per method")
    ap.add_argument(
        "--check-grads",
        action="store_true",
        help="also compare the ttt_pass* methods' q/k/v gradients with branch's (max_grad_err)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.passes, args.doc_len, args.repeats = [128, 256], [3], 48, 1
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        args.device, args.dtype, args.check_grads = "cpu", "fp32", True

    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = run(args)
    plot(records, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    if args.smoke:
        bad = [r for r in records if "max_err" not in r or not math.isfinite(r["max_err"])]
        bad += [r for r in records if r.get("max_err", 0.0) > 1e-4]
        bad += [r for r in records if r.get("max_grad_err", 0.0) > 1e-4]
        if bad:
            raise SystemExit(f"smoke failed: {bad}")


if __name__ == "__main__":
    main()
