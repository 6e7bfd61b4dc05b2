"""Faults injected into the running stack, under load: the learner SIGKILLed again and again,
the learner gone for a minute, the learner's checkpoint folder full, its newest checkpoint
damaged, the server SIGKILLed in the middle of a swap and started again."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx

from codraft.learner.checkpoints import checkpoint_problem, newest_good
from codraft.testing import kill_tree, stop_tree

from .soak import BackgroundLoad, Swapper, check
from .stack import TOKEN, Stack

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _segment(stack: Stack) -> str:
    """The learner's log since its newest start."""
    text = (stack.out / "learn.log").read_text(errors="replace")
    return text[text.rfind("===== start") :]


def _wait_for(pattern: str, stack: Stack, timeout: float) -> re.Match | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, _segment(stack))
        if m:
            return m
        if stack.learner is not None and stack.learner.poll() is not None:
            return None
        time.sleep(0.5)
    return None


def _step(ckpt: Path | None) -> int | None:
    return int(ckpt.name.removeprefix("ckpt-")) if ckpt is not None else None


def _version(stack: Stack) -> int:
    return httpx.get(f"{stack.control_url}/v1/draft", headers=AUTH, timeout=30).json()["version"]


def _last_line(stack: Stack) -> str:
    lines = [x for x in _segment(stack).splitlines() if x.strip() and "====" not in x]
    return lines[-1][-160:] if lines else ""


def learner_kills(stack: Stack, kills: int, rng: random.Random) -> dict:
    """SIGKILL the learner at random moments, start it again each time: the step it resumes
    at must be its newest checkpoint's; versions on the server only go up."""
    rows = []
    for _ in range(kills):
        time.sleep(rng.uniform(8.0, 25.0))
        doing = _last_line(stack)
        version = _version(stack)
        kill_tree(stack.learner)
        saved = _step(newest_good(stack.learner_out))  # what the dead learner left on disk
        restart_s = stack.start_learner()
        m = _wait_for(r"training draft from step (\d+), version (\d+)", stack, 300)
        rows.append({
            "last_log_line": doing, "newest_checkpoint_step": saved,
            "resumed_step": int(m.group(1)) if m else None, "server_version_before": version,
            "server_version_after": _version(stack), "restart_s": restart_s,
        })  # fmt: skip
    return {
        "kills": len(rows),
        "rows": rows,
        "resumed_at_newest_checkpoint": all(
            r["resumed_step"] == (r["newest_checkpoint_step"] or 0) for r in rows
        ),
        "versions_monotonic": all(
            r["server_version_after"] >= r["server_version_before"] for r in rows
        ),
    }


def learner_unreachable(stack: Stack, seconds: float) -> dict:
    """The learner killed and left down: the server keeps serving and counts what it drops."""
    before = httpx.get(f"{stack.control_url}/v1/tap", headers=AUTH, timeout=30).json()["stats"]
    kill_tree(stack.learner)
    time.sleep(seconds)
    after = httpx.get(f"{stack.control_url}/v1/tap", headers=AUTH, timeout=30).json()["stats"]
    stack.start_learner()
    delta = {
        k: after[k] - before.get(k, 0)
        for k in after
        if isinstance(after[k], int | float) and not isinstance(after[k], bool)
    }
    return {"seconds": seconds, "tap_stats_delta": delta}


def full_disk(stack: Stack, work: Path, timeout: float = 420.0) -> dict:
    """A learner whose --out is a tmpfs with room for half a checkpoint."""
    where = work / "small-disk"
    where.mkdir(parents=True, exist_ok=True)
    ckpt = newest_good(stack.learner_out)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt else 256 << 20
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={int(size * 0.5)}", "tmpfs", str(where)],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode:
        return {"skipped": f"cannot mount a tmpfs: {mounted.stderr.strip()}"}
    stop_tree(stack.learner)
    try:
        stack.start_learner(out=where / "learner")
        deadline, failures, metrics = time.monotonic() + timeout, 0.0, {}
        while time.monotonic() < deadline and failures < 1:
            time.sleep(2.0)
            try:
                metrics = stack.learner_metrics()
            except httpx.HTTPError:
                continue
            failures = metrics.get("codraft_learner_checkpoint_failures_total", 0.0)
        alive = stack.learner.poll() is None
        stop_tree(stack.learner)  # a stopping learner tries to checkpoint once more
        entries = sorted(p.name for p in (where / "learner").iterdir())
        whole = {
            n: checkpoint_problem(where / "learner" / n) for n in entries if n.startswith("ckpt-")
        }
        logged = re.findall(r"checkpoint of step \d+ not written[^\n]*", _segment(stack))
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        stack.start_learner()
    return {
        "disk_bytes": int(size * 0.5),
        "checkpoint_failures": failures,
        "failures_logged": len(logged),
        "learner_alive": alive,
        "entries": entries,
        "checkpoints_whole": all(v is None for v in whole.values()),
        "torn_or_temp": [n for n in entries if n.startswith(".")],
        "error_logged": logged[:1],
        "published": metrics.get("codraft_learner_published_total"),
    }


