"""Can codraft capture the target's tap features inside SGLang, under speculative decoding with
CUDA graphs, exactly? A probe on the GPU, before an SGLang engine is built on it.

SGLang 0.5.17 loads general plugins (entry-point group `sglang.srt.plugins`) at the start of
every scheduler process and applies their hooks (`sglang.srt.plugins.hook_registry`). This
script writes such a plugin into --work (a module and a dist-info naming it, on PYTHONPATH)
whose hook wraps the target's `ModelRunner.forward`: after each forward of the target (not the
draft's), it saves the batch's mode, input ids, positions and the hidden states the target
returns for the draft (with EAGLE-3 or DFlash, SGLang's model concatenates the tap layers'
residual streams: codraft's taps) to one file per forward. The forward itself is untouched, and
with CUDA graphs the hook sees what the replay returns.

Then, one request at a time (batch 1), greedy: generate with speculation; send the final
sequence again as a fresh prompt (radix cache off, so every position is computed in one
prefill); compare, position by position, the features captured while decoding (the prompt's
prefill rows, and in each verification the rows up to the first rejected draft) with the fresh
prefill's. The rows of rejected drafts are compared too: they differ (another token at that
position), which shows that the comparison can fail.

    .gpu_sglang_venv/bin/python scripts/gpu_sglang/capture_probe.py --work runs/gpu_work/sgl \\
        --out "$OUT" --algorithm DFLASH --draft .gpu_carry/dflash

(--work holds `target` from `eagle3_smoke.py prepare`; EAGLE3 takes its `draft` by default.)
Writes $OUT/sglang_capture.json; exit 0 when every accepted row matched the fresh prefill
within --tol (relative to the row's largest magnitude; bf16 kernels of other batch shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpu_vllm"))  # make_prompts, stages
from stages import Stages  # noqa: E402 (after the path)

PLUGIN = "codraft_sglang_probe"
RECORDS_ENV = "CODRAFT_PROBE_RECORDS"

PLUGIN_SOURCE = f'''"""Written by capture_probe.py: saves the target's forward outputs."""
import itertools
import os
from pathlib import Path

_count = itertools.count()


def _around_forward(original, self, forward_batch, *args, **kwargs):
    out = original(self, forward_batch, *args, **kwargs)
    if getattr(self, "is_draft_worker", False):
        return out
    import torch

    folder = Path(os.environ["{RECORDS_ENV}"])
    n = next(_count)
    try:
        hidden = getattr(out.logits_output, "hidden_states", None)
        record = {{
            "mode": forward_batch.forward_mode.name,
            "batch_size": int(forward_batch.batch_size),
            "input_ids": forward_batch.input_ids.detach().cpu(),
            "positions": None if forward_batch.positions is None
            else forward_batch.positions.detach().cpu(),
            "hidden": None if hidden is None else hidden.detach().float().cpu(),
            "graph": bool(getattr(out, "can_run_graph", False)),
            "time": __import__("time").time(),
        }}
        torch.save(record, folder / f"{{os.getpid()}}-{{n:07d}}.pt")
    except Exception as err:  # the probe never breaks serving
        (folder / f"{{os.getpid()}}-{{n:07d}}.err").write_text(repr(err))
    return out


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _around_forward,
        HookType.AROUND,
    )
