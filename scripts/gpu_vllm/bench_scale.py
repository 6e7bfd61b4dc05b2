"""Where speculation pays: an 8B-class Llama target on vLLM 0.26.0 (CUDA) at a set acceptance.

No 8B checkpoint can be had on the GPU machine (no network), and acceptance is a property of the
draft, not of the engine's cost. So this measures the cost side at scale and takes acceptance as
an input:

* the target is Llama-3.1-8B's geometry (32 layers, hidden 4,096, FFN 14,336, 32/8 heads,
  vocab 128,256, bf16) with vLLM's `load_format="dummy"` (random weights, nothing read) and
  SmolLM2's tokenizer; the EAGLE-3 draft is codraft's draft config for that target (one layer,
  draft vocab 8,192, taps as codraft picks them), random weights too;
* vLLM's synthetic rejection sampling (`rejection_sample_method="synthetic"`) accepts draft
  tokens at a set mean acceptance length, so every speculative step costs what it costs with a
  draft of that quality: the draft's k forward passes, the target's verification of k + 1
  tokens, the sampler;
* arms, every one in vLLM's default engine mode (torch.compile + CUDA graphs, async
  scheduling, the model runner vLLM picks: V2 for this dense Llama on 0.26), batches
  1/8/32/64, 128 greedy tokens: no speculation; then at each `--acceptance` (default 3.2, what
  the online co-trained SmolLM2 draft reached on the co-training stream) plain vLLM with the
  EAGLE-3 draft, and the same draft in `codraft serve`'s engine with the tap off, with the tap
  on (full features into a receiver process: bytes and MB/s per batch, drops, the host time
  per step in codraft's hooks, from codraft_stats), and with the tap on in "ids" mode (the same
  bookkeeping and messages, token ids only: no features gathered, copied or sent, which
  separates what the features cost from what the rest of the tap costs); "on-thread" is the
  tap on with its messages assembled in the engine's process (`tap_assembly = "thread"`) rather
  than the tap process; "on-ring" is the tap on with the rows read by the tap process from the
  device ring (`tap_device_ring = true`) rather than copied to the host in the engine's process
  and written into the tap process's pipe. `--codraft-arms none` leaves them out,
  `--no-base` the first arm.
* every batch runs `--repeats` times (default 5) in the arm's engine; the row reported is the
  median run's, with every run's tokens/s alongside (`runs_tokens_per_s`).

Outputs are random tokens (random weights); only time is measured. Writes
`<out>/scale.json` and `<out>/scale.png`.

    .gpu_venv/bin/python scripts/gpu_vllm/bench_scale.py --out runs/gpu_scale
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_serving, make_prompts

from bench_serving import (  # noqa: E402
    ArmSpec,
    load_prompt_list,
    print_summary,
    run_arm_subprocess,
    strip_ids,
)

CODRAFT_ARMS = ("off", "on", "ids", "on-thread", "on-ring")  # the tap settings of codraft's arms
# Llama-3.1-8B's geometry (rope scaling left out: it does not change the cost at 1K tokens)
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_models(
    work: Path, tokenizer: Path, draft_vocab: int, draft_weights: bool = True
) -> tuple[Path, Path]:
    """The dummy target folder (config + tokenizer) and a random draft checkpoint for it (vLLM
    loads both with dummy weights; codraft's engine reads the checkpoint as its initial draft;
    `draft_weights=False`: the draft's config.json only)."""
    from codraft.draft.config import DraftConfig
    from codraft.draft.init import write_new_draft
    from codraft.models.config import TargetConfig

    target, draft = work / "llama8b-dummy", work / "llama8b-dummy-eagle3"
    for d in (target, draft):
        shutil.rmtree(d, ignore_errors=True)
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, target / name)
    if draft_weights:
        write_new_draft(draft, target, draft_vocab_size=draft_vocab, dtype="bfloat16")
    else:
        draft.mkdir(parents=True)
        cfg = DraftConfig.from_target(
            TargetConfig.from_pretrained(target), draft_vocab_size=draft_vocab, dtype="bfloat16"
        )
        (draft / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    return target, draft


def derive(report: dict, acceptance: list[float]) -> None:
    """Speed-ups over the base arm, each speculative arm's cost per engine step (ms per output
    token x acceptance length: what one draft-and-verify step costs, whatever is accepted), and
    from it the speed-up each set acceptance length would give at that arm's step cost; each
    codraft arm against plain vLLM's EAGLE-3 at the same acceptance; the tap's bandwidth."""
    report["vs_plain"], report["tap"] = {}, {}
    for name, arm in report["arms"].items():
        if not name.startswith("codraft"):
            continue
        plain = report["arms"].get("eagle3 " + name.split(" ", 3)[-1])
        if plain:
            ref = {b["batch"]: b["tokens_per_s"] for b in plain["batches"]}
            report["vs_plain"][f"{name} / plain"] = {
                b["batch"]: b["tokens_per_s"] / ref[b["batch"]] for b in arm["batches"]
            }
        rows = [b for b in arm["batches"] if "tap_bytes" in b]
        if rows:
            stats = arm.get("stats") or {}
            tokens = sum(b["output_tokens"] for b in rows)
            seen = sum(b["output_tokens"] + b.get("prompt_tokens", 0) for b in rows)
            top = max(rows, key=lambda b: b["batch"])
            report["tap"][name] = {
                "bytes_per_output_token": sum(b["tap_bytes"] for b in rows) / max(tokens, 1),
                # a full message holds every token of its sequence but the last
                "bytes_per_captured_token": sum(b["tap_bytes"] for b in rows) / max(seen, 1),
                "mb_per_s_at_batch": {b["batch"]: b["tap_mb_per_s"] for b in rows},
                f"mb_per_s_batch_{top['batch']}": top["tap_mb_per_s"],
                "messages_dropped": (stats.get("tap") or {}).get("messages_dropped"),
                "messages_sent": (stats.get("tap") or {}).get("messages_sent"),
                "hooks": stats.get("hooks"),
                "rows_via": (stats.get("tap") or {}).get("rows_via"),
            }
    if "base" not in report["arms"]:
        return
    base = {b["batch"]: b for b in report["arms"]["base"]["batches"]}
    report["speedup"], report["step_ms"], report["projected_speedup"] = {}, {}, {}
    for name, arm in report["arms"].items():
        if name == "base":
            continue
        rows = arm["batches"]
        report["speedup"][name] = {
            b["batch"]: b["tokens_per_s"] / base[b["batch"]]["tokens_per_s"] for b in rows
        }
        step = {
            b["batch"]: b["ms_per_output_token"] * (b["acceptance_length"] or 1.0) for b in rows
        }
        report["step_ms"][name] = step
        report["projected_speedup"][name] = {
            f"{a:g}": {n: a * base[n]["ms_per_output_token"] / ms for n, ms in step.items()}
            for a in acceptance
        }


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    base_arm = report["arms"].get("base")
    base = {b["batch"]: b["tokens_per_s"] for b in base_arm["batches"]} if base_arm else {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, arm) in enumerate(report["arms"].items()):
        xs = [b["batch"] for b in arm["batches"]]
        style = {"marker": "o", "color": f"C{i}", "label": name}
        ax1.plot(xs, [b["tokens_per_s"] for b in arm["batches"]], **style)
        if name != "base" and base:
            ax2.plot(xs, [b["tokens_per_s"] / base[b["batch"]] for b in arm["batches"]], **style)
    src = report.get("projected_from")
    for a, row in (report.get("projected_speedup", {}).get(src) or {}).items():
        xs = sorted(row, key=int)
        ax2.plot([int(x) for x in xs], [row[x] for x in xs], "--", color="gray", lw=1)
        ax2.annotate(f"AL {a} at the step cost of {src}", (int(xs[0]), row[xs[0]]), fontsize=7,
                     xytext=(4, -10), textcoords="offset points", color="gray")  # fmt: skip
    ax2.axhline(1.0, color="k", lw=0.8)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "speed-up over no speculation")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (concurrent greedy requests)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Llama-8B geometry (random weights) on vLLM {report['vllm_version']}, "
        f"{report['device']}: EAGLE-3 k={report['k']} at set acceptance lengths"
    )
    if report.get("note"):  # a remark added to the report by hand, e.g. about a cold cache
        fig.text(0.5, 0.01, report["note"], ha="center", fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.04 if report.get("note") else 0, 1, 1))
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_scale")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json (SmolLM2's)")
    p.add_argument("--acceptance", default="3.2", help="mean acceptance lengths to set")
    p.add_argument(
        "--codraft-arms",
        default="off,on,ids",
        help="codraft serve's engine: tap off, on (full features), ids (token ids only), "
        "on-thread (full features, assembled in the engine's process: tap_assembly thread), "
        "on-ring (full features, the tap process, which reads the rows from the device ring: "
        "tap_device_ring true)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per batch (median kept)")
    p.add_argument("--no-base", action="store_true", help="leave out the no-speculation arm")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--gpu-mem", type=float, default=0.5)
    p.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--arm-timeout", type=float, default=240.0)
    p.add_argument(
        "--replot",
        metavar="JSON",
        help="no run: recompute the derived figures of a scale.json and redraw its plot, with "
        "the --acceptance projections at --project-from's step cost (dashed)",
    )
    p.add_argument("--project-from", default=None, help="arm name (default: none drawn)")
    args = p.parse_args(argv)
    acceptance = [float(x) for x in args.acceptance.split(",") if x]
    if args.replot:
        path = Path(args.replot)
        report = json.loads(path.read_text())
        for arm in report["arms"].values():  # JSON turned the batch keys into strings
            arm["batches"] = [{**b, "batch": int(b["batch"])} for b in arm["batches"]]
        derive(report, acceptance)
        report["projected_from"] = args.project_from
        path.write_text(json.dumps(report, indent=2))
        return 0 if plot(report, path.with_suffix(".png")) else 1

    from codraft.prepare import resolve_model
    from codraft.server.compat import require_supported

    version = require_supported()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Path(args.tokenizer) if args.tokenizer else resolve_model("smollm2")
    target, draft = make_models(out, tokenizer, args.draft_vocab)
    prompts, chat, source = load_prompt_list(None)
    common = dict(
        target=str(target),
        k=args.k,
        batches=[int(b) for b in args.batches.split(",")],
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        gpu_memory_utilization=args.gpu_mem,
        prompts=prompts,
        chat=chat,
        cuda_graphs=not args.eager,
        load_format="dummy",
    )
    arms = [ArmSpec("base", **common)] if not args.no_base else []
    taps = [t for t in args.codraft_arms.split(",") if t in CODRAFT_ARMS]
    for a in acceptance:
        spec = dict(draft=str(draft), synthetic_acceptance=a, **common)
        arms.append(ArmSpec(f"eagle3 AL {a:g}", **spec))
        for tap in taps:
            name = f"codraft tap {tap} AL {a:g}"
            mode = "ids" if tap == "ids" else "full"
            assembly = "thread" if tap == "on-thread" else "process"
            arms.append(ArmSpec(name, codraft=True, tap=tap != "off", tap_mode=mode,
                                tap_assembly=assembly, tap_device_ring=tap == "on-ring",
                                **spec))  # fmt: skip
    import torch

    report: dict = {
        "vllm_version": version,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "target": LLAMA_8B,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "cuda_graphs": not args.eager,
        "prompts": source,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "arms": {},
        "failures": {},
    }
    t0 = time.perf_counter()
    for spec in arms:
        print(f"[{spec.name}] {time.perf_counter() - t0:6.1f}s ...", flush=True)
        try:
            res = run_arm_subprocess(spec, out / "scale-arms", args.arm_timeout)
        except Exception as e:  # the next arm still runs; the report names the failure
            report["failures"][spec.name] = str(e)
            print(f"[{spec.name}] FAILED: {e}", flush=True)
            continue
        res["spec"] = {k: v for k, v in asdict(spec).items() if k != "prompts"}
        report["arms"][spec.name] = strip_ids(res)
        print_summary({"arms": {spec.name: report["arms"][spec.name]}})
        sys.stdout.flush()
        (out / "scale.json").write_text(json.dumps(report, indent=2))  # after every arm
    derive(report, acceptance)
    for name, row in report.get("speedup", {}).items():
        print(f"  speed-up, {name}: " + ", ".join(f"b{k} {v:.2f}x" for k, v in row.items()))
    for name, row in report.get("vs_plain", {}).items():
        print(f"  {name}: " + ", ".join(f"b{k} {v:.3f}x" for k, v in row.items()))
    for name, t in report.get("tap", {}).items():
        print(f"  tap, {name}: {t}")
    if report["arms"]:
        plot(report, out / "scale.png")
    report["total_s"] = time.perf_counter() - t0
    (out / "scale.json").write_text(json.dumps(report, indent=2))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
