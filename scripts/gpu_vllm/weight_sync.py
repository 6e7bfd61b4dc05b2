"""vLLM's RL weight-sync protocol through `codraft serve` on one GPU (docs/rl.md).

A trainer (this process) and `codraft serve --weight-transfer ipc` share the GPU. The trainer
holds the served model's weights as CUDA tensors and pushes them through the protocol
(`/start_weight_update`, `/update_weights` with CUDA IPC handles as JSON, `/finish_weight_update`)
with `codraft.client.weight_sync`. Measured and checked, in one server:

1. policy push: a new policy (every decoder weight perturbed by --noise of its own std, seeded)
   pushed by IPC as policy v1: greedy outputs change, the policy version moves (responses, and
   the learner: `codraft learn` on the tap stream reports the newest policy of its data); the
   same weights then loaded from disk as v2 (written as a served folder, `POST /v1/policy`):
   greedy outputs identical to v1's (the IPC path moved exactly those weights). Time of each.
2. sleep: the held-out prompts before and after sleep level 1 + wake, and level 2 + wake of
   the weights, the policy pushed again (what RL trainers do after level 2), wake of the KV
   cache: acceptance (vLLM's counters) and outputs per phase; equal when the draft survived.
3. a draft push (`/start_draft_weight_update`): the serving draft's own weights pushed back as
   a new draft version, outputs unchanged, then a rollback.

    .gpu_venv/bin/python scripts/gpu_vllm/weight_sync.py --work runs/gpu_work/ws --out "$OUT" \\
        --draft runs/gpu_drafts/dflash       # a trained draft makes the sleep check meaningful
    .gpu_venv/bin/python scripts/gpu_vllm/weight_sync.py --target 8b-geometry --out "$OUT"

`--target 8b-geometry`: step 1 alone (timing), on a policy of Llama-3-8B's shape (32 layers,
hidden 4096, MLP 14336, 32/8 heads; SmolLM2's tokenizer and vocabulary, 7.4 B parameters,
bfloat16) with random weights, written here first: what an 8B trainer moves every step.

Writes $OUT/weight_sync.json (weight_sync_8b.json for the 8B geometry). Exit status 0 when
every check held.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_prompts, cotrain
from cotrain import _spawn, _stop  # noqa: E402 (after the path)


def _counters(metrics_text: str) -> tuple[float, float]:
    """vLLM's (drafts, accepted tokens) counters, summed over labels."""
    out = []
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
        vals = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)
        out.append(sum(float(v) for v in vals))
    return out[0], out[1]


