"""Bad input: a matrix of broken draft checkpoints POSTed to the server, the control API fuzzed
from its own OpenAPI schema (schemathesis), malformed tap frames pushed into the learner."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import zmq
from safetensors.torch import load_file, save_file

from codraft.draft.checkpoint import MAX_HEADER_BYTES, sha256_file
from codraft.draft.init import write_new_draft
from codraft.models.config import TargetConfig
from codraft.tap import TapMessage, encode, model_fingerprint
from codraft.tap.fuzz import malformed

from .stack import TOKEN, Stack

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SCHEMATHESIS_CONFIG = Path(__file__).with_name("schemathesis.toml")


# ------------------------------------------------------------------------------ checkpoints
def _resha(ckpt: Path) -> None:
    meta = json.loads((ckpt / "codraft.json").read_text())
    meta["weights_sha256"] = sha256_file(ckpt / "model.safetensors")
    (ckpt / "codraft.json").write_text(json.dumps(meta))


def _edit_tensors(ckpt: Path, edit) -> Path:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    _resha(ckpt)
    return ckpt


def bad_checkpoints(model: Path, root: Path, version: int) -> dict[str, tuple[Path, str | None]]:
    """name -> (checkpoint folder, sha256 the request names), each broken in one way."""
    if root.exists():
        shutil.rmtree(root)
    vocab = min(8192, TargetConfig.from_pretrained(model).vocab_size)

    def good(name: str, **kw: Any) -> Path:
        kw.setdefault("draft_vocab_size", vocab)
        return write_new_draft(root / name, model, version=version, dtype="float32", **kw)

    def poison(value: float):
        def edit(t: dict) -> None:
            t["midlayer.mlp.down_proj.weight"][7, 11] = value

        return edit

    cases: dict[str, tuple[Path, str | None]] = {}
    p = good("truncated")
    w = p / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    cases["truncated weights"] = (p, None)
    p = good("recorded-sha")
    meta = json.loads((p / "codraft.json").read_text())
    meta["weights_sha256"] = "0" * 64
    (p / "codraft.json").write_text(json.dumps(meta))
    cases["wrong sha256 recorded"] = (p, None)
    cases["wrong sha256 requested"] = (good("requested-sha"), "f" * 64)
    p = good("shapes")
    fc = load_file(str(p / "model.safetensors"))["fc.weight"]
    cases["wrong shapes"] = (
        _edit_tensors(p, lambda t: t.update({"fc.weight": fc[:, :-8].contiguous()})),
        None,
    )
    cases["wrong tap layers"] = (good("taps", tap_layers=(1, 2, 3)), None)
    cases["wrong vocab"] = (good("vocab", draft_vocab_size=vocab // 2), None)
    cases["NaN weight"] = (_edit_tensors(good("nan"), poison(float("nan"))), None)
    cases["Inf weight"] = (_edit_tensors(good("inf"), poison(float("-inf"))), None)
    p = good("oversized-header")
    w = p / "model.safetensors"
    data = w.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n] + b" " * (MAX_HEADER_BYTES + 1 - n)
    w.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n :])
    _resha(p)
    cases["oversized safetensors header"] = (p, None)
    p = good("symlink")
    outside = root / "outside.safetensors"
    (p / "model.safetensors").rename(outside)
    (p / "model.safetensors").symlink_to(outside)
    cases["symlink out of the folder"] = (p, None)
    p = good("no-config")
    (p / "config.json").unlink()
    cases["folder with no config"] = (p, None)
    p = good("bad-config")
    (p / "config.json").write_text("{")
    cases["unreadable config"] = (p, None)
    cases["missing folder"] = (root / "nothing-here", None)
    return cases


def checkpoint_matrix(stack: Stack, work: Path) -> dict:
    """Each bad checkpoint POSTed: its status and message, and the old draft still serving."""
    c = httpx.Client(base_url=stack.control_url, headers=AUTH, timeout=120)
    before = c.get("/v1/draft").json()
    v = int(before.get("highest_version") or before["version"]) + 1
    rows = []
    for name, (path, sha) in bad_checkpoints(stack.model, work / "bad-checkpoints", v).items():
        r = c.post("/v1/draft", json={"version": v, "path": str(path), "sha256": sha})
        now = c.get("/v1/draft").json()
        rows.append(
            {
                "case": name,
                "status": r.status_code,
                "detail": r.json().get("detail", "")[:300],
                "old_draft_serving": (now["version"], now["sha256"])
                == (before["version"], before["sha256"]),
            }
        )
    stale = c.post("/v1/draft", json={"version": before["version"], "path": before["path"]})
    rows.append(
        {
            "case": "older version",
            "status": stale.status_code,
            "detail": stale.json().get("detail", "")[:300],
            "old_draft_serving": c.get("/v1/draft").json()["version"] == before["version"],
        }
    )
    c.close()
    return {
        "cases": rows,
        "all_4xx": all(400 <= r["status"] < 500 for r in rows),
        "old_draft_kept": all(r["old_draft_serving"] for r in rows),
    }


# ------------------------------------------------------------------------------ schemathesis
def fuzz_control(stack: Stack, examples: int, out: Path) -> dict:
    """schemathesis, every check, against the control port's /openapi.json."""
    t0 = time.monotonic()
    tap = httpx.get(f"{stack.control_url}/v1/tap", headers=AUTH, timeout=30).json()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(SCHEMATHESIS_CONFIG),
            "run",
            f"{stack.control_url}/openapi.json",
            "-H",
            f"Authorization: Bearer {TOKEN}",
            "--checks",
            "all",
            "--max-examples",
            str(examples),
            "--seed",
            "11",
            "--no-color",
            "--workers",
            "1",
            "--report",
            "junit",
            "--report-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    restore = {k: tap[k] for k in ("enabled", "mode", "sample_rate", "endpoint")}
    httpx.put(f"{stack.control_url}/v1/tap", json=restore, headers=AUTH, timeout=30)
    (out / "schemathesis.txt").write_text(done.stdout + done.stderr)
    counts = re.search(
        r"(\d+) generated, (?:(\d+) found (\d+) unique failures?, )?(?:(\d+) passed)?", done.stdout
    )
    server_errors = len(re.findall(r"Server error", done.stdout))
    return {
        "exit_code": done.returncode,
        "cases": int(counts.group(1)) if counts else None,
        "failures": int(counts.group(3) or 0) if counts else None,
        "server_errors_5xx": server_errors,
        "seconds": time.monotonic() - t0,
        "summary": done.stdout[done.stdout.rfind("SUMMARY") :][-1500:],
    }


