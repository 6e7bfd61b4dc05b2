"""The trainer, `codraft learn --from-dir`, checkpoint resume, and the acceptance estimator.

Runs on a tiny random Llama with tap files written from codraft's own TargetModel (the same
features the server captures: taps before the final norm, the last hidden state after it)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from codraft.draft.checkpoint import check_draft, load_draft
from codraft.learner.acceptance import AcceptanceReport, estimate_acceptance, walk
from codraft.learner.data import Sample, pack
from codraft.learner.offline import OfflineConfig, train_from_dir
from codraft.learner.parallel.launch import ParallelConfig
from codraft.learner.teacher import Teacher, load_embedding
from codraft.learner.trainer import TrainConfig, Trainer, lr_at
from codraft.models.config import TargetConfig
from codraft.models.llama import load_target
from codraft.tap import TapMessage, TapWriter, model_fingerprint, read_taps
from codraft.testing import make_agreeing_draft, make_constant_target


def _write_taps(target: Path, out: Path, n: int = 12, seed: int = 0) -> Path:
    model = load_target(target)
    cfg = TargetConfig.from_pretrained(target)
    taps = cfg.default_tap_layers()
    g = torch.Generator().manual_seed(seed)
    with TapWriter(out) as w:
        for i in range(n):
            length = int(torch.randint(12, 40, (), generator=g))
            ids = torch.randint(3, cfg.vocab_size, (length,), generator=g)
            with torch.no_grad():
                o = model(ids[None], tap_layers=taps, return_logits=False)
            w.write(
                TapMessage.build(
                    ids.to(torch.int32),
                    taps=o.taps[0].contiguous(),
                    last_hidden=o.last_hidden[0].contiguous(),
                    tap_layers=taps,
                    prompt_len=4,
                    request_id=f"r{i}",
                    fingerprint=model_fingerprint(cfg),
                )
            )
    return out


def _args(data: Path, target: Path, out: Path, steps: int) -> OfflineConfig:
    train = TrainConfig(
        lr=3e-3, num_passes=3, token_budget=128, draft_vocab_size=64, total_steps=steps,
        device="cpu", seed=0,
    )  # fmt: skip
    return OfflineConfig(data, target, out, train, ParallelConfig(device="cpu"), save_every=3)


@pytest.fixture(scope="module")
def taps_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_taps(tiny_llama_dir, tmp_path_factory.mktemp("taps"))


def test_training_lowers_the_loss(tiny_llama_dir: Path, taps_dir: Path, tmp_path: Path) -> None:
    out = train_from_dir(_args(taps_dir, tiny_llama_dir, tmp_path / "ck", steps=30))
    assert out["steps"] == 30
    rows = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    # The soft cross-entropy is bounded below by the teacher's entropy (high for a random tiny
    # target), so the check is on agreement with the teacher's argmax, which starts near 1/64.
    first = sum(r["acc"][0] for r in rows[:5]) / 5
    last = sum(r["acc"][0] for r in rows[-5:]) / 5
    assert last > first + 0.2, f"pass-1 accuracy went from {first:.2f} to {last:.2f}"
    assert rows[-1]["loss"] < rows[0]["loss"]
    cfg, meta = check_draft(out["draft"])
    assert meta.version >= 2 and meta.counters["step"] == 30
    assert cfg.tap_layers == TargetConfig.from_pretrained(tiny_llama_dir).default_tap_layers()


def test_streamed_step_equals_recompute_step(
    tiny_llama_dir: Path, taps_dir: Path, tmp_path: Path
) -> None:
    """A streamed trainer (features from the tap files, teacher = the lm_head alone applied to
    the recorded post-norm last hidden state) computes the same loss and gradients as a
    recompute trainer that runs the whole target on the token ids. The tiny target's norm
    weights are random, so a norm applied twice, or not at all, would show."""
    msgs = list(read_taps(taps_dir))[:4]
    streamed = pack([Sample.from_tap(m) for m in msgs])
    ids_only = pack([Sample(m.token_ids, loss_mask=m.loss_mask) for m in msgs])
    cfg = TrainConfig(num_passes=3, draft_vocab_size=64, device="cpu", seed=0)
    a = Trainer(tiny_llama_dir, tmp_path / "a", cfg)
    b = Trainer(tiny_llama_dir, tmp_path / "b", replace(cfg, recompute=True))
    assert (a.teacher.mode, b.teacher.mode) == ("streamed", "recompute")
    ma, mb = a.step(streamed), b.step(ids_only)
    assert ma.loss == pytest.approx(mb.loss, rel=1e-5, abs=1e-6)
    pairs = zip(a.draft.named_parameters(), b.draft.named_parameters(), strict=True)
    for (name, pa), (_, pb) in pairs:
        if pa.grad is None:
            assert pb.grad is None, name
            continue
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_resume_continues_exactly(tiny_llama_dir: Path, taps_dir: Path, tmp_path: Path) -> None:
    """Stopping after step 3 and resuming (model, optimizer, step, data position) ends at the
    same weights as an uninterrupted run; draft versions keep increasing."""
    straight = train_from_dir(_args(taps_dir, tiny_llama_dir, tmp_path / "a", steps=8))
    train_from_dir(_args(taps_dir, tiny_llama_dir, tmp_path / "b", steps=3))
    resumed = train_from_dir(_args(taps_dir, tiny_llama_dir, tmp_path / "b", steps=8))
    wa, ma = load_draft(straight["draft"])
    wb, mb = load_draft(resumed["draft"])
    for (name, a), (_, b) in zip(wa.state_dict().items(), wb.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name} differs after resume")
    assert mb.version > 1 and mb.parent_version == mb.version - 1


def test_lr_schedule() -> None:
    cfg = TrainConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(500, cfg) == pytest.approx(0.1)


def test_walk_counts_steps_like_greedy_verification() -> None:
    # k = 2; prompt 2 tokens, total 9: tokens x[3..8] are drafted.
    hits = torch.zeros(2, 9, dtype=torch.bool)
    hits[:, 1] = True  # anchor 1: both accepted -> emits 3 (x3, x4, x5), next anchor 4
    hits[0, 4] = True  # anchor 4: one accepted -> emits 2 (x6, x7), next anchor 6
    rep = AcceptanceReport(k=2, accepted_per_pos=[0, 0])
    walk(hits, 2, 9, rep)  # anchor 6: x8 is the last token: one step emitting 1
    assert (rep.steps, rep.emitted, rep.accepted_per_pos) == (3, 6, [2, 1])


def test_estimator_on_agreeing_pair(tiny_llama_dir: Path, tmp_path: Path) -> None:
    target = make_constant_target(tiny_llama_dir, tmp_path / "t")
    teacher = Teacher.from_pretrained(target, recompute=True)
    seqs = [(torch.tensor([5, 9, 11] + [300] * 20), 3), (torch.tensor([7] + [300] * 30), 1)]
    rates = {}
    for misplace in (False, True):
        draft, _ = load_draft(
            make_agreeing_draft(target, tmp_path / f"d{misplace}", misplace=misplace)
        )
        draft.set_embedding(load_embedding(target))
        rates[misplace] = estimate_acceptance(draft, teacher, seqs, k=3).acceptance_length
    assert rates[False] > 3.5 and rates[True] == pytest.approx(1.0)


def test_torchrun_cp2_matches_single_process(
    tiny_llama_dir: Path, taps_dir: Path, tmp_path: Path
) -> None:
    """`torchrun --nproc-per-node 2 ... learn --cp 2` (gloo) ends at the weights of the same
    training in one process (documents padded alike), within fp32 tolerance."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    single = _args(taps_dir, tiny_llama_dir, tmp_path / "one", steps=4)
    single.pad_multiple = 4
    one = train_from_dir(single)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "codraft.cli", "learn",
        "--from-dir", str(taps_dir), "--target", str(tiny_llama_dir), "--out", str(tmp_path / "cp"),
        "--steps", "4", "--k", "3", "--lr", "3e-3", "--token-budget", "128",
        "--draft-vocab", "64", "--save-every", "3", "--device", "cpu", "--cp", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    latest = (tmp_path / "cp" / "latest").read_text().strip()
    wa, _ = load_draft(one["draft"])
    wb, _ = load_draft(tmp_path / "cp" / latest / "draft")
    for (name, a), (_, b) in zip(wa.state_dict().items(), wb.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"{name} differs under CP")