class Stack:
    def __init__(self, args: argparse.Namespace, model: Path, work: Path) -> None:
        from codraft.server.serve import ServeProcess, free_port

        self.token = secrets.token_hex(16)
        (work / "token").write_text(self.token)
        self.tap = f"tcp://127.0.0.1:{free_port()}"
        argv = [
            "--model", str(model), "--dtype", "bfloat16", "--max-model-len", "2048",
            "--weight-transfer", "ipc", "--control-token-file", str(work / "token"),
            "--work-dir", str(work / "serve"), "--num-speculative-tokens", str(args.k),
            "--gpu-memory-utilization", str(args.gpu_memory), "--enable-sleep-mode",
            "--tap-endpoint", self.tap, *(["--draft", args.draft] if args.draft else []),
        ]  # fmt: skip
        self.server = ServeProcess.start(argv, work / "serve.log")
        self.server.wait_ready(timeout=900)
        self.model = str(model)
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.work = work
        self.drafter = "eagle3"
        if args.draft:
            from codraft.draft.checkpoint import config_from_hf

            hf = json.loads((Path(args.draft) / "config.json").read_text())
            self.drafter = config_from_hf(hf).kind
        self.learner: subprocess.Popen | None = None
        self.learner_port = 0

    def start_learner(self) -> None:
        """`codraft learn` on the tap stream, taking data in but never training or publishing
        (its buffer never fills): what it says of the newest policy is what the check reads."""
        from codraft.server.serve import free_port

        self.learner_port = free_port()
        argv = [
            "learn", "--server", self.server.control_url, "--tap", self.tap, "--target",
            self.model, "--out", str(self.work / "learner"), "--token-file",
            str(self.work / "token"), "--http-port", str(self.learner_port),
            "--min-buffer-tokens", str(10**9), "--publish-every", str(10**9),
            "--drafter", self.drafter,
        ]  # fmt: skip
        self.learner = _spawn(argv, self.work / "learner.log")

    def learner_policy(self, want: int, timeout: float = 120.0) -> float | None:
        """The learner's newest policy version once it reads `want` (or the last read)."""
        seen, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline and self.learner and self.learner.poll() is None:
            try:
                text = httpx.get(f"http://127.0.0.1:{self.learner_port}/metrics", timeout=5).text
                m = re.search(r"^codraft_learner_policy_version (\S+)$", text, re.M)
                seen = float(m.group(1)) if m else seen
                if seen == want:
                    return seen
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        return seen

    def stop_learner(self) -> None:
        _stop(self.learner)
        self.learner = None

    def auto_rollbacks(self) -> float | None:
        """codraft's count of automatic draft rollbacks (/metrics)."""
        text = httpx.get(f"{self.server.control_url}/metrics", timeout=60).text
        m = re.search(r"^codraft_draft_auto_rollbacks(?:_total)?(?:{[^}]*})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def control(self, method: str, path: str, **kw: Any) -> dict:
        r = httpx.request(method, self.server.control_url + path, headers=self.auth,
                          timeout=600, **kw)  # fmt: skip
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:2000]}")
        return r.json() if r.content else {}

    def generate(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        """Greedy completions of all prompts at once; token ids, the versions the responses
        name, and vLLM's acceptance over this batch."""
        import asyncio

        before = _counters(httpx.get(f"{self.server.control_url}/metrics", timeout=60).text)

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=600) as c:
                body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0,
                        "return_token_ids": True}  # fmt: skip
                return await asyncio.gather(*(
                    c.post(f"{self.server.url}/v1/completions", json={**body, "prompt": p})
                    for p in prompts
                ))  # fmt: skip

        t0 = time.perf_counter()
        responses = asyncio.run(run())
        seconds = time.perf_counter() - t0
        after = _counters(httpx.get(f"{self.server.control_url}/metrics", timeout=60).text)
        drafts, accepted = after[0] - before[0], after[1] - before[1]
        for r in responses:
            r.raise_for_status()
        return {
            "token_ids": [r.json()["choices"][0]["token_ids"] for r in responses],
            "policy_versions": sorted({r.headers["x-codraft-policy-version"] for r in responses}),
            "draft_versions": sorted({r.headers["x-codraft-draft-version"] for r in responses}),
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "seconds": seconds,
        }


def _weights(model: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for f in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(f), device="cuda"))
    return out


def _perturbed(weights: dict[str, Any], noise: float, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if w.dim() == 2 and ".layers." in name:  # decoder weights; embeddings and norms kept
            r = torch.randn(w.shape, generator=g, device="cuda", dtype=torch.float32)
            w = (w.float() + noise * w.float().std() * r).to(w.dtype)
        out[name] = w.contiguous()
    return out


GEOMETRY_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "tie_word_embeddings": False, "rope_parameters": {"rope_theta": 500000.0,
                                                      "rope_type": "default"},
    "dtype": "bfloat16", "torch_dtype": "bfloat16",
}  # fmt: skip


