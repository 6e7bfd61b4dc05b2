"""SGLang's own EAGLE-3 speculative decoding on SmolLM2, on the GPU: the first step of an SGLang
engine behind codraft's contracts. Stock SGLang, no codraft code inside it.

Two steps, in two environments (the SGLang venv holds no codraft):

    # 1. in the vLLM venv: SmolLM2 as safetensors (codraft prepare) and an EAGLE-3 draft whose
    #    config.json speaks SGLang's tap-layer convention (codraft.draft.config); --draft DIR
    #    converts a trained codraft draft instead of writing an untrained one
    .gpu_venv/bin/python scripts/gpu_sglang/eagle3_smoke.py prepare --work runs/gpu_work/sgl
    # 2. in the SGLang venv (scripts/gpu_sglang/install.sh)
    .gpu_sglang_venv/bin/python scripts/gpu_sglang/eagle3_smoke.py run --work runs/gpu_work/sgl \\
        --out "$OUT" --attention-backend flashinfer

`run` starts `sglang.Engine` twice in one process, without and with EAGLE-3 (k = 3 steps, top-1,
4 draft tokens; with `--dflash DIR` a third time, SGLang's DFlash with that draft), sends the
same held-out prompts greedily, and records per arm: greedy token
ids, seconds, tokens/s, and SGLang's own mean acceptance length; then whether every output is
identical across the arms (the lossless check). Each stage (import, engine start, generation)
is recorded with its error and traceback when it fails, so a failed attempt says where: import,
kernel load, JIT, memory. Writes $OUT/sglang_eagle3.json; exit 0 when every arm ran and every
output matched.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpu_vllm"))  # make_prompts, stages
from stages import Stages  # noqa: E402 (after the path)


def prepare(args: argparse.Namespace) -> int:
    """SmolLM2 and an SGLang-convention EAGLE-3 draft under --work (vLLM venv: codraft)."""
    from codraft.draft.config import DraftConfig
    from codraft.draft.init import write_new_draft
    from codraft.prepare import resolve_model

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model("smollm2")
    target = work / "target"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(model, target)
    draft = work / "draft"
    shutil.rmtree(draft, ignore_errors=True)
    if args.draft:
        shutil.copytree(args.draft, draft)
    else:
        write_new_draft(draft, target)
    hf = json.loads((draft / "config.json").read_text())
    cfg = DraftConfig.from_hf_dict(hf)  # codraft ships vLLM's convention
    (draft / "config.json").write_text(json.dumps(cfg.to_hf_dict(engine="sglang"), indent=2))
    print(json.dumps({"target": str(target), "draft": str(draft), "tap_layers": cfg.tap_layers}))
    return 0


def arm(stages: Stages, name: str, engine_kwargs: dict, prompts: list[list[int]],
        max_tokens: int) -> dict | None:  # fmt: skip
    import sglang

    engine = stages.run(f"{name}_start", lambda: sglang.Engine(**engine_kwargs))
    if engine is None:
        return None
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = stages.run(
            f"{name}_generate", lambda: engine.generate(input_ids=prompts, sampling_params=params)
        )
        seconds = time.perf_counter() - t0
        if outs is None:
            return None
        ids = [o["output_ids"] for o in outs]
        info = stages.run(f"{name}_server_info", engine.get_server_info) or {}
        states = info.get("internal_states") or [{}]
        return {
            "token_ids": ids, "seconds": seconds,
            "tokens_per_s": sum(len(i) for i in ids) / seconds,
            "acceptance_length": states[0].get("avg_spec_accept_length"),
        }  # fmt: skip
    finally:
        stages.run(f"{name}_shutdown", engine.shutdown)


def run(args: argparse.Namespace) -> int:
    from make_prompts import load_prompts

    work, out = Path(args.work).resolve(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args)}
    stages = Stages(report, "sglang")
    sglang = stages.run("import_sglang", lambda: __import__("sglang"))
    if sglang is not None:
        report["sglang"] = sglang.__version__
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(work / "target"))
        questions = load_prompts()["heldout"][: args.prompts]
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in questions
        ]
        prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
        base = {
            "model_path": str(work / "target"), "dtype": "bfloat16", "random_seed": 0,
            "mem_fraction_static": args.mem_fraction, "attention_backend": args.attention_backend,
            "disable_cuda_graph": args.no_cuda_graph, "log_level": "warning",
        }  # fmt: skip
        spec = {
            "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(work / "draft"),
            "speculative_num_steps": args.k, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": args.k + 1,
        }  # fmt: skip
        arms = {"plain": base, "eagle3": {**base, **spec}}
        if args.dflash:  # a trained codraft DFlash draft (z-lab's format, which SGLang reads)
            block = json.loads((Path(args.dflash) / "config.json").read_text())["block_size"]
            arms["dflash"] = {
                **base, "speculative_algorithm": "DFLASH",
                "speculative_draft_model_path": str(Path(args.dflash).resolve()),
                "speculative_num_draft_tokens": block,
            }  # fmt: skip
        results = {n: arm(stages, n, kw, prompts, args.max_tokens) for n, kw in arms.items()}
        for name, res in results.items():
            if res is not None:
                report[name] = {k: v for k, v in res.items() if k != "token_ids"}
        plain, lossless = results["plain"], {}
        for name, res in results.items():
            if name == "plain" or plain is None or res is None:
                continue
            same = [a == b for a, b in zip(plain["token_ids"], res["token_ids"], strict=True)]
            report[name]["identical_outputs"] = f"{sum(same)}/{len(same)}"
            report[name]["speedup"] = res["tokens_per_s"] / plain["tokens_per_s"]
            lossless[name] = all(same)
        report["ok"] = len(lossless) == len(arms) - 1 and all(lossless.values())
    report.setdefault("ok", False)
    (out / "sglang_eagle3.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "stages"}, indent=2))
    return 0 if report["ok"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("prepare", help="the target and the draft (vLLM venv)")
    pp.add_argument("--work", default="runs/gpu_work/sgl")
    pp.add_argument("--draft", default=None, help="a codraft EAGLE-3 draft (default: untrained)")
    pr = sub.add_parser("run", help="both arms (SGLang venv)")
    pr.add_argument("--work", default="runs/gpu_work/sgl")
    pr.add_argument("--out", required=True)
    pr.add_argument("--k", type=int, default=3)
    pr.add_argument("--prompts", type=int, default=32)
    pr.add_argument("--max-tokens", type=int, default=128)
    pr.add_argument("--mem-fraction", type=float, default=0.3)
    pr.add_argument("--attention-backend", default="flashinfer", help="fa3, flashinfer, triton")
    pr.add_argument("--no-cuda-graph", action="store_true")
    pr.add_argument("--dflash", default=None, help="also a DFlash arm with this draft folder")
    args = p.parse_args()
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
