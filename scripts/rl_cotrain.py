"""The RL experiment in miniature: GRPO on a small policy, rollouts through the server, three arms.

Each arm runs the same GRPO loop (same seeds, prompts and settings) on reasoning-gym prompts:
G sampled replies per prompt through the official `openai` client (n = G, logprobs=True), a
format + correctness reward, one AdamW step on CPU, the new weights written as safetensors in
the served layout and pushed to the running server as policy version step + 1.

  nospec   plain vLLM, no speculation (codraft serve always runs a draft)
  frozen   codraft serve with a fixed EAGLE-3 draft trained on the initial policy
  cotrain  codraft serve with that draft + `codraft learn --server` training it online

Per step (one JSON file per arm, rewritten after every step): reward, acceptance length (the
server's per-draft-version counters), rollout wall time, update and push time, learner lag,
the lossless checks (greedy probes = the policy's argmax; served log-probs = recomputed ones;
at temperature 1, a z test that the server samples from the policy at all). At the end:
summary.json and a PNG across the arms.

--save-policies keeps every pushed policy; --replay DIR pushes those policies instead of training,
so that every arm serves one and the same policy sequence (docs/rl.md: on vLLM-CPU speculative
sampling is not exact, and the replay with greedy rollouts is the comparison that is).

    python scripts/rl_cotrain.py --out runs/rl --steps 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from codraft.experiments.rl.grpo import GRPOConfig, group_advantages
from codraft.experiments.rl.lossless import check_greedy, check_logprobs, check_sampling
from codraft.experiments.rl.plot import plot_arms
from codraft.experiments.rl.policy import Policy, PolicyConfig, Rollout
from codraft.experiments.rl.reward import INSTRUCTION, RewardConfig, score
from codraft.experiments.rl.rollout import SamplingConfig, greedy, sample_groups
from codraft.experiments.rl.servers import (
    ArmServer,
    CodraftArm,
    EngineFlags,
    LearnerFlags,
    PlainArm,
)
from codraft.prepare import resolve_model
from codraft.prompts import reasoning_prompts

ARMS = ("nospec", "frozen", "cotrain")


@dataclass
class RLConfig:
    model: str = "smollm2"  # 'smollm2' (prepared offline) or a model folder
    frozen_draft: str | None = None  # EAGLE-3 draft of the initial policy; None: look in runs/
    out: str = "runs/rl"
    arms: str = ",".join(ARMS)
    steps: int = 8
    prompts_per_step: int = 4
    group_size: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    # per-request sampling seeds: vLLM-CPU 0.32's seeded sampling crashes the engine under
    # speculative decoding ("CPU Generator does not use offset"), so off by default
    request_seeds: bool = False
    probes: int = 4
    probe_max_tokens: int = 48
    dataset: str = "gsm_symbolic"
    seed: int = 0
    lr: float = 2e-5
    train_layers: int | None = None  # None: full fine-tune
    micro_batch: int = 4
    k: int = 3  # speculative tokens
    max_model_len: int = 1024
    max_num_seqs: int = 32
    learner_lr: float = 1e-3
    publish_every: int = 5
    token_budget: int = 1024
    min_buffer_tokens: int = 512
    learner_threads: int = 1
    logprob_tol: float = 1e-2  # mean |served - recomputed| log-prob
    tie_tol: float = 1e-3  # logit gap counted as a near-tie in the greedy check
    save_policies: bool = False  # keep every pushed policy under <out>/<arm>/policies
    # replay: push the policies of an earlier run (its <arm>/policies folder) instead of
    # training; every arm then serves the same policy sequence (see docs/rl.md)
    replay: str | None = None
    concurrent_arms: bool = False  # run the arms side by side (smoke tests; skews timings)


def _dumps(obj: object, indent: int) -> str:
    """JSON with paths under the working directory written relative to it, so records can be
    kept and compared across machines."""
    return json.dumps(obj, indent=indent).replace(json.dumps(str(Path.cwd()) + "/")[1:-1], "")


def find_frozen_draft(given: str | None) -> Path:
    if given:
        return Path(given).resolve()
    root = Path("runs")
    candidates = [root / "smollm2" / "draft", *sorted(root.glob("*/draft"))]
    latest = root / "smollm2" / "ckpt" / "latest"
    if latest.is_file():
        candidates.append(latest.parent / latest.read_text().strip() / "draft")
    for c in candidates:
        if (c / "codraft.json").is_file():
            return c.resolve()
    raise SystemExit(
        "no frozen draft: pass --frozen-draft DIR, or train one on the initial policy first:\n"
        "  python scripts/smollm2_offline.py --out runs/smollm2 --stage all"
    )


def make_server(arm: str, cfg: RLConfig, model: Path, draft: Path, work: Path) -> ArmServer:
    flags = EngineFlags("float32", cfg.max_model_len, cfg.max_num_seqs, cfg.k)
    if arm == "nospec":
        return PlainArm(model, work, flags).start()
    learner = None
    if arm == "cotrain":
        learner = LearnerFlags(
            cfg.learner_lr, cfg.publish_every, cfg.token_budget, cfg.min_buffer_tokens,
            cfg.learner_threads,
        )  # fmt: skip
    return CodraftArm(model, work, flags, draft, learner).start()


class DraftLag:
    """Policy version in force when each draft version was first seen serving."""

    def __init__(self) -> None:
        self.first_seen: dict[int, int] = {}

    def see(self, draft: dict | None, policy_version: int) -> None:
        if draft and draft.get("version") is not None:
            self.first_seen.setdefault(int(draft["version"]), policy_version)

    def lag(self, draft: dict | None, policy_version: int) -> int | None:
        if not draft or draft.get("version") is None:
            return None
        return policy_version - self.first_seen.get(int(draft["version"]), policy_version)


def probe(server: ArmServer, policy: Policy, questions: list[str], cfg: RLConfig) -> dict:
    before = server.counters()
    replies, wall = greedy(server.url, questions, cfg.probe_max_tokens)
    delta = server.counters().minus(before)
    check = check_greedy(policy, [(r.prompt_ids, r.token_ids) for r in replies], cfg.tie_tol)
    return {
        "token_ids": [r.token_ids for r in replies],
        "seconds": wall,
        "acceptance_length": delta.acceptance_length(),
        "greedy_check": check.to_json(),
    }


def run_arm(arm: str, cfg: RLConfig, model: Path, draft: Path, out: Path) -> list[dict]:
    work = out / arm
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    torch.manual_seed(cfg.seed)
    prompts = reasoning_prompts(
        cfg.prompts_per_step * cfg.steps, dataset=cfg.dataset, seed=cfg.seed
    )
    probes = [p.question + INSTRUCTION for p in reasoning_prompts(cfg.probes, seed=cfg.seed + 1)]
    import reasoning_gym

    scorer = reasoning_gym.create_dataset(cfg.dataset, size=1, seed=0)
    sampling = SamplingConfig(cfg.group_size, cfg.max_tokens, cfg.temperature)
    policy = Policy(
        model, PolicyConfig(lr=cfg.lr, train_layers=cfg.train_layers, micro_batch=cfg.micro_batch,
                            grpo=GRPOConfig()),
    )  # fmt: skip
    reward_cfg = RewardConfig()
    t_start = time.perf_counter()
    server = make_server(arm, cfg, model, draft, work)
    steps: list[dict] = []
    record: dict[str, Any] = {"arm": arm, "config": asdict(cfg), "draft": str(draft),
                              "trainable_params": policy.trainable, "steps": steps}  # fmt: skip
    lag = DraftLag()
    replay = Path(cfg.replay).resolve() if cfg.replay else None
    loaded = [model]
    try:
        record["server_start_s"] = server.wait_ready()
        if isinstance(server, CodraftArm):
            server.start_learner()
        print(f"[{arm}] ready in {record['server_start_s']:.0f}s", flush=True)
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            lag.see(server.draft(), step)
            pr = probe(server, policy, probes, cfg)
            batch = prompts[step * cfg.prompts_per_step : (step + 1) * cfg.prompts_per_step]
            before = server.counters()
            groups, rollout_s = sample_groups(
                server.url, [p.question + INSTRUCTION for p in batch], sampling,
                seed=cfg.seed * 1_000_003 + step * 1000 if cfg.request_seeds else None,
            )  # fmt: skip
            spec = server.counters().minus(before)
            draft_after = server.draft()
            lag.see(draft_after, step)
            rewards, rollouts, flat = [], [], []
            for p, group in zip(batch, groups, strict=True):
                rs = [
                    score(c.text, {"answer": p.answer}, scorer, c.finish_reason == "length",
                          reward_cfg)
                    for c in group
                ]  # fmt: skip
                rewards.append([r.total for r in rs])
                flat += list(zip(group, rs, strict=True))
            adv = group_advantages(torch.tensor(rewards), GRPOConfig().eps)
            for (c, _), a in zip(flat, adv.flatten().tolist(), strict=True):
                rollouts.append(Rollout(c.prompt_ids, c.token_ids, c.logprobs, a))
            upd = policy.step(rollouts, update=replay is None)
            lp = check_logprobs([r.logprobs for r in rollouts], upd.recomputed, cfg.logprob_tol)
            # the z test holds for the policy's own distribution only (temperature 1)
            dist = check_sampling(upd.recomputed, upd.entropies) if cfg.temperature == 1 else None
            lag.see(server.draft(), step)  # drafts published while the policy trained
            t_push = time.perf_counter()
            if replay is None:
                path = policy.save(work / "policies" / f"v{step + 1}")
            else:
                path = replay / f"v{step + 1}"
                policy.load(path)
            save_s = time.perf_counter() - t_push
            server.load_policy(step + 1, path)
            push_s = time.perf_counter() - t_push - save_s
            loaded.append(path)
            for old in loaded[:-1]:
                if old != model and replay is None and not cfg.save_policies:
                    shutil.rmtree(old, ignore_errors=True)
            gen_tokens = sum(len(c.token_ids) for c, _ in flat)
            s = {
                "step": step,
                "policy_version": step,
                "reward_mean": float(torch.tensor(rewards).mean()),
                "format_rate": sum(r.format > 0 for _, r in flat) / len(flat),
                "format_full_rate": sum(r.format >= reward_cfg.format_full for _, r in flat)
                / len(flat),
                "correct_rate": sum(r.correct >= 1.0 for _, r in flat) / len(flat),
                "truncated_rate": sum(c.finish_reason == "length" for c, _ in flat) / len(flat),
                "mean_reply_tokens": gen_tokens / len(flat),
                "generated_tokens": gen_tokens,
                "rollout_s": rollout_s,
                "rollout_tokens_per_s": gen_tokens / rollout_s,
                "acceptance_length": spec.acceptance_length(),
                "acceptance_by_version": {str(v): a for v, a in spec.by_version().items()},
                "response_draft_versions": sorted({c.draft_version for c, _ in flat
                                                   if c.draft_version is not None}),
                "serving_draft": draft_after,
                "learner_lag": lag.lag(draft_after, step),
                "learner_alive": getattr(server, "learner_alive", lambda: None)(),
                "update_s": upd.seconds,
                "loss": upd.loss,
                "grad_norm": upd.grad_norm,
                "clip_frac": upd.clip_frac,
                "save_s": save_s,
                "push_s": push_s,
                "logprob_check": lp.to_json(),
                "sampling_check": dist.to_json() if dist else None,
                "probe": pr,
                "step_s": time.perf_counter() - t0,
                "loadavg_1m": os.getloadavg()[0],  # the CPU is shared: context for timings
                "sample_text": flat[0][0].text[:300],
            }  # fmt: skip
            steps.append(s)
            acc = s["acceptance_length"]
            print(
                f"[{arm}] step {step}: reward {s['reward_mean']:.3f} format "
                f"{s['format_rate']:.2f} accept {acc if acc is None else round(acc, 3)} "
                f"rollout {rollout_s:.1f}s ({s['rollout_tokens_per_s']:.0f} tok/s) update "
                f"{upd.seconds:.1f}s lag {s['learner_lag']} logprob |d| {lp.mean_abs:.2e} "
                f"greedy mismatches {pr['greedy_check']['mismatches']} sampling z "
                f"{f'{dist.mean_z:.3f}+-{dist.std_err:.3f}' if dist else '-'}",
                flush=True,
            )
            (out / f"{arm}.json").write_text(_dumps(record, indent=1))
        record["final_probe"] = probe(server, policy, probes, cfg)
        record["final_draft"] = server.draft()
    finally:
        server.stop()
        record["wall_s"] = time.perf_counter() - t_start
        (out / f"{arm}.json").write_text(_dumps(record, indent=1))
        if not cfg.save_policies:
            shutil.rmtree(work / "policies", ignore_errors=True)
    return steps


def summarize(out: Path, arms: list[str]) -> dict:
    runs = {
        a: json.loads((out / f"{a}.json").read_text())
        for a in arms
        if (out / f"{a}.json").is_file()
    }
    summary: dict[str, Any] = {"arms": {}}
    for a, r in runs.items():
        st = r["steps"]
        acc = [s["acceptance_length"] for s in st if s["acceptance_length"] is not None]
        greedy_acc = [s["probe"]["acceptance_length"] for s in st]
        if "final_probe" in r:
            greedy_acc.append(r["final_probe"]["acceptance_length"])
        greedy_acc = [a for a in greedy_acc if a is not None]
        tokens = sum(s["generated_tokens"] for s in st)
        seconds = sum(s["rollout_s"] for s in st)
        final = [r["final_probe"]["greedy_check"]] if "final_probe" in r else []
        checks = [s["probe"]["greedy_check"] for s in st] + final
        summary["arms"][a] = {
            "steps": len(st),
            "finished": "final_probe" in r,
            "acceptance_first": acc[0] if acc else None,
            "acceptance_last": acc[-1] if acc else None,
            "acceptance_best": max(acc) if acc else None,
            "acceptance_mean": sum(acc) / len(acc) if acc else None,
            "probe_acceptance": [round(a, 3) for a in greedy_acc],
            "rollout_s_total": seconds,
            "rollout_tokens_per_s": tokens / seconds if seconds else None,
            "reward_first": st[0]["reward_mean"],
            "reward_last": st[-1]["reward_mean"],
            "update_s_mean": sum(s["update_s"] for s in st) / len(st),
            "step_s_mean": sum(s["step_s"] for s in st) / len(st),
            "max_learner_lag": max((s["learner_lag"] or 0) for s in st),
            "greedy_mismatches": sum(c["mismatches"] for c in checks),
            "greedy_tokens": sum(c["tokens"] for c in checks),
            "logprob_mean_abs_max": max(s["logprob_check"]["mean_abs"] for s in st),
            "logprob_max_abs": max(s["logprob_check"]["max_abs"] for s in st),
            "logprob_within_tol": all(s["logprob_check"]["within_tol"] for s in st),
            "sampling_z": [
                round(s["sampling_check"]["mean_z"], 3) for s in st if s.get("sampling_check")
            ],
            "sampling_exact_steps": sum(
                bool((s.get("sampling_check") or {}).get("exact")) for s in st
            ),
        }
    if len(runs) > 1:
        first = {a: r["steps"][0]["probe"]["token_ids"] for a, r in runs.items()}
        ref = next(iter(first.values()))
        summary["step0_probes_identical_across_arms"] = all(v == ref for v in first.values())
    arms_s = summary["arms"]
    if "nospec" in arms_s:
        base = arms_s["nospec"]["rollout_tokens_per_s"]
        for a in arms_s:
            if base and arms_s[a]["rollout_tokens_per_s"]:
                arms_s[a]["speedup_vs_nospec"] = arms_s[a]["rollout_tokens_per_s"] / base
    for a in ("frozen", "cotrain"):
        if a in arms_s and arms_s[a]["acceptance_best"]:
            s = arms_s[a]
            s["last_within_10pct_of_best"] = s["acceptance_last"] >= 0.9 * s["acceptance_best"]
            s["fell"] = s["acceptance_last"] < s["acceptance_first"]
    (out / "summary.json").write_text(_dumps(summary, indent=2))
    plot_arms({a: r["steps"] for a, r in runs.items()}, out / "rl_cotrain.png",
              f"GRPO on {Path(next(iter(runs.values()))['config']['model']).name}: "
              "acceptance, rollout time, reward per RL step")  # fmt: skip
    return summary


def parse_args(argv: list[str] | None = None) -> RLConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(RLConfig):
        default = f.default
        if isinstance(default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true")
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0].strip(), str)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default)
    return RLConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    out = Path(cfg.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(cfg.model)
    arms = [a for a in cfg.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    draft = find_frozen_draft(cfg.frozen_draft) if set(arms) - {"nospec"} else Path()
    print(f"model {model}, frozen draft {draft}, arms {arms}", flush=True)
    if cfg.concurrent_arms:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(arms)) as pool:
            for f in [pool.submit(run_arm, a, cfg, model, draft, out) for a in arms]:
                f.result()
    else:
        for arm in arms:
            run_arm(arm, cfg, model, draft, out)
    summary = summarize(out, arms)
    print(json.dumps(summary, indent=2))
    print(f"per-step JSON: {out}/<arm>.json; plot: {out / 'rl_cotrain.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
