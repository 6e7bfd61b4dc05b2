"""The online learner on ids-only taps, the target recomputed from the token ids: in one process
(`--recompute`) and as two pipelines of two stages, one per CP rank (`--pp 2 --cp 2`) or one
per data-parallel replica (`--pp 2` on four ranks), under torchrun (gloo), against a real
`codraft serve` (vLLM on the CPU, a tiny random
Llama, eager, `--tap-mode ids`, greedy load).

Checked for each: the messages carry no features, the learner trains on them and a draft it
publishes is installed (the server's version climbs past what served before); on SIGTERM every
rank stops after its step, none fails, and the lead's checkpoint is at the step it stopped on.
Under pipelines the last stage of the first is the lead: it binds the tap, trains its draft,
sends the other last stage its batches and publishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live import kill_group, listening, loaded_server, rendezvous_port

from codraft.client import CodraftClient

pytestmark = pytest.mark.vllm

TOKEN = "pp-token"
RUN = [
    "--device=cpu", "--http-port=0", "--publish-every=6", "--min-buffer-tokens=200",
    "--token-budget=256", "--lr=3e-3", "--max-seconds=400",
]  # fmt: skip
PUBLISH_TIMEOUT_S = 300
STOP_S = 180  # SIGTERM to exit; seconds normally, minutes when this host is loaded


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("online-ids")
    with loaded_server(tiny_llama_dir, root, TOKEN, "--tap-mode", "ids") as s:
        yield s


def _program(server: dict, out: Path) -> list[str]:
    """`codraft learn` against the fixture's server, sized for a tiny model."""
    return [
        "learn", "--server", f"http://127.0.0.1:{server['cport']}", "--token", TOKEN,
        "--tap", f"tcp://127.0.0.1:{server['tap']}", "--target", str(server["target"]),
        "--out", str(out), *RUN,
    ]  # fmt: skip


def _command(kind: str, server: dict, out: Path) -> list[str]:
    program = _program(server, out)
    if kind == "recompute":
        return [sys.executable, "-m", "codraft.cli", *program, "--recompute"]
    nproc, flags = WORLDS[kind]
    launcher = ["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port()}"]  # fmt: skip
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "codraft.cli",
            *program, *flags]  # fmt: skip


# `--pp 2` alone (two ranks) passed here too; these worlds hold it and add a second pipeline:
# one sharding the lead's batch with it (PP x CP), one training a batch of its own (PP x DP)
WORLDS = {"pp2-cp2": (4, ["--pp", "2", "--cp", "2"]), "pp2-dp2": (4, ["--pp", "2"])}


@pytest.mark.parametrize("kind", ["recompute", *WORLDS])
def test_ids_only_taps_train_and_publish(kind: str, server: dict) -> None:
    client: CodraftClient = server["client"]
    assert client.tap().mode == "ids", client.tap()
    out = server["root"] / f"learner-{kind}"
    info = client.draft()
    before = max(info.version or 0, info.highest_version or 0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_NO_PRELOAD": "1"}
    for attempt in (1, 2):
        log = out.parent / f"{out.name}-try{attempt}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                _command(kind, server, out), stdout=f, stderr=subprocess.STDOUT, env=env
            )
        if listening([proc], [log]) or attempt == 2:
            break
        print(f"{kind}: nothing logged in time; starting the learner again")  # gloo's connect
        kill_group(proc)
    text = lambda: log.read_text()[-4000:]  # noqa: E731
    try:
        deadline = time.time() + PUBLISH_TIMEOUT_S
        version = before
        while time.time() < deadline and version <= before:
            assert proc.poll() is None, f"the learner exited:\n{text()}"
            time.sleep(2)
            info = client.draft()
            version = max(info.version or 0, info.highest_version or 0)
        assert version > before, f"no draft published in {PUBLISH_TIMEOUT_S} s:\n{text()}"
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the learner did not stop within {STOP_S} s of SIGTERM:\n{text()}")
    finally:
        kill_group(proc)
    whole = log.read_text()
    assert not re.search(r"^\[rank\d+\]: Traceback", whole, re.M), f"a rank failed:\n{text()}"
    stopped = re.findall(r"stopped at step (\d+)", whole)
    latest = out / (out / "latest").read_text().strip()
    state = json.loads((latest / "state.json").read_text())
    assert stopped and int(stopped[-1]) == state["step"] >= 6, (state, text())
    assert not server["load"].failed, server["load"].failed[:3]


def test_a_learner_without_the_target_refuses_ids_only_taps(server: dict) -> None:
    """A learner that trains on streamed features alone (no --recompute, no --pp) counts the
    ids-only messages as rejected (reason "mode") and keeps running, instead of failing its
    first step on a batch without features."""
    out = server["root"] / "learner-streamed"
    log = out.parent / f"{out.name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CODRAFT_NO_PRELOAD": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "codraft.cli", *_program(server, out)],
            stdout=f, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.time() + 120
        while time.time() < deadline and "rejected a tap message (mode)" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        assert "rejected a tap message (mode)" in log.read_text(), log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_S) == 0, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert "Traceback" not in log.read_text()
