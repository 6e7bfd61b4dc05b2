"""Write the prompts of the GPU serving run (scripts/gpu_vllm/prompts.json.gz), here.

The GPU machine has no reasoning-gym, so the questions travel with the repository: `train` (the
load `codraft serve` gets while the learner co-trains, cycled) and `heldout` (the benchmark's
requests, never served during co-training), GSM8K-style `gsm_symbolic` questions drawn with
seeds other than the CPU pipelines' (scripts/smollm2_offline.py uses seed 0). Deterministic:
the same file comes out every time (gzip without a timestamp).

    .venv/bin/python scripts/gpu_vllm/make_prompts.py
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "prompts.json.gz"


def load_prompts(path: Path = DEFAULT) -> dict:
    """{"train": [...], "heldout": [...], ...} from a .json or .json.gz file."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    data = json.loads(raw)
    if isinstance(data, list):  # a plain list of questions: all of them for both uses
        data = {"train": data, "heldout": data}
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT))
    p.add_argument("--train", type=int, default=1600)
    p.add_argument("--heldout", type=int, default=64)
    p.add_argument("--train-seed", type=int, default=7)
    p.add_argument("--heldout-seed", type=int, default=8)
    args = p.parse_args()
    from codraft.prompts import reasoning_prompts

    held = [q.question for q in reasoning_prompts(args.heldout, seed=args.heldout_seed)]
    seen = set(held)
    train = [
        q
        for q in dict.fromkeys(
            x.question for x in reasoning_prompts(args.train, seed=args.train_seed)
        )
        if q not in seen
    ]
    data = {
        "source": "reasoning-gym gsm_symbolic",
        "train_seed": args.train_seed,
        "heldout_seed": args.heldout_seed,
        "train": train,
        "heldout": held,
    }
    blob = gzip.compress(json.dumps(data).encode(), 9, mtime=0)
    Path(args.out).write_bytes(blob)
    print(f"{args.out}: {len(train)} train + {len(held)} held-out questions, {len(blob)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
