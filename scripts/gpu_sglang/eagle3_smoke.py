"""SGLang's own EAGLE-3 speculative decoding on SmolLM2, on the GPU: the first step of an SGLang
engine behind codraft's contracts. Stock SGLang, no codraft code inside it.

Two steps, in two environments (the SGLang venv holds no codraft):

    # 1. in the vLLM venv: SmolLM2 as safetensors (codraft prepare) and an untrained codraft
    #    EAGLE-3 draft (--draft DIR: a trained one instead); `run` hands SGLang its view of the
    #    draft (config.json in SGLang's tap numbering, codraft.server.sglang.serve.sglang_view)
    .gpu_venv/bin/python scripts/gpu_sglang/eagle3_smoke.py prepare --work runs/gpu_work/sgl
    # 2. in the SGLang venv (scripts/gpu_sglang/install.sh)
    .gpu_sglang_venv/bin/python scripts/gpu_sglang/eagle3_smoke.py run --work runs/gpu_work/sgl \\
        --out "$OUT" --attention-backend flashinfer

`run` starts `sglang.Engine` in turn without speculation, with EAGLE-3 (k = 3 steps, top-1, 4
draft tokens; --eagle3-draft DIR, default the prepared one), with `--codraft` the same EAGLE-3
engine with codraft's engine inside (codraft.server.sglang: capture, tap on to a sink;
`--codraft-thread` once more, the tap assembled in the scheduler's process) and,
with `--dflash DIR`, with SGLang's DFlash and that draft, every arm with the radix cache off (as
codraft's full tap needs, and as the vLLM sweep runs without prefix caching); each one warms up at
every batch size, then runs batches of 1, 8, 32, 64 greedy requests of --max-tokens tokens
(ignore_eos) on the 64 held-out questions, chat template applied, each batch timed --repeats
times (the median run reported, every run's tokens/s beside it): the method and prompts of
scripts/gpu_vllm/bench_serving.py, so the figures stand beside codraft's vLLM engine's. Per arm
and batch: tokens/s, the acceptance length SGLang counted for those requests (1 + accepted
drafts per verification, from each response's meta_info), greedy outputs identical to the plain
arm's (the lossless check) and the speed-up over it. Each stage (import, engine start, the
sweep) is recorded with its error and traceback when it fails, so a failed attempt says where:
import, kernel load, JIT, memory. Writes $OUT/sglang_eagle3.json; exit 0 when every arm ran and
every output matched.
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
sys.path.insert(0, str(HERE.parent / "gpu_vllm"))  # make_prompts, stages, bench_serving
from stages import Stages  # noqa: E402 (after the path)


def prepare(args: argparse.Namespace) -> int:
    """SmolLM2 and a codraft EAGLE-3 draft under --work (vLLM venv: codraft and the model's
    package); `run` gives SGLang its view of the draft (codraft.server.sglang.serve)."""
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
    print(json.dumps({"target": str(target), "draft": str(draft)}))
    return 0


def sglang_draft(draft: Path, work: Path) -> Path:
    """SGLang's view of a codraft EAGLE-3 checkpoint (its config in SGLang's tap numbering)."""
    from codraft.server.sglang.serve import sglang_view

    return sglang_view(draft.resolve(), work / "views")


class TapSink:
    """A PULL socket on a free port of 127.0.0.1 (the learner's side of the tap): counts the
    messages; with `keep`, decodes them (codraft.tap.message) and keeps them by request."""

    def __init__(self, keep: bool = False) -> None:
        import threading

        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PULL)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.keep = keep
        self.count = 0
        self.messages: dict[str, list[Any]] = {}
        self.rejected: list[str] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from codraft.tap.message import TapRejected, decode

        while not self.stop:
            if not self.sock.poll(200):
                continue
            frames = self.sock.recv_multipart()
            self.count += 1
            if not self.keep:
                continue
            try:
                msg = decode(frames)
            except TapRejected as e:
                self.rejected.append(f"{e.reason}: {e}")
                continue
            except Exception as e:  # kept, so that the sink goes on and the check can say why
                self.rejected.append(f"{type(e).__name__}: {e}")
                continue
            self.messages.setdefault(msg.header.request_id, []).append(msg)

    def wait_for(self, rids: list[str], timeout: float = 30.0) -> dict[str, list[Any]]:
        """The kept messages of these requests, once each has one (or after `timeout` s)."""
        end = time.time() + timeout
        while time.time() < end and not all(r in self.messages for r in rids):
            time.sleep(0.1)
        return {r: self.messages.get(r, []) for r in rids}


def heldout_prompt_ids(target: Path) -> list[list[int]]:
    """The held-out questions (scripts/gpu_vllm/prompts.json.gz), chat template applied, as
    token ids for `sglang.Engine.generate(input_ids=...)`."""
    from make_prompts import load_prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    out = []
    for q in load_prompts()["heldout"]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def batch_row(outs: list[dict], seconds: float) -> dict[str, Any]:
    """One timed batch: greedy token ids, tokens/s, and the acceptance length SGLang counted
    for these requests (1 + accepted drafts per verification, vLLM's definition: from each
    response's `spec_num_correct_drafts` and `spec_verify_ct`; None without speculation)."""
    ids = [list(o["output_ids"]) for o in outs]
    metas = [o.get("meta_info") or {} for o in outs]
    verifications = sum(m.get("spec_verify_ct", 0) for m in metas)
    accepted = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    return {
        "batch": len(outs), "token_ids": ids, "seconds": seconds,
        "tokens_per_s": sum(len(i) for i in ids) / seconds,
        "acceptance_length": 1 + accepted / verifications if verifications else None,
    }  # fmt: skip


SYNC = ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent", "cudaHostAlloc")
STEP_OP = "run_batch"  # SGLang's annotation of a scheduler step (scheduler.run_batch)


def summarize_trace(folder: Path, steps: int, top: int = 15) -> dict[str, Any]:
    """A torch profiler trace of `steps` scheduler steps (SGLang's start_profile writes Chrome
    trace JSON, gzipped or not, under `folder`) reduced to what says where a step's time goes:
    per category (cpu_op, python_function, cuda_runtime, kernel, gpu_memcpy, ...) the events and
    microseconds per step, the `top` names of host ops and CUDA runtime calls by time per step,
    and the runtime calls that make the host wait or copy (SYNC) with their counts per step:
    all of them, and those on the scheduler's step thread (the one that runs STEP_OP), whose
    waits hold the next step back, unlike a helper thread's; and codraft's own hooks (the
    plugin's "codraft.*" ranges), all of them, ranked or not."""
    import gzip
    from collections import defaultdict

    files = sorted(folder.rglob("*.json*"))
    if not files:
        raise FileNotFoundError(f"no trace under {folder}")
    by_name: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])  # count, us
    on_step: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # SYNC calls, step thread
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            events = [e for e in json.load(fh).get("traceEvents", []) if e.get("ph") == "X"]
        # complete events (the ones with a duration); the step's thread: where STEP_OP runs
        step = {(e.get("pid"), e.get("tid")) for e in events if STEP_OP in str(e.get("name"))}
        for e in events:
            cat, name = str(e.get("cat", "")), str(e.get("name", ""))
            v = by_name[(cat, name)]
            v[0] += 1
            v[1] += float(e.get("dur", 0.0))
            if (e.get("pid"), e.get("tid")) in step and _is_sync(cat, name):
                on_step[name][0] += 1
                on_step[name][1] += float(e.get("dur", 0.0))
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (cat, _), (n, us) in by_name.items():
        by_cat[cat][0] += n
        by_cat[cat][1] += us

    def per_step(v: list[float]) -> dict[str, float]:
        return {"count": round(v[0] / steps, 2), "us": round(v[1] / steps, 1)}

    def ranked(cats: tuple[str, ...]) -> list[dict[str, Any]]:
        rows = [(n, v) for (c, n), v in by_name.items() if c in cats]
        rows.sort(key=lambda r: -r[1][1])
        return [{"name": n[:120], **per_step(v)} for n, v in rows[:top]]

    return {
        "files": [f.name for f in files],
        "steps": steps,
        "per_step": {c: per_step(v) for c, v in sorted(by_cat.items())},
        "host_ops": ranked(("cpu_op", "python_function", "user_annotation")),
        "cuda_runtime": ranked(("cuda_runtime", "cuda_driver")),
        "waits_and_copies": {
            n: per_step(v) for (c, n), v in sorted(by_name.items()) if _is_sync(c, n)
        },
        "waits_and_copies_on_step_thread": {n: per_step(v) for n, v in sorted(on_step.items())},
        "codraft_hooks": {
            n: per_step(v)
            for (c, n), v in sorted(by_name.items())
            if c == "user_annotation" and n.startswith("codraft.")
        },
    }