def corrupt_newest(stack: Stack, timeout: float = 240.0) -> dict:
    """Stop the learner, damage its newest checkpoint's weights, start it again. Waits (up to
    `timeout`) for the learner to have written two checkpoints, so there is one to fall back to."""

    def on_disk() -> list[Path]:
        return sorted(p for p in stack.learner_out.glob("ckpt-*") if p.is_dir())

    deadline = time.monotonic() + timeout
    while len(on_disk()) < 2 and time.monotonic() < deadline:
        time.sleep(2.0)
    stop_tree(stack.learner)
    ckpts = on_disk()
    if len(ckpts) < 2:
        stack.start_learner()
        return {"skipped": f"{len(ckpts)} checkpoint(s): nothing to fall back to"}
    newest, previous = ckpts[-1], ckpts[-2]
    weights = newest / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    version = _version(stack)
    stack.start_learner()
    skipped = _wait_for(r"checkpoint \S+ is damaged and skipped: ([^\n]{0,160})", stack, 120)
    m = _wait_for(r"training draft from step (\d+), version (\d+)", stack, 300)
    published = _wait_for(r"published draft v(\d+)", stack, timeout)  # if a candidate wins
    return {
        "damaged": newest.name,
        "skipped_logged": skipped.group(0) if skipped else None,
        "resumed_step": int(m.group(1)) if m else None,
        "previous_step": _step(previous),
        "resumed_from_previous": bool(m) and int(m.group(1)) == _step(previous),
        "server_version_before": version,
        "next_published_version": int(published.group(1)) if published else None,
        "versions_monotonic": published is None or int(published.group(1)) > version,
    }


def server_restart_mid_swap(stack: Stack, swapper: Swapper, refs: tuple[dict, dict]) -> dict:
    """SIGKILL the server (and its engine) while a swap is in flight; start the same command
    again; it must serve the newest draft it committed."""
    now = httpx.get(f"{stack.control_url}/v1/draft", headers=AUTH, timeout=30).json()
    v = int(now.get("highest_version") or now["version"]) + 1
    path, sha = swapper._folder(v)
    answer: list[int] = []

    def swap() -> None:
        try:
            r = httpx.post(f"{stack.control_url}/v1/draft", headers=AUTH, timeout=120,
                           json={"version": v, "path": str(path), "sha256": sha})  # fmt: skip
            answer.append(r.status_code)
        except httpx.HTTPError:
            answer.append(0)

    thread = threading.Thread(target=swap)
    thread.start()
    time.sleep(0.03)
    kill_tree(stack.server)
    thread.join(60)
    restart_s = stack.start_server()
    after = httpx.get(f"{stack.control_url}/v1/draft", headers=AUTH, timeout=30).json()
    load = BackgroundLoad(stack, clients=2)
    time.sleep(20)
    checked = check(load.stop(), refs, None)
    return {
        "acknowledged_before_kill": now["version"],
        "in_flight_version": v,
        "in_flight_answer": answer[0] if answer else None,
        "served_after_restart": after["version"],
        "restart_s": restart_s,
        "serves_newest_committed": after["version"] == (v if answer == [200] else after["version"])
        and after["version"] in (now["version"], v),
        "after_restart": {k: checked[k] for k in ("requests", "failures", "lossless_pct")},
    }


def run(stack: Stack, swapper: Swapper, refs: tuple[dict, dict], work: Path, kills: int,
        unreachable_s: float, seed: int = 0) -> dict:  # fmt: skip
    rng = random.Random(seed)
    load = BackgroundLoad(stack, clients=4)
    out: dict = {}
    try:
        out["learner_kills"] = learner_kills(stack, kills, rng)
        out["learner_unreachable"] = learner_unreachable(stack, unreachable_s)
        out["full_disk"] = full_disk(stack, work)
        out["corrupt_newest_checkpoint"] = corrupt_newest(stack)
    finally:
        run = load.stop()
    out["load_during_learner_faults"] = check(run, refs, None)
    out["server_restart_mid_swap"] = server_restart_mid_swap(stack, swapper, refs)
    shutil.rmtree(work / "small-disk", ignore_errors=True)
    return out
