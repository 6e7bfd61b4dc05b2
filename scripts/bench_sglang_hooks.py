"""What codraft's SGLang engine takes from SGLang's scheduler thread, on the host alone.

SGLang cannot run on this machine (no CPU build of its kernels; docs/sglang.md), so its
scheduler is a stand-in loop and its objects are the tests' stand-ins (tests/sglang_standins.py);
everything of codraft's is real: `SGLangEngine` and the hooks the plugin calls
(`on_batch`, `on_target_forward` with `split_final`, `end_batch`, `on_result`), the row gather,
the tap assembled in the tap process (`tap_assembly = "process"`, the default) or in a thread of
the scheduler's process ("thread"), and the messages sent over ZeroMQ to a receiver process.

Each step of the stand-in scheduler: a fixed amount of Python work (`--host-ms`, what it takes
with nothing else running: SGLang's own host work), the launch hooks, a wait for the GPU with
the interpreter lock released (`--gpu-ms`: a sleep, as SGLang's wait for its copy event), the
result hook. Requests live `--life` steps: a prefill of `--prompt` tokens, then verifications of
`--k` + 1 rows, `--accept` of them final. Arms ("none": the loop alone, "process", "thread")
alternate `--repeats` times; per arm the medians: the step, the fixed work (how much the other
threads and processes slowed it), each group of hooks, and the prefill steps apart.

On a CPU the row gather is a host copy (on a GPU, kernels on the engine's stream), so the launch
hooks here are an upper bound on their host time there.

    .venv/bin/python scripts/bench_sglang_hooks.py --out runs/bench_sglang_hooks.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the SGLang stand-ins
from sglang_standins import DraftModel, EAGLEWorkerV2, Mode, Req  # noqa: E402

from codraft.draft.init import write_new_draft  # noqa: E402
from codraft.models.config import TargetConfig  # noqa: E402
from codraft.prepare import resolve_model  # noqa: E402
from codraft.server.engine_config import EngineConfig  # noqa: E402
from codraft.server.serve import free_port  # noqa: E402
from codraft.server.sglang.engine import Settings, SGLangEngine, split_final  # noqa: E402

RECEIVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.PULL)
sock.bind(sys.argv[1])
while True:
    sock.recv_multipart(copy=False)
"""


def calibrate() -> float:
    """Iterations of `spin` per millisecond, with nothing else running."""
    n = 2_000_000
    t = time.perf_counter()
    spin(n)
    return n / ((time.perf_counter() - t) * 1e3)


def spin(n: int) -> None:
    x = 0
    for _ in range(n):
        x += 1


def make_engine(arm: str, draft: Path, taps: list[int], target: Path, endpoint: str,
                work: Path) -> SGLangEngine:  # fmt: skip
    cfg = TargetConfig.from_pretrained(target)
    model = torch.nn.Module()
    model.embed = torch.nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
    model.model = SimpleNamespace(layers_to_capture=list(taps))
    hf = SimpleNamespace(hidden_size=cfg.hidden_size, to_dict=lambda: {})
    runner = SimpleNamespace(
        model=model, dtype=torch.bfloat16, device="cpu", gpu_id=0, weight_updater=None,
        model_config=SimpleNamespace(hf_config=hf, context_len=1 << 16),
    )  # fmt: skip
    scheduler = SimpleNamespace(
        draft_worker=EAGLEWorkerV2(runner, DraftModel(load_file(draft / "model.safetensors"),
                                                      model.embed)),
        server_args=SimpleNamespace(model_path=str(target), speculative_eagle_topk=1,
                                    tp_size=1, pp_size=1, disable_radix_cache=True),
    )  # fmt: skip
    control = f"ipc://{work}/control-{arm}-{time.monotonic_ns()}"
    engine_cfg = EngineConfig(tap_endpoint=endpoint, tap_assembly=arm)
    return SGLangEngine(scheduler, Settings(str(draft), control, engine_cfg))