def test_checkpoint_records_the_policy_version(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The online learner passes the newest policy its data came from; codraft.json keeps it."""
    trainer = Trainer(
        tiny_llama_dir, tmp_path / "ck", TrainConfig(draft_vocab_size=64, device="cpu")
    )
    ckpt = trainer.save(policy_version=7)
    _, meta = check_draft(trainer.draft_dir(ckpt))
    assert meta.policy_version == 7 and meta.version == 1


def test_teacher_dtype_follows_the_step(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """'auto' is bf16 only where the step runs under bf16 autocast (CUDA); a bf16 teacher gives
    the bf16 head's own distribution, which is what a bf16-served target samples from."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert TrainConfig().teacher_torch_dtype(cuda) == torch.bfloat16
    assert TrainConfig().teacher_torch_dtype(cpu) == torch.float32
    assert TrainConfig(autocast_bf16=False).teacher_torch_dtype(cuda) == torch.float32
    assert TrainConfig(teacher_dtype="bfloat16").teacher_torch_dtype(cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="teacher_dtype must be 'auto'.*got 'int8'"):
        TrainConfig(teacher_dtype="int8").teacher_torch_dtype(cpu)
    cfg = TrainConfig(device="cpu", teacher_dtype="bfloat16", draft_vocab_size=64)
    tr = Trainer(tiny_llama_dir, tmp_path / "ck", cfg)
    assert tr.teacher.dtype == torch.bfloat16
    head = load_target(tiny_llama_dir, torch.bfloat16).lm_head.weight
    h = torch.randn(5, head.shape[1])
    want = torch.nn.functional.linear(h.bfloat16(), head[tr.draft.t2d])
    assert torch.equal(tr.teacher.draft_logits(h, tr.draft.t2d), want)


def _dflash_args(
    data: Path, target: Path, out: Path, steps: int, drafter: str = "dflash"
) -> OfflineConfig:
    cfg = _args(data, target, out, steps)
    train = replace(
        cfg.train, drafter=drafter, block_size=4 if drafter == "dflash" else 3, dflash_layers=1,
        mask_token_id=1, markov_rank=8,
        tap_layers=TargetConfig.from_pretrained(target).default_tap_layers(),
    )  # fmt: skip
    return replace(cfg, train=train)


@pytest.mark.parametrize("drafter", ["dflash", "dspark"])
def test_block_drafter_training_lowers_the_loss_and_resumes_exactly(
    drafter: str, tiny_llama_dir: Path, taps_dir: Path, tmp_path: Path
) -> None:
    """`--drafter dflash` (or dspark) offline: agreement with the teacher's argmax at the first
    proposal rises, the checkpoint is of that kind, and a resumed run ends at the same
    weights."""

    def args(out: Path, steps: int) -> OfflineConfig:
        return _dflash_args(taps_dir, tiny_llama_dir, out, steps, drafter)

    out = train_from_dir(args(tmp_path / "ck", steps=30))
    rows = [json.loads(x) for x in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[0]["acc"]) == 3  # DFlash: slots 1..3 of a block of 4; DSpark: 3 queries
    first = sum(r["acc"][0] for r in rows[:5]) / 5
    last = sum(r["acc"][0] for r in rows[-5:]) / 5
    assert last > first + 0.2, f"proposal-1 accuracy went from {first:.2f} to {last:.2f}"
    cfg, meta = check_draft(out["draft"])
    assert cfg.kind == drafter and meta.counters["step"] == 30
    assert cfg.block_size == (4 if drafter == "dflash" else 3)

    straight = train_from_dir(args(tmp_path / "a", steps=6))
    train_from_dir(args(tmp_path / "b", steps=3))
    resumed = train_from_dir(args(tmp_path / "b", steps=6))
    wa, _ = load_draft(straight["draft"])
    wb, _ = load_draft(resumed["draft"])
    for (name, a), (_, b) in zip(wa.state_dict().items(), wb.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{name} differs after resume")


def test_dflash_trainer_recomputes_taps_it_was_not_sent(tiny_llama_dir: Path, taps_dir: Path,
                                                        tmp_path: Path) -> None:  # fmt: skip
    """Recorded taps at other layers than the DFlash draft reads: refused by name when the
    learner only holds the target's head, recomputed at the draft's layers with --recompute."""
    from codraft.learner.dflash_trainer import DFlashTrainer

    batch = pack([Sample.from_tap(m) for m in list(read_taps(taps_dir))[:3]])
    cfg = TrainConfig(drafter="dflash", block_size=3, dflash_layers=1, tap_layers=(2, 4),
                      device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="record taps at those layers"):
        DFlashTrainer(tiny_llama_dir, tmp_path / "a", cfg).step(batch)
    m = DFlashTrainer(tiny_llama_dir, tmp_path / "b", replace(cfg, recompute=True)).step(batch)
    assert m.loss > 0 and len(m.pass_acc) == 2
