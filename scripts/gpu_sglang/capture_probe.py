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

Then, --batch requests at a time (greedy): generate with speculation; send each final sequence
again as a fresh prompt (radix cache off, so every position is computed in one prefill);
compare, position by position, the features captured while decoding (the prompt's
prefill rows, and in each verification the rows up to the first rejected draft) with the fresh
prefill's. With EAGLE-3 a second hook, on the EAGLE worker's step, records which requests the
batch holds, in order, and how many tokens each accepted: each request's rows are cut from the
batch by it (so batches above 1 can be checked), and SGLang's accepted lengths are checked
against the rows that match the final sequence (the bookkeeping a capture would use). The rows
of rejected drafts are compared too: they differ (another token at that position), which shows
that the comparison can fail.

    .gpu_sglang_venv/bin/python scripts/gpu_sglang/capture_probe.py --work runs/gpu_work/sgl \\
        --out "$OUT" --algorithm EAGLE3 --batch 8 --prompts 8
    .gpu_sglang_venv/bin/python scripts/gpu_sglang/capture_probe.py --work runs/gpu_work/sgl \\
        --out "$OUT" --algorithm DFLASH --draft .gpu_carry/dflash      # one request at a time

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
            "kind": "forward",
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


def _around_generation(original, self, batch, *args, **kwargs):
    """The EAGLE worker's step: which requests, in order, and how many tokens each accepted."""
    out = original(self, batch, *args, **kwargs)
    import torch

    folder = Path(os.environ["{RECORDS_ENV}"])
    n = next(_count)
    try:
        extend = batch.forward_mode.is_extend() or bool(getattr(batch, "is_extend_in_batch", 0))
        accept = getattr(out, "accept_lens", None)
        record = {{
            "kind": "batch",
            "mode": batch.forward_mode.name,
            "rids": [r.rid for r in batch.reqs],
            "extend_lens": list(batch.extend_lens) if extend and batch.extend_lens else None,
            "accept_lens": None if extend or accept is None else accept.detach().cpu(),
            "num_draft_tokens": getattr(out, "speculative_num_draft_tokens", None),
        }}
        torch.save(record, folder / f"{{os.getpid()}}-{{n:07d}}.pt")
    except Exception as err:
        (folder / f"{{os.getpid()}}-{{n:07d}}.err").write_text(repr(err))
    return out


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _around_forward,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
        _around_generation,
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


def _rows(rec: dict, start: int, n: int, mode: str, accept_len: int | None) -> dict:
    return {
        "mode": mode,
        "input_ids": rec["input_ids"][start : start + n],
        "positions": rec["positions"][start : start + n],
        "hidden": rec["hidden"][start : start + n],
        "accept_len": accept_len,
    }


def split_by_request(records: list[dict]) -> dict[str, list[dict]] | None:
    """Each request's rows, from the target's forward records and the EAGLE worker's batch
    records that follow them (which requests, in order; extend lengths; accepted lengths); None
    when there are no batch records (another worker: DFlash)."""
    out: dict[str, list[dict]] = {}
    last, seen = None, False
    for rec in records:
        if rec.get("kind", "forward") == "forward":
            last = rec
            continue
        seen = True
        if last is None or last["hidden"] is None:
            continue
        if rec["extend_lens"] is not None:
            offset = 0
            for rid, n in zip(rec["rids"], rec["extend_lens"], strict=True):
                out.setdefault(rid, []).append(_rows(last, offset, n, "EXTEND", None))
                offset += n
        elif rec["accept_lens"] is not None:
            k = int(rec["num_draft_tokens"])
            for i, rid in enumerate(rec["rids"]):
                accept = int(rec["accept_lens"][i])
                out.setdefault(rid, []).append(_rows(last, i * k, k, "TARGET_VERIFY", accept))
        last = None
    return out if seen else None


def compare(final: list[int], decode: list[dict], prefill: dict, tol: float) -> dict[str, Any]:
    """Rows captured while decoding against the fresh prefill of `final`, by position: final
    rows (prefill rows; in a verification, rows until the first whose token is not the final
    sequence's) and rejected ones. Relative error: max |a - b| / max |b| per row."""
    ref_pos = prefill["positions"].tolist()
    ref = {p: prefill["hidden"][i] for i, p in enumerate(ref_pos)}
    accepted, rejected, modes = [], [], {}
    covered, accept_mismatch = set(), 0
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
        if rec.get("accept_len") is not None:  # SGLang's count of new tokens = final rows
            n_final = next((i for i, t in enumerate(ids) if pos[i] >= len(final)
                            or t != final[pos[i]]), len(ids))  # fmt: skip
            accept_mismatch += n_final != rec["accept_len"] and pos[0] + rec["accept_len"] <= len(
                final
            )
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
        "accept_len_mismatches": accept_mismatch,
        "ok": worst is not None
        and worst <= tol
        and set(range(len(final) - 1)) <= covered
        and not accept_mismatch,
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
    p.add_argument("--batch", type=int, default=1, help="requests decoded together (EAGLE3)")
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
    if args.algorithm == "EAGLE3":  # a codraft checkpoint: SGLang reads its view of it
        from eagle3_smoke import sglang_draft

        draft = sglang_draft(draft, work)
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
        from eagle3_smoke import heldout_prompt_ids

        report["sglang"] = sglang.__version__
        engine = stages.run("engine_start", lambda: sglang.Engine(**kwargs))
        if engine is None:
            raise RuntimeError("the engine did not start")
        seen: set[str] = set()
        take_records(records, seen)  # start-up's warm-up forwards
        params = {"temperature": 0.0, "max_new_tokens": args.max_tokens, "ignore_eos": True}
        results = []
        prompts = heldout_prompt_ids(work / "target")[: args.prompts]
        for g in range(0, len(prompts), args.batch):
            group = prompts[g : g + args.batch]
            outs = engine.generate(input_ids=group, sampling_params=params)
            decode = take_records(records, seen)
            per_request = split_by_request(decode)
            if per_request is None and len(group) > 1:
                raise RuntimeError("--batch > 1 needs the EAGLE worker's records (EAGLE3)")
            for prompt, o in zip(group, outs, strict=True):
                final = prompt + list(o["output_ids"])
                rid = o.get("meta_info", {}).get("id")
                mine = decode if per_request is None else per_request.get(rid)
                if mine is None and per_request is not None and len(per_request) == 1:
                    mine = next(iter(per_request.values()))
                if mine is None:
                    raise RuntimeError(f"no rows of request {rid!r} in {list(per_request or {})}")
                engine.generate(input_ids=[final], sampling_params={**params, "max_new_tokens": 1})
                fresh = [
                    r for r in take_records(records, seen)
                    if r.get("kind", "forward") == "forward" and r["hidden"] is not None
                ]  # fmt: skip
                prefill = next((r for r in fresh if len(r["input_ids"]) == len(final)), None)
                if prefill is None:
                    raise RuntimeError(
                        f"no single prefill of the {len(final)}-token sequence among "
                        f"{[(r['mode'], len(r['input_ids'])) for r in fresh]}"
                    )
                results.append({"batch": len(group), **compare(final, mine, prefill, args.tol)})
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
