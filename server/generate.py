"""`codraft generate`: speculative generation with vLLM on a real model and real prompts.

Runs the same greedy requests twice, without speculation and with an EAGLE-3 draft, each in its
own vLLM engine process, and reports tokens/s, the mean acceptance length, and whether the two
runs produced identical tokens (speculative decoding is lossless, so they must). Without
`--draft` it builds an untrained draft whose vocabulary is the most frequent tokens of the
baseline run; `codraft learn` (online) is what makes a draft good.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="'smollm2' or a model folder")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: untrained)")
    p.add_argument("--prompts", type=int, default=16, help="number of reasoning-gym prompts")
    p.add_argument("--dataset", default="gsm_symbolic", help="reasoning-gym dataset")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocab of a new draft")
    p.add_argument("--batch", type=int, default=16, help="max concurrent sequences")
    p.add_argument("--out", default="runs/generate", help="folder for results")


def main(args: argparse.Namespace) -> int:
    from codraft.prepare import resolve_model
    from codraft.prompts import reasoning_prompts
    from codraft.server.offline import ArmSpec, run_arm_subprocess

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_model(args.target)
    prompts = [p.question for p in reasoning_prompts(args.prompts, dataset=args.dataset)]
    common = dict(
        target=str(target),
        prompts=prompts,
        chat=True,
        max_tokens=args.max_tokens,
        max_num_seqs=args.batch,
    )
    print(f"target {target.name}: {len(prompts)} {args.dataset} prompts, greedy")
    print("[1/2] vLLM without speculation ...", flush=True)
    base = run_arm_subprocess(ArmSpec(**common), out / "arms")

    draft = Path(args.draft).resolve() if args.draft else None
    if draft is None:
        import torch

        from codraft.draft.init import write_new_draft
        from codraft.models.config import TargetConfig

        tcfg = TargetConfig.from_pretrained(target)
        vocab = tcfg.vocab_size
        counts = torch.zeros(vocab, dtype=torch.int64)
        for ids in base.token_ids:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab)
        draft = out / f"draft-untrained-{time.strftime('%Y%m%d-%H%M%S')}"
        write_new_draft(
            draft, target, counts, draft_vocab_size=min(args.draft_vocab, vocab), target_config=tcfg
        )
        print(f"      built an untrained EAGLE-3 draft at {draft}")
    print(f"[2/2] vLLM with EAGLE-3 draft {draft.name}, k={args.k} ...", flush=True)
    spec = run_arm_subprocess(
        ArmSpec(**common, draft=str(draft), num_speculative_tokens=args.k), out / "arms"
    )

    same = sum(a == b for a, b in zip(base.token_ids, spec.token_ids, strict=True))
    report = {
        "target": str(target),
        "draft": str(draft),
        "prompts": len(prompts),
        "k": args.k,
        "baseline_tokens_per_s": base.tokens_per_s,
        "spec_tokens_per_s": spec.tokens_per_s,
        "speedup": spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None,
        "acceptance_length": spec.acceptance_length,
        "accepted_per_position": spec.accepted_per_pos,
        "identical_outputs": same,
        "example": {"prompt": prompts[0], "output": spec.texts[0]},
    }
    (out / "generate.json").write_text(json.dumps(report, indent=2))
    print(f"  no speculation : {base.tokens_per_s:7.1f} tokens/s ({base.output_tokens} tokens)")
    print(
        f"  EAGLE-3 (k={args.k}) : {spec.tokens_per_s:7.1f} tokens/s, "
        f"acceptance length {spec.acceptance_length:.2f} tokens/step"
    )
    print(f"  identical greedy outputs: {same}/{len(prompts)}")
    print(f"  example: {prompts[0][:80]!r} -> {spec.texts[0][:120]!r}")
    print(f"  report: {out / 'generate.json'}")
    return 0 if same == len(prompts) else 1
