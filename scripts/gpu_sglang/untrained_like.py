"""An untrained EAGLE-3 draft (version 0) with the vocabulary map of a trained one.

SGLang builds the token map it samples with from the draft it starts with, once, so a draft
swapped in must keep that map (codraft's SGLang engine refuses one that does not). A draft
trained elsewhere (the CPU demo's learner, which may pick its map from the tokens it saw) can
only be swapped into a server that started with its map: this writes that starting draft, its
other weights freshly initialised, for `engine_checks.py --draft OUT --trained SRC`.

    .venv/bin/python scripts/gpu_sglang/untrained_like.py runs/demo/learner/ckpt-N/draft \\
        runs/sgl-trained/draft-v0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from codraft.draft.checkpoint import DraftMeta, load_draft, save_draft
from codraft.draft.init import new_draft
from codraft.draft.model import Eagle3Draft
from codraft.models.config import TargetConfig


def untrained_like(src: Path, out: Path, target: Path) -> Path:
    trained, _ = load_draft(src)
    if not isinstance(trained, Eagle3Draft):
        raise ValueError(f"{src} is a {type(trained).__name__}; expected an EAGLE-3 draft (only "
                         "those carry a vocabulary map SGLang keeps)")  # fmt: skip
    cfg = trained.config
    model = new_draft(
        TargetConfig.from_pretrained(target),
        draft_vocab_size=cfg.draft_vocab_size,
        tap_layers=cfg.tap_layers,
        dtype=cfg.dtype,
    )
    model.set_vocab(trained.d2t.clone(), trained.t2d.clone())
    return save_draft(out, model, DraftMeta(version=0, counters={"step": 0}), overwrite=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="a trained codraft EAGLE-3 checkpoint")
    p.add_argument("out", type=Path)
    p.add_argument("--target", default="smollm2", help="the target: a folder or a known name")
    args = p.parse_args()
    from codraft.prepare import resolve_model

    out = untrained_like(args.src, args.out, Path(resolve_model(args.target)))
    print(json.dumps({"draft": str(out), "map_of": str(args.src)}))


if __name__ == "__main__":
    main()
