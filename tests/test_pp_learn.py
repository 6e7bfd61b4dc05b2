"""Recompute-mode training under torchrun with PP = 2 (`python -m codraft.learner.cli --pp 2`, what
`codraft learn --pp 2` runs: codraft.learner.pipeline_trainer): from ids-only tap files, with a
resume in the middle, the losses and the final draft equal single-device `codraft learn --recompute`
on the same data."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from codraft.learner.checkpoints import CheckpointDir
from codraft.models.config import TargetConfig
from codraft.tap import TapMessage, TapWriter, model_fingerprint

COMMON = ["--token-budget", "128", "--draft-vocab", "64", "--save-every", "2", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def ids_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ids-only tap messages (what a server streams when the learner recomputes features)."""
    cfg = TargetConfig.from_pretrained(tiny_llama_dir)
    out = tmp_path_factory.mktemp("ids")
    g = torch.Generator().manual_seed(0)
    with TapWriter(out) as w:
        for i in range(16):
            ids = torch.randint(3, cfg.vocab_size, (int(torch.randint(12, 40, (), generator=g)),))
            w.write(
                TapMessage.build(
                    ids.to(torch.int32),
                    tap_layers=cfg.default_tap_layers(),
                    hidden_size=cfg.hidden_size,
                    prompt_len=4,
                    request_id=f"r{i}",
                    fingerprint=model_fingerprint(cfg),
                )  # fmt: skip
            )
    return out


def _torchrun(target: Path, data: Path, out: Path, steps: int) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "codraft.learner.cli", "--from-dir", str(data), "--target", str(target),
        "--out", str(out), "--pp", "2", "--microbatches", "3", "--steps", str(steps),
        "--device", "cpu", *COMMON,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _single(target: Path, data: Path, out: Path, steps: int) -> None:
    from codraft.learner.cli import add_arguments, offline_config_from_args
    from codraft.learner.offline import train_from_dir

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--from-dir", str(data), "--target", str(target), "--out", str(out), "--steps"]
    args = p.parse_args([*argv, str(steps), "--recompute", "--device", "cpu", *COMMON])
    train_from_dir(offline_config_from_args(args))


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_pp2_training_with_resume_equals_single_device(
    tiny_llama_dir: Path, ids_dir: Path, tmp_path: Path
) -> None:
    pp_out, one_out = tmp_path / "pp", tmp_path / "one"
    _torchrun(tiny_llama_dir, ids_dir, pp_out, steps=3)
    _torchrun(tiny_llama_dir, ids_dir, pp_out, steps=5)  # resumes from step 3
    _single(tiny_llama_dir, ids_dir, one_out, steps=5)
    pp, one = _rows(pp_out), _rows(one_out)
    assert [r["step"] for r in pp] == [1, 2, 3, 4, 5] == [r["step"] for r in one]
    for a, b in zip(pp, one, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert a["acc"] == b["acc"] and a["lr"] == b["lr"]
    w_pp = load_file(str(CheckpointDir(pp_out).latest() / "draft" / "model.safetensors"))
    w_one = load_file(str(CheckpointDir(one_out).latest() / "draft" / "model.safetensors"))
    assert w_pp.keys() == w_one.keys()
    for name, t in w_one.items():
        diff = float((w_pp[name].double() - t.double()).abs().max())
        assert diff <= 1e-5, f"{name} differs by {diff:.3g}"