def _is_sync(cat: str, name: str) -> bool:
    return cat in ("cuda_runtime", "cuda_driver") and any(k in name for k in SYNC)


def profile(engine: Any, folder: Path, prompts: list[list[int]], batch: int, steps: int,
            max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """`steps` scheduler steps of one batch of `batch` requests under SGLang's profiler (host
    and device), summarised (summarize_trace)."""
    from bench_serving import batch_prompts

    folder.mkdir(parents=True, exist_ok=True)
    # without Python stacks: tracing every Python call made a step 4-5 times as long
    engine.start_profile(output_dir=str(folder), num_steps=steps, activities=["CPU", "GPU"],
                         with_stack=False)  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
    engine.generate(input_ids=batch_prompts(prompts, batch), sampling_params=params)
    deadline = time.time() + 120  # the trace is written when the last profiled step ends
    while not any(folder.rglob("*.json*")) and time.time() < deadline:
        time.sleep(1.0)
    time.sleep(2.0)  # a file being written
    return summarize_trace(folder, steps)


def arm(stages: Stages, name: str, engine_kwargs: dict, prompts: list[list[int]],
        max_tokens: int, batches: list[int], env: dict[str, str] | None = None,
        repeats: int = 1, profiled: tuple[Path, int, int] | None = None
        ) -> dict | None:  # fmt: skip
    """One engine: a warm-up at every batch size (kernels specialise on it), then each batch of
    the sweep timed `repeats` times, the run of median tokens/s reported with every run's
    (scripts/gpu_vllm/bench_serving.py's rule for vLLM). `env`: set while the engine starts
    (its processes inherit it): codraft's engine for the codraft arms. `profiled` (folder,
    batch, steps): then that many steps of one batch under SGLang's profiler, summarised."""
    import os

    import sglang
    from bench_serving import batch_prompts, median_run

    os.environ.update(env or {})
    try:
        engine = stages.run(f"{name}_start", lambda: sglang.Engine(**engine_kwargs))
    finally:
        for key in env or {}:
            os.environ.pop(key, None)
    if engine is None:
        return None
    try:
        params = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        warm = {**params, "max_new_tokens": 8}

        def sweep() -> list[dict[str, Any]]:
            for b in sorted(set(batches)):
                engine.generate(input_ids=batch_prompts(prompts, b), sampling_params=warm)
            rows = []
            for b in batches:
                runs = []
                for _ in range(max(repeats, 1)):
                    t0 = time.perf_counter()
                    outs = engine.generate(input_ids=batch_prompts(prompts, b),
                                           sampling_params=params)  # fmt: skip
                    runs.append(batch_row(outs, time.perf_counter() - t0))
                rows.append(median_run(runs))
            return rows

        rows = stages.run(f"{name}_generate", sweep)
        if rows is None:
            return None
        res: dict[str, Any] = {"batches": rows}
        if profiled is not None:
            folder, batch, steps = profiled
            res["profile"] = stages.run(
                f"{name}_profile",
                lambda: profile(engine, folder / name, prompts, batch, steps, max_tokens),
            )
        return res
    finally:
        stages.run(f"{name}_shutdown", engine.shutdown)


def compare_arms(results: dict[str, dict | None]) -> tuple[dict[str, Any], dict[str, bool]]:
    """Per arm and batch: tokens/s, acceptance, identical outputs to the plain arm's and the
    speed-up over it; and whether each speculative arm was lossless at every batch."""
    report: dict[str, Any] = {}
    lossless: dict[str, bool] = {}
    plain = results.get("plain")
    for name, res in results.items():
        if res is None:
            continue
        rows = []
        bases = plain["batches"] if plain else [None] * len(res["batches"])
        for r, base in zip(res["batches"], bases, strict=True):  # the same sweep, in order
            row = {k: v for k, v in r.items() if k != "token_ids"}
            if name != "plain" and base is not None:
                same = [a == b for a, b in zip(base["token_ids"], r["token_ids"], strict=True)]
                row["identical_outputs"] = f"{sum(same)}/{len(same)}"
                row["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
                lossless[name] = lossless.get(name, True) and all(same)
            stock = results.get(name.split("-codraft")[0])
            if "-codraft" in name and stock is not None:  # codraft's hooks change nothing
                other = stock["batches"][len(rows)]
                same = [a == b for a, b in zip(other["token_ids"], r["token_ids"], strict=True)]
                row["identical_to_stock"] = f"{sum(same)}/{len(same)}"
            rows.append(row)
        report[name] = rows
    return report, lossless


def run(args: argparse.Namespace) -> int:
    work, out = Path(args.work).resolve(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args)}
    stages = Stages(report, "sglang", out / "sglang_eagle3.json")  # kept up as stages go
    sglang = stages.run("import_sglang", lambda: __import__("sglang"))
    if sglang is not None:
        report["sglang"] = sglang.__version__
        prompts = heldout_prompt_ids(work / "target")
        base = {
            "model_path": str(work / "target"), "dtype": "bfloat16", "random_seed": 0,
            "mem_fraction_static": args.mem_fraction, "attention_backend": args.attention_backend,
            "disable_cuda_graph": args.no_cuda_graph, "log_level": "warning",
            # every arm computes every prompt, as codraft's full tap needs (and as the vLLM
            # sweep runs without prefix caching): timings and outputs compare like for like
            "disable_radix_cache": True,
        }  # fmt: skip
        draft = Path(args.eagle3_draft or work / "draft").resolve()
        spec = {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": str(sglang_draft(draft, work)),
            "speculative_num_steps": args.k, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": args.k + 1,
        }  # fmt: skip
        arms = {"plain": base, "eagle3": {**base, **spec}}
        if args.no_plain:
            del arms["plain"]
        envs: dict[str, dict[str, str]] = {}
        sink = None
        if args.codraft:  # the same draft with codraft's engine inside, the tap on
            from codraft.server.engine_config import EngineConfig
            from codraft.server.sglang.engine import ENV, Settings

            sink = TapSink()
            control = f"ipc://{work}/codraft-control"
            # --codraft-thread: the same once more, assembling in the scheduler's process
            for suffix, assembly in [("", "process"), ("-thread", "thread")][
                : 1 + args.codraft_thread
            ]:
                cfg = EngineConfig(tap_endpoint=sink.endpoint, tap_assembly=assembly)
                arms[f"eagle3-codraft{suffix}"] = {**base, **spec}
                envs[f"eagle3-codraft{suffix}"] = {ENV: Settings(str(draft), control,
                                                                 cfg).to_env()}  # fmt: skip
        if args.dflash:  # a trained codraft DFlash draft (z-lab's format, which SGLang reads)
            block = json.loads((Path(args.dflash) / "config.json").read_text())["block_size"]
            arms["dflash"] = {
                **base, "speculative_algorithm": "DFLASH",
                "speculative_draft_model_path": str(Path(args.dflash).resolve()),
                "speculative_num_draft_tokens": block,
            }  # fmt: skip
            if args.codraft:  # the same with codraft's engine inside
                settings = Settings(str(Path(args.dflash).resolve()), control,
                                    EngineConfig(tap_endpoint=sink.endpoint))  # fmt: skip
                arms["dflash-codraft"] = dict(arms["dflash"])
                envs["dflash-codraft"] = {ENV: settings.to_env()}
        batches = [int(b) for b in args.batches.split(",")]
        profiled = (out / "profiles", args.profile_batch, args.profile_steps)
        results = {
            n: arm(stages, n, kw, prompts, args.max_tokens, batches, envs.get(n), args.repeats,
                   profiled if args.profile_batch and n != "plain" else None)
            for n, kw in arms.items()
        }  # fmt: skip
        report["profiles"] = {n: r.get("profile") for n, r in results.items()
                              if r is not None and "profile" in r}  # fmt: skip
        if sink is not None:
            report["codraft_tap_messages"] = sink.count
        report["arms"], lossless = compare_arms(results)
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
    pr.add_argument("--batches", default="1,8,32,64", help="as bench_serving.py's")
    pr.add_argument("--max-tokens", type=int, default=128)
    pr.add_argument("--mem-fraction", type=float, default=0.3)
    pr.add_argument("--attention-backend", default="flashinfer", help="fa3, flashinfer, triton")
    pr.add_argument("--no-cuda-graph", action="store_true")
    pr.add_argument("--dflash", default=None, help="also a DFlash arm with this draft folder")
    pr.add_argument("--eagle3-draft", default=None, help="codraft EAGLE-3 draft (--work/draft)")
    pr.add_argument(
        "--codraft", action="store_true",
        help="also the EAGLE-3 arm with codraft's engine in SGLang, tap on",
    )  # fmt: skip
    pr.add_argument(
        "--codraft-thread", action="store_true",
        help="with --codraft: also that arm assembling the tap in SGLang's scheduler process "
        "(EngineConfig.tap_assembly='thread') instead of its tap process",
    )  # fmt: skip
    pr.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median)")
    pr.add_argument(
        "--no-plain", action="store_true",
        help="leave out the arm without speculation (its start is the longest): stock against "
        "codraft only, no identity to plain decoding",
    )  # fmt: skip
    pr.add_argument(
        "--profile-batch", type=int, default=0,
        help="after each speculative arm's sweep, profile one batch of this many requests "
        "(SGLang's profiler, host and device) and summarise where a step's time goes",
    )  # fmt: skip
    pr.add_argument("--profile-steps", type=int, default=30, help="steps profiled")
    args = p.parse_args()
    return prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
