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

    PYTHONPATH=/tmp/trl_site .gpu_venv/bin/python scripts/gpu_vllm/trl_client.py --out "$OUT"

The trainer runs in a child process on GPU 1 when there are two (GPU 0 otherwise), killed when
it outlasts --trainer-timeout (NCCL's init cannot be interrupted). Writes $OUT/trl_client.json,
every stage with its time or its error. Exit status 0 when every stage ran.

Seen on one H200 (2026-12-04): connect, /server_info, /get_world_size and greedy generation
through TRL's client answer; `init_communicator` fails: the engine's NCCL init returns
"invalid usage" (trainer and engine worker would be two ranks of one communicator on one GPU,
which NCCL refuses), the server answered 500 (now a 409 naming the fix), and TRL's side waits
in its own NCCL init with no timeout. Two GPUs are what TRL's NCCL path needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # weight_sync, make_prompts
from stages import Stages  # noqa: E402 (after the path)


def trainer(args: argparse.Namespace) -> int:
    """TRL's client, unchanged, as a GRPO trainer drives it: connect, check the server,
    generate, join the NCCL group, then push a new policy each step."""
    import importlib

    import torch
    from make_prompts import load_prompts
    from weight_sync import _perturbed, _weights

    from codraft.prepare import resolve_model

    t = Stages({"steps": []}, "trl", Path(args.report))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    t.report["trainer_gpu"] = gpu
    trl = t.run("import_trl", lambda: importlib.import_module("trl.generation.vllm_client"))
    if trl is None:
        return 1
    t.report["trl"] = importlib.import_module("trl").__version__
    prompts = load_prompts()["heldout"][:8]
    client = t.run("connect", lambda: trl.VLLMClient(base_url=args.url))
    if client is None:
        return 1
    info = t.run("server_info", client.get_server_info) or {}
    t.report["server_weight_transfer"] = info.get("weight_transfer_config")
    t.report["server_dtype"] = (info.get("model_config") or {}).get("dtype")
    t.report["world_size"] = t.run("get_world_size", client.get_world_size)

    def generate() -> list[list[int]]:
        got = client.generate(prompts, temperature=0.0, max_tokens=48, logprobs=None)
        return got["completion_ids"]

    before = t.run("generate", generate)
    t.run("init_communicator", lambda: client.init_communicator(device=0))
    if "error" in t.report["stages"]["init_communicator"]:
        return 1
    base = _weights(resolve_model("smollm2"))
    for step in range(1, args.steps + 1):
        new = _perturbed(base, args.noise, seed=step)
        meta = [(n, str(w.dtype).removeprefix("torch."), list(w.shape)) for n, w in new.items()]

        def push(new: dict = new, meta: list = meta) -> None:
            with client.weight_update():
                client.update_named_params(meta, iter(new.items()))

        t.run(f"push_step_{step}", push)
        ready = httpx.get(f"{args.url}/ready", timeout=30).json()
        after = t.run(f"generate_step_{step}", generate)
        changed = sum(a != b for a, b in zip(before or [], after or [], strict=False))
        version = ready.get("policy_version")
        t.report["steps"].append({"step": step, "policy_version": version, "changed": changed})
        t.save()
        before = after
    client.close_communicator()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", default="runs/gpu_work/trl")
    p.add_argument("--out", help="trl_client.json here (the server side)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--gpu-memory", type=float, default=0.3)
    p.add_argument("--trainer-timeout", type=float, default=240.0, help="seconds for TRL's side")
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)  # the child
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        return trainer(args)
    if not args.out:
        p.error("--out is required")
    import torch

    from codraft.prepare import resolve_model
    from codraft.server.serve import ServeProcess

    work, out = Path(args.work).resolve(), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    model = resolve_model("smollm2")
    argv = [
        "--model", str(model), "--dtype", "bfloat16", "--max-model-len", "2048",
        "--weight-transfer", "nccl", "--work-dir", str(work / "serve"),
        "--gpu-memory-utilization", str(args.gpu_memory), "--num-speculative-tokens", "3",
    ]  # fmt: skip
    # the engine on GPU 0, the trainer on GPU 1 when there is one (NCCL wants a GPU a rank)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    server = ServeProcess.start(argv, work / "serve.log", control=False, env=env)
    path = work / "trainer.json"
    report: dict[str, Any] = {"gpus": gpus, "trainer_gpu_index": 1 if gpus > 1 else 0}
    try:
        server.wait_ready(timeout=900)
        child = [sys.executable, __file__, "--trainer", "--url", server.url, "--report",
                 str(path), "--steps", str(args.steps), "--noise", str(args.noise)]  # fmt: skip
        cenv = {**os.environ, "CUDA_VISIBLE_DEVICES": str(report["trainer_gpu_index"])}
        try:
            report["trainer_exit"] = subprocess.run(
                child, env=cenv, timeout=args.trainer_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            report["trainer_exit"] = f"killed after {args.trainer_timeout:.0f} s"
    finally:
        server.stop()
        report["server_log_tail"] = server.log_tail(6000)
    if path.is_file():
        report.update(json.loads(path.read_text()))
    if "next" in report:  # the stage the trainer was in when it was killed
        report["stages"][report.pop("next")] = {"error": f"hung: {report['trainer_exit']}"}
    stages = report.get("stages", {})
    report["ok"] = (
        bool(stages)
        and all("error" not in s for s in stages.values())
        and [s["policy_version"] for s in report.get("steps", [])] == list(range(1, args.steps + 1))
    )
    (out / "trl_client.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "server_log_tail"}, indent=2)[-6000:])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