def write_8b_geometry(
    smollm2: Path, folder: Path, seed: int = 0, geometry: dict | None = None, device: str = "cuda"
) -> Path:
    """A Llama model folder of Llama-3-8B's shape with SmolLM2's tokenizer, random weights
    (std 0.02, norms 1) in bfloat16 shards of one layer group each."""
    import torch
    from safetensors.torch import save_file

    shutil.copytree(smollm2, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((folder / "config.json").read_text())
    config.update(geometry or GEOMETRY_8B)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> Any:
        return (0.02 * torch.randn(shape, generator=g, device=device)).to(torch.bfloat16).cpu()

    layers = config["num_hidden_layers"]
    shards = [{"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}]  # fmt: skip
    for i in range(layers):
        if i % 4 == 0:
            shards.append({})
        pre = f"model.layers.{i}."
        shards[-1].update({
            pre + "self_attn.q_proj.weight": rnd(h, h), pre + "self_attn.k_proj.weight": rnd(kv, h),
            pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.o_proj.weight": rnd(h, h),
            pre + "mlp.gate_proj.weight": rnd(f, h), pre + "mlp.up_proj.weight": rnd(f, h),
            pre + "mlp.down_proj.weight": rnd(h, f),
            pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })  # fmt: skip
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def push(sync: Any, weights: dict[str, Any], version: int, draft: bool = False,
         chunk: int = 64) -> float:  # fmt: skip
    from codraft.client.weight_sync import ipc_update_info

    items = list(weights.items())
    t0 = time.perf_counter()
    sync.start(draft=draft)
    for i in range(0, len(items), chunk):
        sync.update(ipc_update_info(items[i : i + chunk]))
    sync.finish(version=version)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", default="runs/gpu_work/weight_sync")
    p.add_argument("--out", required=True)
    p.add_argument("--target", choices=("smollm2", "8b-geometry"), default="smollm2")
    p.add_argument("--draft", default=None, help="a trained draft folder (default: untrained)")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--gpu-memory", type=float, default=0.3)
    p.add_argument("--no-learner", action="store_true", help="skip the learner's check")
    args = p.parse_args()
    from make_prompts import load_prompts

    from codraft.client.weight_sync import WeightSyncClient
    from codraft.prepare import resolve_model

    work, out = Path(args.work).resolve(), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    big = args.target == "8b-geometry"
    name = "weight_sync_8b.json" if big else "weight_sync.json"
    report: dict[str, Any] = {"target": args.target, "draft": args.draft, "checks": {}}
    model = resolve_model("smollm2")
    if big:
        t0 = time.perf_counter()
        model = write_8b_geometry(model, work / "policy-v0")
        report["write_8b_s"] = time.perf_counter() - t0
        import torch

        torch.cuda.empty_cache()
    prompts = load_prompts()["heldout"][: args.prompts]
    report.update(prompts=len(prompts), max_tokens=args.max_tokens)
    checks = report["checks"]
    stack = Stack(args, model, work)
    try:
        sync = WeightSyncClient(stack.server.control_url, token=stack.token)
        sync.init({})
        learner = not (big or args.no_learner)
        if learner:
            stack.start_learner()
        base = _weights(model)
        v0 = stack.generate(prompts, args.max_tokens)
        if learner:
            report["learner_policy_v0"] = stack.learner_policy(0)
        # 1. a new policy by IPC, then the same weights from disk
        new = _perturbed(base, args.noise, seed=1)
        del base
        ipc_s = push(sync, new, version=1)
        v1 = stack.generate(prompts, args.max_tokens)
        if learner:
            report["learner_policy_v1"] = stack.learner_policy(1)
        folder = work / "policy-v1"
        shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
        t0 = time.perf_counter()
        from safetensors.torch import save_file

        save_file({k: v.cpu() for k, v in new.items()}, str(folder / "model.safetensors"))
        write_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        stack.control("POST", "/v1/policy", json={"version": 2, "path": str(folder)})
        load_s = time.perf_counter() - t1
        v2 = stack.generate(prompts, args.max_tokens)
        if learner:
            report["learner_policy_v2"] = stack.learner_policy(2)
            stack.stop_learner()
        report["policy_push"] = {
            "tensors": len(new), "bytes": sum(t.numel() * t.element_size() for t in new.values()),
            "ipc_s": ipc_s, "disk_write_s": write_s, "disk_load_s": load_s,
            "disk_over_ipc": (write_s + load_s) / ipc_s,
            "outputs_changed": sum(
                a != b for a, b in zip(v0["token_ids"], v1["token_ids"], strict=True)
            ),
            "acceptance": {"v0": v0["acceptance_length"], "v1": v1["acceptance_length"],
                           "v2": v2["acceptance_length"]},
        }  # fmt: skip
        checks["policy_version_moves"] = (v1["policy_versions"], v2["policy_versions"]) == (
            ["1"], ["2"],
        )  # fmt: skip
        checks["outputs_change_with_the_policy"] = report["policy_push"]["outputs_changed"] > 0
        checks["ipc_and_disk_give_the_same_outputs"] = v1["token_ids"] == v2["token_ids"]
        if learner:
            checks["the_learner_sees_each_policy"] = [
                report[f"learner_policy_v{i}"] for i in range(3)
            ] == [0, 1, 2]
        if not big:
            sleep_and_draft(stack, sync, args, prompts, new, report)
        sync.close()
    except Exception as err:  # what ran is still reported (a later phase may take the engine down)
        report["error"] = f"{type(err).__name__}: {err}"
        checks["ran_to_the_end"] = False
    finally:
        stack.stop_learner()
        stack.server.stop()
        report["server_log_tail"] = stack.server.log_tail(4000)
        if (work / "serve.log").is_file():  # the whole log beside the report
            shutil.copy(work / "serve.log", out / f"{Path(name).stem}_server.log")
        if (work / "learner.log").is_file():
            report["learner_log_tail"] = (work / "learner.log").read_text()[-2000:]
    report["ok"] = all(checks.values())
    (out / name).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("log_tail")}, indent=2))
    return 0 if report["ok"] else 1


