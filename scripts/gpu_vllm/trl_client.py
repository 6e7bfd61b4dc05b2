"""TRL's own vLLM client against `codraft serve --weight-transfer nccl` (docs/rl.md).

TRL (1.16, carried as wheels: trl, datasets, dill, multiprocess) talks to a `vllm serve` process
through `trl.generation.vllm_client.VLLMClient`: `/health`, `/v1/models`, `/server_info`,
`/get_world_size`, `/v1/completions`, then vLLM's NCCL weight-transfer protocol
(`init_communicator`: the trainer joins the engine's workers as rank 0 of an NCCL group;
`weight_update` + `update_named_params`: start, NCCL broadcast, finish). This script runs that
client unchanged against codraft serve (routes on the OpenAI port, no control token: TRL sends
none) and records each stage: what answered, what failed and with which error. When the NCCL
group forms (two GPUs: trainer on one, engine on the other), it runs --steps GRPO-shaped
steps: TRL generates greedy completions, pushes a perturbed policy, and the policy version and
outputs must move.

    PYTHONPATH=/tmp/site .gpu_venv/bin/python scripts/gpu_vllm/trl_client.py --out "$OUT"

Writes $OUT/trl_client.json. Exit status 0 when every stage ran.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # weight_sync, make_prompts


def _stage(report: dict, name: str, fn: Any, timeout: float = 300.0) -> Any:
    """Run one stage in a thread (NCCL cannot be interrupted): its result, or None with the
    error (or the hang) recorded."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (recorded, the report says what broke)
            box["error"] = f"{type(e).__name__}: {e}"
            box["trace"] = traceback.format_exc()[-3000:]

    t0 = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    entry: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 3)}
    if thread.is_alive():
        entry["error"] = f"no answer after {timeout:.0f} s (hung)"
    elif "error" in box:
        entry.update(error=box["error"], trace=box["trace"])
    report["stages"][name] = entry
    print(f"[trl] {name}: {entry.get('error', 'ok')} ({entry['seconds']} s)", flush=True)
    return box.get("value")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", default="runs/gpu_work/trl")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--gpu-memory", type=float, default=0.3)
    p.add_argument("--init-timeout", type=float, default=180.0)
    args = p.parse_args()
    import torch
    import trl
    from make_prompts import load_prompts
    from trl.generation.vllm_client import VLLMClient
    from weight_sync import _perturbed, _weights

    from codraft.prepare import resolve_model
    from codraft.server.serve import ServeProcess

    work, out = Path(args.work).resolve(), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model("smollm2")
    prompts = load_prompts()["heldout"][:8]
    report: dict[str, Any] = {
        "trl": trl.__version__, "gpus": torch.cuda.device_count(), "stages": {}, "steps": [],
    }  # fmt: skip
    argv = [
        "--model", str(model), "--dtype", "bfloat16", "--max-model-len", "2048",
        "--weight-transfer", "nccl", "--work-dir", str(work / "serve"),
        "--gpu-memory-utilization", str(args.gpu_memory), "--num-speculative-tokens", "3",
    ]  # fmt: skip
    server = ServeProcess.start(argv, work / "serve.log", control=False)
    try:
        server.wait_ready(timeout=900)
        client = _stage(report, "connect", lambda: VLLMClient(base_url=server.url))
        if client is None:
            raise SystemExit
        info = _stage(report, "server_info", client.get_server_info) or {}
        report["server_weight_transfer"] = info.get("weight_transfer_config")
        report["server_dtype"] = (info.get("model_config") or {}).get("dtype")
        report["world_size"] = _stage(report, "get_world_size", client.get_world_size)

        def generate() -> list[list[int]]:
            got = client.generate(prompts, temperature=0.0, max_tokens=48, logprobs=None)
            return got["completion_ids"]

        before = _stage(report, "generate", generate)
        # the trainer's side on this process's GPU; the engine's worker is rank 1
        torch.cuda.set_device(0)
        _stage(
            report, "init_communicator", lambda: client.init_communicator(device=0),
            timeout=args.init_timeout,
        )  # fmt: skip
        if "error" not in report["stages"]["init_communicator"]:
            base = _weights(model)
            for step in range(1, args.steps + 1):
                new = _perturbed(base, args.noise, seed=step)
                meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape))
                        for n, t in new.items()]  # fmt: skip

                def push(new: dict = new, meta: list = meta) -> None:
                    with client.weight_update():
                        client.update_named_params(meta, iter(new.items()))

                _stage(report, f"push_step_{step}", push)
                ready = httpx.get(f"{server.url}/ready", timeout=30).json()
                after = _stage(report, f"generate_step_{step}", generate)
                changed = sum(a != b for a, b in zip(before or [], after or [], strict=False))
                report["steps"].append(
                    {"step": step, "policy_version": ready.get("policy_version"),
                     "outputs_changed": changed}
                )  # fmt: skip
                before = after
            client.close_communicator()
    finally:
        server.stop()
        report["server_log_tail"] = server.log_tail(6000)
    stages = report["stages"]
    report["ok"] = all("error" not in s for s in stages.values()) and [
        s["policy_version"] for s in report["steps"]
    ] == list(range(1, args.steps + 1))
    (out / "trl_client.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "server_log_tail"}, indent=2)[-6000:])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