def run(args: argparse.Namespace, arm: str, per_ms: float, draft: Path, taps: list[int],
        target: Path, endpoint: str, work: Path) -> dict[str, Any]:  # fmt: skip
    """One arm; the first `--life` steps (one generation of requests) are a warm-up."""
    engine = None if arm == "none" else make_engine(arm, draft, taps, target, endpoint, work)
    if engine is not None and not engine.assembler.flush(600):  # the tap process is up
        raise RuntimeError("the tap process did not answer within 600 s")
    B, rows, P = args.batch, args.k + 1, args.prompt  # noqa: N806
    hidden = TargetConfig.from_pretrained(target).hidden_size
    width = (len(taps) + 1) * hidden
    prefill_hs = torch.randn(P * B, width).to(torch.bfloat16)
    verify_hs = torch.randn((B + 1) * rows, width).to(torch.bfloat16)  # + a padding request
    prefill_fb = SimpleNamespace(
        input_ids=torch.arange(P).repeat(B), positions=torch.arange(P).repeat(B),
        forward_mode=Mode("EXTEND"), batch_size=B, spec_info=None,
    )  # fmt: skip
    verify_spec = SimpleNamespace(draft_token_num=rows, ragged_verify_layout=None)
    accept = torch.full((B,), args.accept)
    work_n = int(per_ms * args.host_ms)
    steps: list[dict[str, float]] = []
    gen = 0
    for g in range(args.generations + 1):
        reqs = [Req(f"g{gen}-{i}", list(range(P))) for i in range(B)]
        gen += 1
        for life in range(args.life):
            t0 = time.perf_counter()
            spin(work_n)
            t1 = time.perf_counter()
            if engine is not None:
                if life == 0:
                    batch = SimpleNamespace(reqs=reqs, forward_mode=Mode("EXTEND"),
                                            extend_lens=[P] * B)  # fmt: skip
                    fb, hs, acc = prefill_fb, prefill_hs, None
                else:
                    start = P + args.accept * (life - 1)  # the last token's position
                    batch = SimpleNamespace(reqs=reqs, forward_mode=Mode("DECODE"),
                                            extend_lens=None)  # fmt: skip
                    fb = SimpleNamespace(
                        input_ids=torch.ones((B + 1) * rows, dtype=torch.long),
                        positions=torch.arange(start, start + rows).repeat(B + 1),
                        forward_mode=Mode("TARGET_VERIFY"), batch_size=B + 1,
                        spec_info=verify_spec,
                    )  # fmt: skip
                    hs, acc = verify_hs, accept
                out = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hs))
                engine.on_batch(batch)
                engine.on_target_forward(fb, split_final(engine.target_runner, out))
                result = SimpleNamespace(accept_lens=acc)
                engine.end_batch(result)
            t2 = time.perf_counter()
            time.sleep(args.gpu_ms / 1e3)  # the GPU's part of the step, the lock released
            t3 = time.perf_counter()
            if engine is not None:
                for r in reqs:  # the tokens the step added (ids 1: the rows' ids above)
                    r.output_ids += [1] * (1 if life == 0 else args.accept)
                    r.done = life == args.life - 1
                engine.on_result(batch, result)
            t4 = time.perf_counter()
            if g:  # generation 0 warms up
                steps.append({"step": t4 - t0, "work": t1 - t0, "launch": t2 - t1,
                              "result": t4 - t3, "prefill": life == 0})  # fmt: skip
    stats = None
    if engine is not None:
        stats = {k: v for k, v in engine.stats(flush=True)["tap"].items()
                 if k.startswith(("requests_", "messages_", "steps_"))}  # fmt: skip
        engine.close()

    def ms(key: str, prefill: bool) -> float:
        return statistics.median(s[key] for s in steps if s["prefill"] == prefill) * 1e3

    return {
        "step_ms": ms("step", False), "work_ms": ms("work", False),
        "launch_hooks_ms": ms("launch", False), "result_hooks_ms": ms("result", False),
        "prefill_step_ms": ms("step", True),
        "mean_step_ms": statistics.mean(s["step"] for s in steps) * 1e3,
        "tap": stats,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench_sglang_hooks.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="drafts per verification (rows: k + 1)")
    p.add_argument("--accept", type=int, default=2, help="final rows of each verification")
    p.add_argument("--prompt", type=int, default=100, help="prompt tokens per request")
    p.add_argument("--life", type=int, default=30, help="steps a request lives")
    p.add_argument("--generations", type=int, default=8, help="timed generations of requests")
    p.add_argument("--host-ms", type=float, default=10.0, help="the scheduler's own work a step")
    p.add_argument("--gpu-ms", type=float, default=1.0, help="the wait for the GPU a step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default="none,process,thread")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    arms = args.arms.split(",")
    target = resolve_model("smollm2")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, endpoint])
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            draft = write_new_draft(work / "draft", target, version=0)
            taps = json.loads((draft / "codraft.json").read_text())["tap_layers"]
            per_ms = calibrate()
            for _ in range(args.repeats):
                for a in arms:
                    runs[a].append(run(args, a, per_ms, draft, taps, target, endpoint, work))
                    print(a, json.dumps({k: v for k, v in runs[a][-1].items() if k != "tap"}),
                          flush=True)  # fmt: skip
    finally:
        receiver.kill()
    keys = ("step_ms", "work_ms", "launch_hooks_ms", "result_hooks_ms", "prefill_step_ms",
            "mean_step_ms")  # fmt: skip
    med = {a: {k: statistics.median(r[k] for r in runs[a]) for k in keys} for a in arms}
    report = {
        "command": " ".join(
            ["python scripts/bench_sglang_hooks.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "geometry": {
            **{
                k: getattr(args, k)
                for k in ("batch", "k", "accept", "prompt", "life", "host_ms", "gpu_ms")
            },
            "tap_layers": taps,
        },
        "median": med,
        "added_ms_per_step": {
            a: med[a]["step_ms"] - med["none"]["step_ms"]
            for a in arms
            if a != "none" and "none" in med
        },
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