def sleep_and_draft(
    stack: Stack, sync: Any, args: argparse.Namespace, prompts: list[str], new: dict,
    report: dict,
) -> None:  # fmt: skip
    """2. sleep level 1, then level 2 with the policy pushed back; 3. a draft push, rollback."""
    checks = report["checks"]
    phases = {"before": stack.generate(prompts, args.max_tokens)}
    digests = {"before": stack.control("GET", "/v1/draft/digest")["tensors"]}
    stack.control("POST", "/sleep", params={"level": 1})
    stack.control("POST", "/wake_up")
    digests["after_level_1"] = stack.control("GET", "/v1/draft/digest")["tensors"]
    phases["after_level_1"] = stack.generate(prompts, args.max_tokens)
    stack.control("POST", "/sleep", params={"level": 2})
    stack.control("POST", "/wake_up", params={"tags": "weights"})
    push(sync, new, version=3)  # level 2 discarded the weights: the trainer sends them
    stack.control("POST", "/wake_up", params={"tags": "kv_cache"})
    digests["after_level_2"] = stack.control("GET", "/v1/draft/digest")["tensors"]
    phases["after_level_2"] = stack.generate(prompts, args.max_tokens)
    report["sleep"] = {k: {"acceptance_length": v["acceptance_length"],
                           "draft_versions": v["draft_versions"], "seconds": v["seconds"]}
                       for k, v in phases.items()}  # fmt: skip
    ref = phases["before"]
    for name in ("after_level_1", "after_level_2"):
        checks[f"{name}_same_outputs"] = phases[name]["token_ids"] == ref["token_ids"]
        checks[f"{name}_same_acceptance"] = (
            phases[name]["acceptance_length"] == ref["acceptance_length"]
        )
        checks[f"{name}_same_draft"] = phases[name]["draft_versions"] == ref["draft_versions"]
        # what the draft reads, by checksum: its own tensors must come back exactly
        changed = changed_tensors(digests["before"], digests[name])
        report["sleep"][name]["tensors_changed"] = changed
        checks[f"{name}_same_draft_tensors"] = not changed["drafter"]
    # 3. the serving draft pushed back as a new draft version, then rolled back
    if not args.draft:
        return
    from safetensors.torch import load_file

    draft_before = stack.control("GET", "/v1/draft")
    dw = {k: v.cuda() for k, v in load_file(str(Path(args.draft) / "model.safetensors")).items()}
    new_version = draft_before["highest_version"] + 1
    report["draft_push_s"] = push(sync, dw, version=new_version, draft=True)
    after = stack.generate(prompts, args.max_tokens)
    now = stack.control("GET", "/v1/draft")
    report["draft_push"] = {
        "acceptance_length": after["acceptance_length"],
        "draft_versions": after["draft_versions"],
        "serving_after": now["version"],
        "auto_rollbacks": stack.auto_rollbacks(),
        "tensors_changed": changed_tensors(
            digests["before"], stack.control("GET", "/v1/draft/digest")["tensors"]
        ),
    }
    checks["draft_push_keeps_outputs"] = after["token_ids"] == ref["token_ids"]
    checks["draft_push_keeps_acceptance"] = after["acceptance_length"] == ref["acceptance_length"]
    checks["draft_version_moves"] = after["draft_versions"] == [str(new_version)]
    if now["version"] != new_version:  # (an automatic rollback already used the one level)
        checks["draft_push_kept"] = False
        return
    back = stack.control("POST", "/v1/draft/rollback", json={"reason": "check"})
    checks["rollback_to_the_draft_before"] = back["version"] == draft_before["version"]
    rolled = stack.generate(prompts, args.max_tokens)
    report["draft_push"]["acceptance_after_rollback"] = rolled["acceptance_length"]
    checks["rollback_keeps_outputs"] = rolled["token_ids"] == ref["token_ids"]


def changed_tensors(before: dict, after: dict) -> dict[str, list[str]]:
    """Names whose digest differs (or that appeared or went), the drafter's apart from the
    proposer's (whose runtime buffers change with every step)."""
    names = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    return {
        "drafter": [n for n in names if n.startswith("drafter.")],
        "proposer": [n for n in names if not n.startswith("drafter.")],
    }


if __name__ == "__main__":
    raise SystemExit(main())
