"""`codraft learn --server` under torchrun (gloo, CPU): the distributed online learner.

Real processes: torchrun starts the ranks of `python -m codraft.cli learn`, rank 0 binds the tap
socket, and this test pushes recorded-style tap messages to it over real ZeroMQ. No server
listens at --server (a closed port): the learner reads no serving draft and, with
--publish-every past --steps, publishes nothing; it checkpoints when it stops. The learner
starts training only when every message is buffered (--min-buffer-tokens = the training
tokens), so the data order is fixed, and then:

* CP 2 (2 ranks) ends with the single-process run's weights (fp32, 1e-5);
* dp 2 x cp 2 (4 ranks) ends with dp 2 x cp 1's (2 ranks): the same batches per replica, each
  split over two CP ranks or not (the gradient sum over dp is covered against one device by
  tests/test_cp.py);
* a planted bug, from the test side (a `sitecustomize` on the ranks' path that turns
  ContextParallel.reduce_gradients into a no-op): that CP run must not match, so the comparison
  can fail;
* on token ids only, two pipeline stages (`--pp 2`, the lead is the last stage) end with the
  weights of one process that recomputes the whole target (`--recompute`).

Then ranks killed with SIGKILL under `torchrun --max-restarts` resume with versions climbing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import torch
import zmq
from live import kill_group, rendezvous_port
from safetensors.torch import load_file

from codraft.draft.config import DraftConfig
from codraft.learner.online.buffer import BufferPolicy, is_holdout
from codraft.models.config import TargetConfig
from codraft.tap import TapMessage, encode, model_fingerprint
from codraft.testing import make_tiny_target

STEPS = 4
BUDGET = 96  # tokens per replica per step
TOL = 1e-5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cache
def _target() -> Path:
    root = Path(os.environ.get("CODRAFT_TEST_CACHE", Path.home() / ".cache" / "codraft-tests"))
    return make_tiny_target(root / "online-parallel-target")


def _messages(target: Path, ids: bool = False) -> tuple[list[TapMessage], int]:
    """Messages of the tiny target's geometry, and the tokens the buffer trains on; `ids`: token
    ids only (the learner recomputes the target's features)."""
    tcfg = TargetConfig.from_pretrained(target)
    taps = DraftConfig.from_target(tcfg, draft_vocab_size=64).tap_layers
    h, g = tcfg.hidden_size, torch.Generator().manual_seed(3)
    out, train_tokens = [], 0
    for i in range(24):
        n = int(torch.randint(10, 40, (1,), generator=g))
        tokens = torch.randint(3, tcfg.vocab_size, (n,), generator=g, dtype=torch.int32)
        features = {"taps": torch.randn(n, len(taps) * h, generator=g),
                    "last_hidden": torch.randn(n, h, generator=g)}  # fmt: skip
        msg = TapMessage.build(
            tokens,
            **({"hidden_size": h} if ids else features),
            tap_layers=taps,
            prompt_len=4,
            request_id=f"req-{i}",
            fingerprint=model_fingerprint(tcfg),
        )
        out.append(msg)
        if not is_holdout(msg.header.request_id, BufferPolicy.holdout_fraction, HOLDOUT_KEY):
            train_tokens += n
    return out, train_tokens


HOLDOUT_KEY = b"online-parallel-holdout-key-0123"  # the learners' (--holdout-key-file)

PLANT = """
from codraft.learner.parallel.context import ContextParallel
ContextParallel.reduce_gradients = lambda self, params: None  # planted: no gradient sum
"""


def _learn(
    out: Path, nproc: int, cp: int = 1, plant: bool = False, *flags: str, ids: bool = False
) -> dict[str, torch.Tensor]:
    """One learner run to STEPS steps, `flags` added to its command line; the weights of its
    final checkpoint. `ids`: the messages carry token ids only."""
    target = _target()
    messages, tokens = _messages(target, ids)
    tap = f"tcp://127.0.0.1:{_port()}"
    key = out.with_name(out.name + ".holdout-key")
    key.write_bytes(HOLDOUT_KEY)
    args = [
        "learn", "--server", f"http://127.0.0.1:{_port()}", "--tap", tap, "--target", str(target),
        "--out", str(out), "--steps", str(STEPS), "--publish-every", "1000", "--http-port", "0",
        "--min-buffer-tokens", str(tokens), "--token-budget", str(BUDGET), "--draft-vocab", "64",
        "--k", "2", "--device", "cpu", "--cp", str(cp), "--lr", "3e-3",
        "--holdout-key-file", str(key), *flags,
    ]  # fmt: skip
    if nproc == 1:
        cmd = [sys.executable, "-m", "codraft.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_port()), "-m", "codraft.cli", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_NO_PRELOAD": "1"}
    if plant:
        site = out.with_name(out.name + "-site")
        site.mkdir()
        (site / "sitecustomize.py").write_text(PLANT)
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    log = out.with_suffix(".log")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(tap)  # queued here until rank 0 binds
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        for m in messages:
            push.send_multipart(encode(m))
        try:
            proc.wait(timeout=300)
        finally:
            kill_group(proc)
            push.close(linger=0)
            ctx.term()
    text = log.read_text()
    assert proc.returncode == 0, f"learner exited {proc.returncode}:\n{text[-4000:]}"
    latest = out / (out / "latest").read_text().strip()
    assert json.loads((latest / "state.json").read_text())["step"] == STEPS, text[-2000:]
    health = json.loads(text[text.rindex('{\n  "status"') :])  # rank 0's, printed at the end
    assert health["ingested_tokens"] >= tokens and health["trained_tokens"] > 0, health
    assert health["world_size"] == nproc and health["wait_seconds"] >= 0, health
    return load_file(latest / "draft" / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@cache
def _runs(tmp: str) -> dict[str, dict[str, torch.Tensor]]:
    root = Path(tmp)
    return {
        "single": _learn(root / "single", 1, 1),
        "cp2": _learn(root / "cp2", 2, 2),
        "cp2-planted": _learn(root / "cp2-planted", 2, 2, plant=True),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    return _runs(str(tmp_path_factory.mktemp("online-parallel")))


def test_cp2_matches_the_single_process_run(runs) -> None:
    err = _max_diff(runs["cp2"], runs["single"])
    print(f"CP 2 against one process: {err:.2e}")
    assert err <= TOL, f"CP 2 against one process: max weight difference {err:.2e}"


def test_a_planted_missing_gradient_sum_is_caught(runs) -> None:
    err = _max_diff(runs["cp2-planted"], runs["single"])
    print(f"planted: {err:.2e}")
    assert err > 1e-3, f"CP 2 without the gradient sum matched ({err:.2e}): the check is blind"


def test_dp2_cp2_matches_dp2(tmp_path) -> None:
    dp = _learn(tmp_path / "dp2", 2, 1)
    dpcp = _learn(tmp_path / "dp2cp2", 4, 2)
    err = _max_diff(dpcp, dp)
    print(f"dp 2 x cp 2 against dp 2: {err:.2e}")
    assert err <= TOL, f"dp 2 x cp 2 against dp 2: max weight difference {err:.2e}"


def _estimate(out: Path) -> float | None:
    """The acceptance estimate the newest checkpoint was published with (None: none made)."""
    latest = out / (out / "latest").read_text().strip()
    return json.loads((latest / "draft" / "codraft.json").read_text())["counters"].get(
        "est_acceptance"
    )


def test_pp2_on_ids_only_taps_matches_the_single_process_recompute_run(tmp_path) -> None:
    """Token ids only on the wire: two pipeline stages (the target split over them, its taps
    through TapChannel, the draft on the last) end with the weights of one process that runs
    the whole target itself (`--recompute`), and the candidate published at the last step is
    compared on the held-out requests as that process compares it: the pipeline runs the
    target over them (the EVAL command) and the estimates agree. TapChannel's own planted bug
    is caught offline (tests/test_pp.py)."""
    publish = ("--publish-every", str(STEPS))  # the server is absent: the publish fails, counted
    single = _learn(tmp_path / "recompute", 1, 1, False, "--recompute", *publish, ids=True)
    pp = _learn(tmp_path / "pp2", 2, 1, False, "--pp", "2", *publish, ids=True)
    err = _max_diff(pp, single)
    print(f"pp 2 against one process: {err:.2e}")
    assert err <= TOL, f"pp 2 against one process (ids-only taps): max weight difference {err:.2e}"
    est, est_pp = _estimate(tmp_path / "recompute"), _estimate(tmp_path / "pp2")
    print(f"acceptance estimates: one process {est}, pp 2 {est_pp}")
    assert est is not None and est >= 1.0, est  # at least the target's own token a step
    assert est_pp == pytest.approx(est, abs=1e-9), (est_pp, est)


def _ranks(agent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's workers (children of its agent process)."""
    out = {}
    for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(child)
    return out


def _latest(out: Path) -> tuple[int, int] | None:
    """(step, draft version) of the newest complete checkpoint, or None."""
    try:
        state = json.loads((out / (out / "latest").read_text().strip() / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return int(state["step"]), int(state["draft_version"])


def test_killed_ranks_resume_with_versions_climbing(tmp_path) -> None:
    """CP 2 under `torchrun --max-restarts`: KILLS times a rank is killed with SIGKILL (rank 1
    mid-step, rank 0 just after a checkpoint, while its publish runs, in turn; CODRAFT_KILLS=10
    for five of each), torchrun restarts both,
    they resume from the newest checkpoint, and the run reaches its last step with every
    checkpoint complete and versions only climbing. Messages keep coming meanwhile."""
    import threading

    from codraft.draft.checkpoint import load_draft

    kills = int(os.environ.get("CODRAFT_KILLS", "5"))
    # a kill and the wait for the restarted group's second checkpoint take 8 to 12 steps (the
    # stopped group may finish one more): room for every kill, and some after the last
    target, steps, out = _target(), 12 * (kills + 2), tmp_path / "run"
    messages, _ = _messages(target)
    tap = f"tcp://127.0.0.1:{_port()}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--max-restarts", str(4 * kills), "--master-port", str(rendezvous_port()),
        "-m", "codraft.cli", "learn", "--server", f"http://127.0.0.1:{_port()}", "--tap", tap,
        "--target", str(target),
        "--out", str(out), "--steps", str(steps), "--publish-every", "4", "--http-port", "0",
        "--min-buffer-tokens", "200", "--token-budget", str(BUDGET), "--draft-vocab", "64",
        "--k", "2", "--device", "cpu", "--cp", "2", "--group-timeout", "45",
    ]  # fmt: skip
    # Eager gloo connects: a restarted group meets apart from the groups before it
    # (codraft.learner.parallel.launch.restart_store), or its ranks would read the killed
    # ranks' addresses. --group-timeout: a group that hangs all the same fails and is restarted
    # within this test's wait (the default, 600 s, would outlast it).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_NO_PRELOAD": "1"}
    stop = threading.Event()

    def feed() -> None:  # the server's stream: the same requests again and again
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 64)
        push.connect(tap)
        while not stop.is_set():
            for m in messages:
                try:
                    push.send_multipart(encode(m), flags=zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.05)
            time.sleep(0.05)
        push.close(linger=0)
        ctx.term()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    log = tmp_path / "learner.log"
    seen: list[tuple[int, int]] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            gone: set[int] = set()  # the pids of every group stopped so far
            at_kill = (0, 0)  # the newest checkpoint when the last kill was sent
            for kill in range(kills):
                rank = 1 if kill % 2 == 0 else 0
                # wait for a new group (none of its ranks seen before) that has trained past
                # two checkpoints after the kill (the stopped group may still finish one): the
                # restarted run resumed and trains
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    pids = _ranks(proc.pid)
                    got = _latest(out)
                    fresh = len(pids) == 2 and not gone & set(pids.values())
                    if fresh and got is not None and got[1] >= at_kill[1] + 2:
                        seen.append(got)
                        break
                    assert proc.poll() is None, log.read_text()[-3000:]
                    time.sleep(0.1)
                else:
                    raise AssertionError(f"no new checkpoint after kill {kill}: {seen}")
                if rank == 1:
                    time.sleep(0.5)  # inside the steps that follow
                gone |= set(pids.values())
                at_kill = _latest(out) or at_kill
                print(f"kill {kill}: rank {rank} (pid {pids[rank]}) after {seen[-1]}")
                os.kill(pids[rank], signal.SIGKILL)
            proc.wait(timeout=400)
        finally:
            stop.set()
            feeder.join(timeout=30)  # its ZeroMQ context ends before the interpreter does
            kill_group(proc)
    text = log.read_text()
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{text[-4000:]}"
    final = _latest(out)
    assert final is not None and final[0] == steps, (final, text[-3000:])
    history = [*seen, final]
    pairs = zip(history, history[1:], strict=False)
    assert all(b[1] > a[1] and b[0] >= a[0] for a, b in pairs), history
    for ckpt in sorted(out.glob("ckpt-*")):  # every checkpoint kept is whole: it loads
        load_draft(ckpt / "draft")
    assert text.count("(exitcode: -9)") == kills, text[-3000:]  # torchrun saw every kill
