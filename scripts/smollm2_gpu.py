"""SmolLM2-135M draft training on one GPU: more of SmolLM2's own answers, many more steps.

The CPU pipeline (scripts/smollm2_offline.py) is limited by CPU training time. This one runs
the same recipe where training is cheap, in two stages on two machines:

  prompts  (here, needs reasoning-gym)  write --train questions to a JSON file, drawn with a
           seed that differs from smollm2_offline.py's so the held-out prompts stay unseen
  gpu      (on the GPU host; needs torch, transformers, safetensors, msgpack and the GGUF, see
           codraft.prepare's $CODRAFT_SMOLLM2_GGUF) convert the model, answer every question
           greedily (fp32, transformers' generate), write the answers as ids-only tap files,
           then `codraft learn --from-dir ... --recompute` (the target recomputes features on
           the GPU) for each of --drafters (EAGLE-3, DFlash, DSpark: the same data, steps and
           tokens a step, so the same training-token budget; DSpark's blocks hold --k queries,
           the proposals vLLM serves it with) and copy each newest draft, in bf16, to
           --export/<drafter> (a weights file over --split-mib is cut into numbered pieces
           for the trip back: `cat model.safetensors.part* > model.safetensors`)

The draft is then judged on this machine on the held-out prompts of the CPU pipeline (the
offline estimate and vLLM with and without the draft):

    python scripts/smollm2_gpu.py prompts --out runs/smollm2_gpu/prompts.json
    python scripts/smollm2_gpu.py gpu --prompts prompts.json --work /tmp/w --export $OUT \
        --drafters eagle3,dflash
    python scripts/smollm2_offline.py --out runs/smollm2 --stage eval --draft DIR/eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def stage_prompts(args: argparse.Namespace) -> None:
    from codraft.prompts import reasoning_prompts

    prompts = reasoning_prompts(args.train, seed=args.seed)
    held = {p.question for p in reasoning_prompts(args.heldout_of, seed=0)}
    questions = [p.question for p in prompts if p.question not in held]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seed": args.seed, "questions": questions}))
    print(f"wrote {len(questions)} questions ({len(prompts) - len(questions)} overlapped) to {out}")


def chat_ids(tok, question: str) -> list[int]:
    """The prompt ids vLLM's chat endpoint builds: the template as text, then tokenized
    without special tokens."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def _generate(model_dir: Path, questions: list[str], args: argparse.Namespace):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(
        args.device
    )
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    prompts = [chat_ids(tok, q) for q in questions]
    pairs: list[tuple[list[int], list[int]]] = []
    for i in range(0, len(prompts), args.gen_batch):
        chunk = prompts[i : i + args.gen_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        ids, mask = ids.to(args.device), mask.to(args.device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.max_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        for p, row in zip(chunk, out[:, width:].tolist(), strict=True):
            answer = []
            for t in row:
                answer.append(t)
                if t in eos:
                    break
            pairs.append((p, answer))
        print(f"answered {len(pairs)}/{len(prompts)}", flush=True)
    return pairs


def stage_gpu(args: argparse.Namespace) -> None:
    from codraft.models.config import TargetConfig
    from codraft.prepare import prepare_smollm2
    from codraft.tap import TapMessage, TapWriter, model_fingerprint

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = prepare_smollm2(work / "SmolLM2-135M-Instruct").path
    questions = json.loads(Path(args.prompts).read_text())["questions"][: args.limit]
    cached = work / f"answers-{len(questions)}-{args.max_tokens}.json"
    if args.reuse_answers and cached.exists():  # a second call on the same machine
        pairs = [tuple(x) for x in json.loads(cached.read_text())]
    else:
        pairs = _generate(model_dir, questions, args)
        cached.write_text(json.dumps(pairs))
    t_gen = time.perf_counter() - t0
    cfg = TargetConfig.from_pretrained(model_dir)
    taps, fp = cfg.default_tap_layers(), model_fingerprint(cfg)
    data = work / "taps"
    shutil.rmtree(data, ignore_errors=True)
    with TapWriter(data) as w:
        for i, (p, a) in enumerate(pairs):
            w.write(
                TapMessage.build(
                    p + a,
                    tap_layers=taps,
                    prompt_len=len(p),
                    hidden_size=cfg.hidden_size,
                    request_id=f"gpu-{i}",
                    fingerprint=fp,
                )
            )
    answer_tokens = sum(len(a) for _, a in pairs)
    print(f"{len(pairs)} answers, {answer_tokens} answer tokens, in {t_gen:.0f} s", flush=True)
    export = Path(args.export)
    export.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "questions": len(questions), "answer_tokens": answer_tokens, "generate_s": t_gen,
        "steps": args.steps, "token_budget": args.token_budget, "lr": args.lr, "k": args.k,
        "draft_vocab": args.draft_vocab, "drafters": {},
    }  # fmt: skip
    steps = args.steps
    for drafter in args.drafters.split(","):
        got = _train(args, drafter, steps, data, model_dir, work, export)
        report["drafters"][drafter] = got
        if args.same_budget and got.get("step"):  # the next drafter: exactly as many steps
            steps = got["step"]
        (export / "smollm2_gpu_train.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def _train(
    args: argparse.Namespace,
    drafter: str,
    steps: int,
    data: Path,
    model_dir: Path,
    work: Path,
    export: Path,
) -> dict:
    """Train one drafter on the recorded answers; export its newest draft in bf16."""
    from codraft.draft.checkpoint import load_draft, read_meta, save_draft

    ckpt = work / f"ckpt-{drafter}"
    shutil.rmtree(ckpt, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "codraft.learner.cli",
        "--from-dir", str(data), "--target", str(model_dir), "--out", str(ckpt),
        "--steps", str(steps), "--k", str(args.k), "--lr", str(args.lr),
        "--token-budget", str(args.token_budget), "--draft-vocab", str(args.draft_vocab),
        "--save-every", str(args.save_every), "--recompute", "--device", args.device,
        "--drafter", drafter,
        *(["--block-size", str(args.k)] if drafter == "dspark" else []),
    ]  # fmt: skip
    t1 = time.perf_counter()
    try:
        subprocess.run(cmd, check=True, timeout=args.train_seconds)
    except subprocess.TimeoutExpired:
        print(f"{drafter}: training stopped by --train-seconds {args.train_seconds}", flush=True)
    except subprocess.CalledProcessError as e:
        print(f"{drafter}: training failed (exit {e.returncode})", flush=True)
    t_train = time.perf_counter() - t1
    latest = ckpt / "latest"
    if not latest.exists():
        return {"train_s": t_train, "checkpoint": None}
    step = latest.read_text().strip()
    model, meta = load_draft(ckpt / step / "draft")
    out = export / drafter
    shutil.rmtree(out, ignore_errors=True)
    save_draft(out, model, meta, dtype="bfloat16")  # a new sha256 for the bf16 weights
    weights = out / "model.safetensors"
    if weights.stat().st_size > args.split_mib << 20:
        data_bytes, piece = weights.read_bytes(), args.split_mib << 20
        for i in range(0, len(data_bytes), piece):
            (out / f"model.safetensors.part{i // piece}").write_bytes(data_bytes[i : i + piece])
        weights.unlink()
    return {
        "train_s": t_train,
        "checkpoint": step,
        "step": meta.counters.get("step"),
        "tokens_trained": read_meta(ckpt / step / "draft").counters.get("tokens"),
        "counters": meta.counters,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    a = sub.add_parser("prompts", help="write the training questions (needs reasoning-gym)")
    a.add_argument("--out", required=True)
    a.add_argument("--train", type=int, default=4000)
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--heldout-of", type=int, default=288, help="smollm2_offline's prompt count")
    g = sub.add_parser("gpu", help="answer, record, train on the GPU host")
    g.add_argument("--prompts", required=True)
    g.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp") + "/smollm2_gpu")
    g.add_argument("--export", required=True, help="folder for the newest draft of each drafter")
    g.add_argument("--drafters", default="eagle3", help="eagle3, dflash, dspark (comma)")
    g.add_argument("--split-mib", type=int, default=15, help="weights larger: cut in pieces")
    g.add_argument("--reuse-answers", action="store_true", help="answers of an earlier run")
    g.add_argument(
        "--same-budget", action="store_true",
        help="each later drafter trains exactly the steps the first one reached",
    )  # fmt: skip
    g.add_argument("--device", default="cuda", help="cpu for a smoke run")
    g.add_argument("--limit", type=int, default=None, help="use the first N questions only")
    g.add_argument("--max-tokens", type=int, default=192)
    g.add_argument("--gen-batch", type=int, default=512)
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--train-seconds", type=float, default=300)
    g.add_argument("--save-every", type=int, default=250)
    g.add_argument("--k", type=int, default=3)
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--token-budget", type=int, default=16384)
    g.add_argument("--draft-vocab", type=int, default=4096)
    args = p.parse_args()
    {"prompts": stage_prompts, "gpu": stage_gpu}[args.stage](args)


if __name__ == "__main__":
    main()