# ------------------------------------------------------------------------------ tap frames
def valid_tap(model: Path, i: int, n: int = 8) -> list[bytes]:
    """A valid 'full' tap message of `model` (random features of the right shape)."""
    cfg = TargetConfig.from_pretrained(model)
    taps = cfg.default_tap_layers()
    g = torch.Generator().manual_seed(i)
    msg = TapMessage.build(
        torch.randint(0, cfg.vocab_size, (n,), generator=g, dtype=torch.int32),
        taps=torch.randn(n, len(taps) * cfg.hidden_size, generator=g),
        last_hidden=torch.randn(n, cfg.hidden_size, generator=g),
        tap_layers=taps,
        prompt_len=4,
        request_id=f"fuzz-valid-{i}",
        fingerprint=model_fingerprint(cfg),
    )
    return [bytes(f) for f in encode(msg)]


def _rejected(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        m = re.match(r'codraft_learner_tap_rejected\{reason="([^"]+)"\}', key)
        if m:
            out[m.group(1)] = value
    return out


def tap_frames(stack: Stack, count: int, seed: int = 0) -> dict:
    """`count` malformed messages pushed into the running learner (the server's tap paused),
    then ten valid ones; the learner's own counters say what it made of them."""
    headers = AUTH
    httpx.put(f"{stack.control_url}/v1/tap", json={"enabled": False}, headers=headers, timeout=30)
    time.sleep(2.0)  # what the server had in flight arrives first
    before = stack.learner_metrics()
    good = valid_tap(stack.model, 0)
    rng = random.Random(seed)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1000)
    push.connect(f"tcp://127.0.0.1:{stack.tap}")
    t0 = time.monotonic()
    sent: dict[str, int] = {}
    for _ in range(count):
        kind, frames = malformed(good, rng)
        sent[kind] = sent.get(kind, 0) + 1
        push.send_multipart(frames)
    for i in range(10):
        push.send_multipart(valid_tap(stack.model, 1000 + i))
    want = sum(_rejected(before).values()) + count
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        now = stack.learner_metrics()
        if (
            sum(_rejected(now).values()) >= want
            and now.get("codraft_learner_tap_accepted", 0)
            >= before.get("codraft_learner_tap_accepted", 0) + 10
        ):
            break
        time.sleep(1.0)
    seconds = time.monotonic() - t0
    push.close(linger=0)
    httpx.put(f"{stack.control_url}/v1/tap", json={"enabled": True}, headers=headers, timeout=30)
    rej0, rej1 = _rejected(before), _rejected(now)
    by_reason = {r: int(rej1.get(r, 0) - rej0.get(r, 0)) for r in sorted(rej1)}
    return {
        "sent": count,
        "sent_by_kind": sent,
        "rejected": sum(by_reason.values()),
        "rejected_by_reason": {r: n for r, n in by_reason.items() if n},
        "valid_after_accepted": int(
            now.get("codraft_learner_tap_accepted", 0)
            - before.get("codraft_learner_tap_accepted", 0)
        ),
        "learner_alive": stack.learner is not None and stack.learner.poll() is None,
        "seconds": seconds,
    }