'''


def install_plugin(site: Path) -> None:
    """The plugin module and a dist-info with its entry point, importable from `site`."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    info = site / f"{PLUGIN}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    sys.path.insert(0, str(site))  # this process's own load_plugins sees it too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def take_records(folder: Path, seen: set[str]) -> list[dict]:
    """The records written since the last call, in order."""
    import torch

    time.sleep(0.5)  # the forward thread writes before the request's output is handed back
    new = sorted(p for p in folder.iterdir() if p.name not in seen)
    seen.update(p.name for p in new)
    errors = [p.read_text() for p in new if p.suffix == ".err"]
    if errors:
        raise RuntimeError(f"the probe's hook failed: {errors[:3]}")
    return [torch.load(p) for p in new if p.suffix == ".pt"]


def compare(final: list[int], decode: list[dict], prefill: dict, tol: float) -> dict[str, Any]:
    """Rows captured while decoding against the fresh prefill of `final`, by position: final
    rows (prefill rows; in a verification, rows until the first whose token is not the final
    sequence's) and rejected ones. Relative error: max |a - b| / max |b| per row."""
    ref_pos = prefill["positions"].tolist()
    ref = {p: prefill["hidden"][i] for i, p in enumerate(ref_pos)}
    accepted, rejected, modes = [], [], {}
    covered = set()
    for rec in decode:
        modes[rec["mode"]] = modes.get(rec["mode"], 0) + 1
        if rec["hidden"] is None:
            continue
        ids, pos = rec["input_ids"].tolist(), rec["positions"].tolist()
        verify = "VERIFY" in rec["mode"]
        still_final = True
        for row, (tok, p) in enumerate(zip(ids, pos, strict=True)):
            if p >= len(final) or p not in ref:
                continue
            final_row = tok == final[p] and still_final
            if verify and not final_row:
                still_final = False
            b = ref[p]
            err = float((rec["hidden"][row] - b).abs().max() / b.abs().max().clamp_min(1e-6))
            (accepted if final_row else rejected).append(err)
            if final_row:
                covered.add(p)
    worst = max(accepted) if accepted else None
    return {
        "modes": modes,
        "final_rows": len(accepted),
        "positions_covered": len(covered),
        "positions_expected": len(final) - 1,
        "final_rows_max_rel_err": worst,
        "rejected_rows": len(rejected),
        "rejected_rows_min_rel_err": min(rejected) if rejected else None,
        "rejected_rows_median_rel_err": sorted(rejected)[len(rejected) // 2] if rejected else None,
        # every position but the last must have been an input (the last may be too: SGLang
        # verifies once more before it finishes a request)
        "ok": worst is not None and worst <= tol and set(range(len(final) - 1)) <= covered,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", default="runs/gpu_work/sgl")
    p.add_argument("--out", required=True)
    p.add_argument("--algorithm", default="DFLASH", choices=("DFLASH", "EAGLE3"))
    p.add_argument("--draft", default=None, help="draft folder (EAGLE3: default --work/draft)")
    p.add_argument("--k", type=int, default=3, help="EAGLE3 steps")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--attention-backend", default="flashinfer")
    args = p.parse_args()

    work, out = Path(args.work).resolve(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = work / "probe_records"
    records.mkdir(parents=True, exist_ok=True)
    for f in records.iterdir():
        f.unlink()
    os.environ[RECORDS_ENV] = str(records)
    install_plugin(work / "probe_site")
    report: dict[str, Any] = {"args": vars(args)}
    stages = Stages(report, "capture")
    draft = Path(args.draft or work / "draft").resolve()
    kwargs = {
        "model_path": str(work / "target"), "dtype": "bfloat16", "random_seed": 0,
        "mem_fraction_static": args.mem_fraction, "attention_backend": args.attention_backend,
        "disable_radix_cache": True, "log_level": "warning",
        "speculative_algorithm": args.algorithm, "speculative_draft_model_path": str(draft),
    }  # fmt: skip
    if args.algorithm == "DFLASH":
        kwargs["speculative_num_draft_tokens"] = json.loads((draft / "config.json").read_text())[
            "block_size"
        ]
    else:
        kwargs.update(speculative_num_steps=args.k, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=args.k + 1)  # fmt: skip
    engine = None
    try:
        import sglang
        from make_prompts import load_prompts
        from transformers import AutoTokenizer

        report["sglang"] = sglang.__version__
        engine = stages.run("engine_start", lambda: sglang.Engine(**kwargs))
        if engine is None:
            raise RuntimeError("the engine did not start")
        tok = AutoTokenizer.from_pretrained(str(work / "target"))
        seen: set[str] = set()
        take_records(records, seen)  # start-up's warm-up forwards
        params = {"temperature": 0.0, "max_new_tokens": args.max_tokens, "ignore_eos": True}
        results = []
        for q in load_prompts()["heldout"][: args.prompts]:
            prompt = tok.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True)  # fmt: skip
            prompt = prompt if isinstance(prompt, list) else list(prompt["input_ids"])
            o = engine.generate(input_ids=prompt, sampling_params=params)
            final = prompt + list(o["output_ids"])
            decode = take_records(records, seen)
            engine.generate(input_ids=final, sampling_params={**params, "max_new_tokens": 1})
            fresh = [r for r in take_records(records, seen) if r["hidden"] is not None]
            prefill = next((r for r in fresh if len(r["input_ids"]) == len(final)), None)
            if prefill is None:
                raise RuntimeError(
                    f"no single prefill of the {len(final)}-token sequence among "
                    f"{[(r['mode'], len(r['input_ids'])) for r in fresh]}"
                )
            results.append(compare(final, decode, prefill, args.tol))
            print(json.dumps(results[-1]), flush=True)
        report["requests"] = results
        info = engine.get_server_info()
        report["acceptance_length"] = (info.get("internal_states") or [{}])[0].get(
            "avg_spec_accept_length"
        )
        report["ok"] = bool(results) and all(r["ok"] for r in results)
    except Exception as err:
        import traceback

        report["error"] = f"{type(err).__name__}: {err}"
        report["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if engine is not None:
            stages.run("shutdown", engine.shutdown)
    report.setdefault("ok", False)
    (out / "sglang_capture.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("stages", "requests")},
                     indent=2))  # fmt: skip
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
