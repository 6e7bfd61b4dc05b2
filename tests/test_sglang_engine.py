"""codraft.server.sglang.engine with SGLang's objects played by stand-ins.

SGLang cannot run on this machine (no CPU build of its kernels reaches it; docs/sglang.md), so
the scheduler, its EAGLE worker, the batches, the target's forward outputs and the draft model
are stand-ins with the attributes codraft reads from SGLang 0.5.17 (the plugin's hooks call the
same engine methods on the GPU: scripts/gpu_sglang/engine_checks.py). Everything of codraft's
is real: the draft checkpoints and their checks, the assembler, the tap publisher over ZeroMQ,
the decoded messages, the control socket, and the draft written through a `load_weights`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq
from sglang_standins import DFlashWorkerV2, DraftModel, EAGLEWorkerV2, Mode, Req

from codraft.draft.init import write_new_draft
from codraft.models.config import TargetConfig
from codraft.server.engine_config import EngineConfig
from codraft.server.sglang.engine import ENV, Settings, SGLangEngine, split_final
from codraft.server.sglang.plugin import _with_final
from codraft.server.sglang.rpc import RpcClient
from codraft.server.weights import SwapError
from codraft.tap.message import decode

DV = 64  # draft vocabulary


def feats(pos: int, tok: int, taps: int, h: int) -> torch.Tensor:
    """What the target computes at a position for a token: taps then the final state."""
    return torch.arange((taps + 1) * h, dtype=torch.float32) * 0.01 + pos + 0.001 * tok


@pytest.fixture()
def setup(request, tiny_llama_dir: Path, tmp_path: Path):
    """The engine on stand-ins; EngineConfig's fields from the test's parameter, if any (the
    default assembles in the tap process)."""
    draft = write_new_draft(tmp_path / "v0", tiny_llama_dir, draft_vocab_size=DV, version=0)
    from safetensors.torch import load_file

    tensors = load_file(draft / "model.safetensors")
    cfg = TargetConfig.from_pretrained(tiny_llama_dir)
    taps = json.loads((draft / "codraft.json").read_text())["tap_layers"]
    target_model = torch.nn.Module()
    target_model.embed = torch.nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size))
    target_model.model = SimpleNamespace(layers_to_capture=list(taps))
    loaded: list[str] = []
    updater = SimpleNamespace(
        update_weights_from_disk=lambda path, fmt: (loaded.append(path), (True, "ok"))[1]
    )
    runner = SimpleNamespace(
        model=target_model, dtype=torch.float32, device="cpu", gpu_id=0, weight_updater=updater,
        model_config=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=cfg.hidden_size,
                                                               to_dict=lambda: {}),
                                     context_len=2048),
    )  # fmt: skip
    model = DraftModel(tensors, target_model.embed)
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    control = f"ipc://{tmp_path}/control"
    more = getattr(request, "param", {})
    settings = Settings(
        str(draft), control, EngineConfig(tap_endpoint=f"tcp://127.0.0.1:{port}", **more)
    )
    scheduler = SimpleNamespace(
        draft_worker=EAGLEWorkerV2(runner, model),
        server_args=SimpleNamespace(model_path=str(tiny_llama_dir), speculative_eagle_topk=1,
                                    tp_size=1, pp_size=1, disable_radix_cache=True),
    )  # fmt: skip
    engine = SGLangEngine(scheduler, settings)
    yield SimpleNamespace(engine=engine, pull=pull, taps=len(taps), h=cfg.hidden_size,
                          model=model, target=tiny_llama_dir, tmp=tmp_path,
                          control=control, loaded=loaded)  # fmt: skip
    engine.close()
    pull.close(0)


def forward(s, rows: list[tuple[int, int]], mode: Mode, per_request: int | None = None):
    """The target's forward over (token, position) rows, as SGLang's model runner returns it
    with codraft's plugin: hidden states [N, (taps + 1) * H]. A verification's output ends
    with a padding request's rows, as a CUDA graph's may."""
    if mode.is_target_verify():
        rows = rows + [(0, 0)] * per_request
    hs = torch.stack([feats(p, t, s.taps, s.h) for t, p in rows])
    fb = SimpleNamespace(input_ids=torch.tensor([t for t, _ in rows]),
                         positions=torch.tensor([p for _, p in rows]), forward_mode=mode,
                         batch_size=len(rows) // (per_request or 1),
                         spec_info=SimpleNamespace(draft_token_num=per_request,
                                                   ragged_verify_layout=None))  # fmt: skip
    return fb, SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hs))


def step(s, reqs, rows, extend, extend_lens=None, accept=None):
    e = s.engine
    batch = SimpleNamespace(reqs=reqs, forward_mode=Mode("EXTEND" if extend else "DECODE"),
                            extend_lens=extend_lens)  # fmt: skip
    e.on_batch(batch)
    per = None if extend else len(rows) // len(reqs)
    fb, out = forward(s, rows, Mode("EXTEND" if extend else "TARGET_VERIFY"), per)
    e.on_target_forward(fb, split_final(e.target_runner, out))
    # the draft reads the tap layers only
    assert out.logits_output.hidden_states.shape[-1] == s.taps * s.h
    result = SimpleNamespace(accept_lens=None if accept is None else torch.tensor(accept))
    e.end_batch(result)
    return batch, result


def messages(pull, n: int) -> dict:
    out = {}
    for _ in range(n):
        assert pull.poll(10_000), "no tap message arrived"
        m = decode(pull.recv_multipart())
        out[m.header.request_id] = m
    return out


@pytest.mark.parametrize(
    "setup", [{}, {"tap_assembly": "thread"}], indirect=True, ids=["process", "thread"]
)
def test_a_prefill_and_verifications_come_out_as_the_final_sequence_features(setup) -> None:
    """Two requests: one prefill, then verifications of k = 3 rows (a accepts 2 drafts then
    none, b none then 1), processed one step late as with SGLang's overlap scheduler; each
    message holds exactly the inputs of its final sequence, with their tap layers and final
    hidden state, and no rejected draft's row."""
    s = setup
    a, b = Req("a", [1, 2, 3]), Req("b", [7, 8])
    prev = step(s, [a, b], [(1, 0), (2, 1), (3, 2), (7, 0), (8, 1)], True, [3, 2])
    cur = step(s, [a, b], [(4, 3), (5, 4), (6, 5), (9, 2), (40, 3), (41, 4)], False,
               accept=[3, 1])  # fmt: skip
    s.engine.on_result(*prev)  # one step late
    a.output_ids, b.output_ids = [4, 5, 6, 10], [9, 11]
    prev, cur = cur, step(s, [a, b], [(10, 6), (99, 7), (98, 8), (11, 3), (13, 4), (97, 5)],
                          False, accept=[1, 2])  # fmt: skip
    s.engine.on_result(*prev)
    a.output_ids += [12]
    b.output_ids += [13, 14]
    a.done = b.done = True
    s.engine.on_result(*cur)
    got = messages(s.pull, 2)
    final = {"a": [1, 2, 3, 4, 5, 6, 10, 12], "b": [7, 8, 9, 11, 13, 14]}
    for rid, seq in final.items():
        m = got[rid]
        n = m.num_tokens
        assert m.token_ids.tolist() == seq[:n] and n >= len(seq) - 1
        want = torch.stack([feats(p, seq[p], s.taps, s.h) for p in range(n)])
        assert torch.equal(m.taps.float(), want[:, : s.taps * s.h])
        assert torch.equal(m.last_hidden.float(), want[:, s.taps * s.h :])
        assert m.header.draft_version == 0
    stats = s.engine.stats(flush=True)
    assert stats["tap"]["hook_errors"] == 0 and stats["tap"]["requests_captured"] == 2
    assert stats["tap"]["assembly"] == s.engine.cfg.tap_assembly, stats["tap"]
    acc = stats["acceptance"]["0"]
    assert acc["drafts"] == 4 and acc["accepted_tokens"] == 3  # (2 + 0) + (0 + 1)


@pytest.mark.parametrize(
    "setup", [{}, {"tap_assembly": "thread"}], indirect=True, ids=["process", "thread"]
)
def test_planted_off_by_one_in_the_accepted_length_is_caught(setup, monkeypatch) -> None:
    """Mutation check (planted from the test side): reading SGLang's accepted length as the
    number of accepted drafts (one row fewer per verification) sends requests short or not at
    all; the assembler's completeness rule and the features check above would both fail."""
    s = setup
    real = SGLangEngine._account

    def planted(self, p, result):
        if result.accept_lens is not None:
            result.accept_lens = result.accept_lens - 1
        return real(self, p, result)

    monkeypatch.setattr(SGLangEngine, "_account", planted)
    a = Req("a", [1, 2, 3])
    prev = step(s, [a], [(1, 0), (2, 1), (3, 2)], True, [3])
    cur = step(s, [a], [(4, 3), (5, 4), (6, 5)], False, accept=[3])
    s.engine.on_result(*prev)
    a.output_ids, a.done = [4, 5, 6, 7], True
    s.engine.on_result(*cur)
    s.engine.stats(flush=True)
    assert s.engine.stats_.requests_captured == 0 and s.engine.stats_.requests_incomplete == 1


def test_swap_and_rollback_write_the_draft_and_refuse_what_does_not_fit(setup) -> None:
    s, e = setup, setup.engine
    before = {n: p.clone() for n, p in s.model.named_parameters()}
    embed = s.model.embed.clone()
    v1 = write_new_draft(s.tmp / "v1", s.target, draft_vocab_size=DV, version=1, seed=1)
    # the learner's publish: prepare, read the staged state, swap (installs what was staged)
    ticket = e.handle("codraft_prepare_draft", {"path": str(v1), "version": 1})
    assert ticket["ok"] and ticket["version"] == 1, ticket
    assert e.handle("codraft_staged_draft", {})["staged"]["state"] == "ready"
    for name, key in s.model.names.items():  # nothing written yet
        assert torch.equal(getattr(s.model, key), before[key]), name
    reply = e.handle("codraft_swap_draft", {"path": str(v1), "version": 1})
    assert reply["ok"] and reply["draft"]["version"] == 1 and reply["prepared_ahead"], reply
    assert e.handle("codraft_staged_draft", {})["status"] == 404
    from safetensors.torch import load_file

    new = load_file(v1 / "model.safetensors")
    for name, key in s.model.names.items():
        assert torch.equal(getattr(s.model, key), new[name]), name
    assert torch.equal(s.model.embed, embed)  # the target's embedding is not the draft's
    # a stale version, a missing folder, another vocabulary map: refused, v1 keeps serving
    assert e.handle("codraft_swap_draft", {"path": str(v1), "version": 1})["status"] == 409
    assert e.handle("codraft_swap_draft", {"path": str(s.tmp / "nope")})["status"] == 404
    counts = torch.zeros(512, dtype=torch.int64)
    counts[100 : 100 + DV] = 1
    other = write_new_draft(s.tmp / "v2", s.target, counts, draft_vocab_size=DV, version=2)
    bad = e.handle("codraft_swap_draft", {"path": str(other), "version": 2})
    assert bad["status"] == 422 and "vocabulary map" in bad["error"]
    for name, key in s.model.names.items():
        assert torch.equal(getattr(s.model, key), new[name]), name
    assert e.handle("codraft_bogus", {})["status"] == 501
    # a name SGLang's loader would skip (its mapping changed): refused, nothing half-written
    s.model.skip = frozenset({"norm.weight"})
    v3 = write_new_draft(s.tmp / "v3", s.target, draft_vocab_size=DV, version=3, seed=3)
    half = e.handle("codraft_swap_draft", {"path": str(v3), "version": 3})
    assert half["status"] == 500 and "norm__weight" in half["error"], half
    s.model.skip = frozenset()
    for name, key in s.model.names.items():
        assert torch.equal(getattr(s.model, key), new[name]), name
    back = e.handle("codraft_rollback_draft", {})
    assert back["ok"] and back["draft"]["version"] == 0 and back["rolled_back_from"] == 1
    for n, p in s.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert e.handle("codraft_rollback_draft", {})["status"] == 409


def test_the_control_socket_answers_between_batches(setup) -> None:
    """The serving process's client (EngineControl's engine interface) against the engine's
    socket, which answers only when the scheduler polls it."""
    s = setup

    async def call() -> list[dict]:
        client = RpcClient(s.control)
        task = asyncio.create_task(client.collective_rpc("codraft_info", timeout=10))
        for _ in range(200):  # the scheduler's loop
            await asyncio.sleep(0.01)
            s.engine.poll()
            if task.done():
                break
        out = await task
        client.close()
        return out

    (info,) = asyncio.run(call())
    assert info["ok"] and info["draft"]["version"] == 0 and info["engine"] == "sglang"


def test_the_final_state_rides_along_with_the_captured_layers() -> None:
    """The plugin appends the final hidden state to SGLang's captured layers in either of
    SGLang's forms (a list, or one packed tensor) and leaves a forward that captured none."""
    h = [torch.ones(2, 3), 2 * torch.ones(2, 3)]
    final = 5 * torch.ones(2, 3)
    assert [t[0, 0].item() for t in _with_final(h, final)] == [1, 2, 5]
    packed = _with_final(torch.cat(h, dim=-1), final)
    assert packed.shape == (2, 9) and packed[0, -1].item() == 5
    assert _with_final(None, final) is None and _with_final([], final) == []


def test_settings_travel_through_the_environment(tmp_path: Path) -> None:
    s = Settings("d", "ipc:///x", EngineConfig(tap_sample_rate=0.5))
    back = Settings.from_env({ENV: s.to_env()})
    assert back == s and Settings.from_env({}) is None


def test_serve_gives_sglang_its_view_of_the_draft_and_says_what_it_cannot_do(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from codraft.draft.config import DraftConfig
    from codraft.server.serve_config import ServeConfig
    from codraft.server.sglang.serve import (
        main,
        sglang_argv,
        sglang_view,
        speculative_argv,
        unsupported,
    )

    draft = write_new_draft(tmp_path / "d", tiny_llama_dir, draft_vocab_size=DV)
    view = sglang_view(draft, tmp_path / "work")
    hf = json.loads((view / "config.json").read_text())
    ours = DraftConfig.from_hf_dict(json.loads((draft / "config.json").read_text()))
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        t - 1 for t in ours.tap_layers
    ]  # SGLang adds 1 to every id it reads
    assert (view / "model.safetensors").resolve() == (draft / "model.safetensors").resolve()
    cfg = ServeConfig(engine="sglang", tap_endpoint="tcp://127.0.0.1:5557", vllm_args=["--x"])
    spec = speculative_argv(draft, tmp_path / "work", 3)
    assert spec[spec.index("--speculative-draft-model-path") + 1] == str(view)
    argv = sglang_argv(cfg, tiny_llama_dir, spec)
    assert argv[-2:] == ["--disable-radix-cache", "--x"]  # the tap needs every row computed
    assert (
        "--speculative-eagle-topk" in argv
        and argv[argv.index("--speculative-eagle-topk") + 1] == "1"
    )
    assert unsupported(ServeConfig(engine="sglang", control_port=9000)) == []
    assert len(unsupported(ServeConfig(engine="sglang", weight_transfer="ipc"))) == 1
    # a DFlash draft: SGLang's DFlash reads codraft's folder as it is, a block per verification
    block = write_new_draft(tmp_path / "b", tiny_llama_dir, drafter="dflash", block_size=4)
    assert speculative_argv(block, tmp_path / "work", 3) == [
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(block),
        "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip
    assert SGLangEngine._check(DFlashWorkerV2(), SimpleNamespace()) == "dflash"
    with pytest.raises(SwapError, match="EAGLE-3 or DFlash"):
        SGLangEngine._check(SimpleNamespace(), SimpleNamespace())
    with pytest.raises(SwapError, match="topk=1"):
        SGLangEngine._check(EAGLEWorkerV2(None, None), SimpleNamespace(speculative_eagle_topk=4))
    with pytest.raises(ValueError, match="engine must be one of"):
        ServeConfig(engine="trt")
    # on this machine there is no SGLang: a clear refusal, no traceback
    assert main(ServeConfig(engine="sglang")) == 2


def test_a_policy_load_writes_the_target_only_and_drops_requests_it_split(
    setup, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A request running across a policy load is not sent (its features mix two policies);
    one started after it is, with the new policy's version. The target's runner reloads the
    folder (SGLang's own reload-from-disk route would load it into the draft too)."""
    from codraft.testing import make_tiny_target

    s, e = setup, setup.engine
    a = Req("a", [1, 2, 3])
    prev = step(s, [a], [(1, 0), (2, 1), (3, 2)], True, [3])
    reply = e.handle("codraft_load_policy", {"path": str(tiny_llama_dir), "version": 1})
    assert reply["ok"] and reply["policy"]["version"] == 1 and s.loaded == [str(tiny_llama_dir)]
    assert (
        e.handle("codraft_load_policy", {"path": str(tiny_llama_dir), "version": 1})["status"]
        == 409
    )
    other = make_tiny_target(tmp_path / "other", hidden_size=32)
    bad = e.handle("codraft_load_policy", {"path": str(other), "version": 2})
    assert bad["status"] == 422 and "architecture" in bad["error"]
    e.on_result(*prev)
    cur = step(s, [a], [(4, 3), (8, 4), (9, 5)], False, accept=[1])
    a.output_ids, a.done = [4, 10], True
    e.on_result(*cur)
    b = Req("b", [5, 6])
    cur = step(s, [b], [(5, 0), (6, 1)], True, [2])
    b.output_ids, b.done = [7], True
    e.on_result(*cur)
    got = messages(s.pull, 1)
    assert list(got) == ["b"] and got["b"].header.policy_version == 1
    assert e.stats(flush=True)["tap"]["requests_incomplete"] == 1


@pytest.fixture(scope="module")
def sglang_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SGLang 0.5.17's wheel from the package index (its Python source, read without importing:
    its modules need CUDA kernels)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("sglang-wheel")
    cmd = [sys.executable, "-m", "pip", "download", "sglang==0.5.17", "--no-deps", "-q",
           "--only-binary=:all:", "--python-version", "3.12",
           "--platform", "manylinux_2_34_x86_64", "-d", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    wheels = sorted(out.glob("sglang-0.5.17-*.whl"))
    if r.returncode != 0 or not wheels:
        pytest.skip(f"sglang 0.5.17's wheel could not be downloaded: {r.stderr[-500:]}")
    return wheels[0]


def test_codraft_touches_sglang_where_sglang_0_5_17_has_it(sglang_wheel: Path, monkeypatch) -> None:
    """Every hook target, the hooked signatures, the Llama call the final state rides on, and
    the attributes the engine reads, found in SGLang's source (scripts/gpu_sglang/
    check_sglang_src.py); a planted hook on a method SGLang does not have and a planted
    argument order are reported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "check_sglang_src", Path(__file__).parents[1] / "scripts/gpu_sglang/check_sglang_src.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = mod.Source(sglang_wheel)
    assert mod.check(src) == []
    from codraft.server.sglang import plugin

    bogus = ("sglang.srt.managers.scheduler.Scheduler.process_batch_results", None, "AFTER")
    monkeypatch.setattr(plugin, "HOOKS", (*plugin.HOOKS, bogus))
    sig = ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result")
    monkeypatch.setitem(mod.SIGNATURES, sig, ("result", "batch"))
    problems = mod.check(src)
    assert len(problems) == 2, problems
    assert "no method process_batch_results" in problems[0]
    assert "process_batch_result: positional parameters ['batch', 'result']" in problems[1]


@contextlib.contextmanager
def serving(s, app):
    """`app` on 127.0.0.1 under uvicorn (SGLang's HTTP server's stand-in) and a thread polling
    the engine between batches (its scheduler loop's); the base URL; both stopped at exit."""
    import threading
    import time

    import uvicorn

    from codraft.server.serve import free_port

    stop = threading.Event()

    def scheduler() -> None:
        while not stop.is_set():
            s.engine.poll()
            time.sleep(0.002)

    threading.Thread(target=scheduler, daemon=True).start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        stop.set()


def test_codraft_serve_routes_reach_the_engine_over_its_control_socket(setup, monkeypatch) -> None:
    """`codraft serve --engine sglang`'s wiring with a real HTTP server on 127.0.0.1: a FastAPI
    app with one OpenAI route stands in for SGLang's, a thread polling the engine stands in
    for SGLang's scheduler loop; codraft's routes, client, socket and engine are the real ones.
    The learner's publish (prepare, staged, swap), the version header, auth, rollback, metrics
    (in a process without vLLM, as SGLang's venv is: vLLM is made unimportable here)."""
    import sys
    import time

    import httpx
    from fastapi import FastAPI

    from codraft.client import CodraftClient
    from codraft.server.api import ControlSettings
    from codraft.server.sglang.serve import engine_info, install_codraft

    s = setup
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"id": "cmpl-1", "choices": [{"text": "x"}]}

    for name in {m for m in sys.modules if m.split(".")[0] == "vllm"} | {"vllm"}:
        monkeypatch.setitem(sys.modules, name, None)  # `import vllm...` raises ImportError
    token = "s3cret"
    control = install_codraft(app, s.control, token, ControlSettings(refresh_s=0.05))
    with serving(s, app) as base:
        control.draft_version = engine_info(s.control)["draft"]["version"]  # as ready() does
        client = CodraftClient(base, token=token)
        client.wait_ready(timeout=30)
        served = client.draft()
        assert served.version == 0 and served.vocab_map_fixed is True  # the learner keeps d2t
        v1 = write_new_draft(s.tmp / "v1", s.target, draft_vocab_size=DV, version=1, seed=1)
        assert client.publish_draft(1, str(v1)).version == 1
        r = httpx.post(f"{base}/v1/completions", json={})
        assert r.status_code == 200 and r.headers["x-codraft-draft-version"] == "1"
        assert httpx.post(f"{base}/v1/draft/rollback").status_code == 401
        assert client.rollback_draft().version == 0
        assert client.metrics()["codraft_draft_version"] == 0
        digest = httpx.get(f"{base}/v1/draft/digest", headers={"Authorization": f"Bearer {token}"})
        assert digest.status_code == 200 and digest.json()["version"] == 0, digest.text
        # a policy update through SGLang's own route, seen in the headers without a codraft call
        s.engine.policy_changed("tensor")
        deadline = time.monotonic() + 10
        while (
            policy := httpx.post(f"{base}/v1/completions", json={}).headers[
                "x-codraft-policy-version"
            ]
        ) != "1" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert policy == "1"
        # undefined target weights: generation refused at the edge, the way to mend them open
        s.engine.policy_broken = "the restore of policy v1 failed: load a policy or restart"
        while httpx.post(f"{base}/v1/completions", json={}).status_code != 503:
            assert time.monotonic() < deadline + 10, "the gate never closed"
            time.sleep(0.05)
        r = httpx.post(f"{base}/v1/completions", json={})
        assert "load a policy" in r.json()["error"]["message"] and r.headers["retry-after"]
        assert client.ready().ready is False
        assert httpx.post(f"{base}/v1/policy", json={}).status_code == 401  # reached the route
        s.engine.policy_broken = None
        while httpx.post(f"{base}/v1/completions", json={}).status_code != 200:
            assert time.monotonic() < deadline + 20, "the gate never opened"
            time.sleep(0.05)
        client.close()


def test_a_control_port_serves_the_control_routes_beside_sglangs_app(setup) -> None:
    """--control-port: the control routes on their own port, served by a second server that
    SGLang's app's lifespan runs (SGLang's own lifespan still runs inside it); the OpenAI port
    keeps /ready, /metrics and the version headers and no longer answers the control routes;
    both ports share one version cache (a swap shows in the next response's header); the
    control server stops with the app. FastAPI + uvicorn on 127.0.0.1 stand in for SGLang's
    HTTP server, a polling thread for its scheduler."""
    import contextlib

    import httpx
    from fastapi import FastAPI

    from codraft.client import CodraftClient
    from codraft.server.api import ControlSettings
    from codraft.server.sglang.serve import bind, engine_info, install_codraft

    s = setup
    ran = []

    @contextlib.asynccontextmanager
    async def sglang_lifespan(app):  # SGLang's app has one (its tokenizer manager's set-up)
        ran.append("up")
        yield
        ran.append("down")

    app = FastAPI(lifespan=sglang_lifespan)

    @app.post("/v1/completions")
    async def completions() -> dict:
        return {"id": "cmpl-1", "choices": [{"text": "x"}]}

    csock = bind("127.0.0.1", 0)
    cbase = f"http://127.0.0.1:{csock.getsockname()[1]}"
    control = install_codraft(app, s.control, None, ControlSettings(refresh_s=0.05), csock)
    with serving(s, app) as base:
        control.draft_version = engine_info(s.control)["draft"]["version"]
        client = CodraftClient(cbase)
        client.wait_ready(timeout=30)
        assert ran == ["up"]
        assert httpx.get(f"{base}/ready").status_code == 200
        assert httpx.get(f"{base}/v1/draft").status_code == 404  # not on the OpenAI port
        v1 = write_new_draft(s.tmp / "v1", s.target, draft_vocab_size=DV, version=1, seed=1)
        assert client.publish_draft(1, str(v1)).version == 1
        r = httpx.post(f"{base}/v1/completions", json={})
        assert r.headers["x-codraft-draft-version"] == "1"  # at once: one version cache
        assert "codraft_draft_version 1.0" in httpx.get(f"{base}/metrics").text
        client.close()
    assert ran == ["up", "down"]
    with pytest.raises(httpx.ConnectError):  # the control server went with the app
        httpx.get(f"{cbase}/ready", timeout=2)


def test_serve_refuses_sglangs_multi_process_front_ends_and_binds_the_control_port_first(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """`codraft serve --engine sglang`'s start: SGLang's multi-process HTTP front ends (each
    worker imports a fresh app, without codraft's routes) are refused with exit 2 before
    anything starts; --control-port is bound before SGLang starts (a taken port: exit 2).
    SGLang's parser and server are stood in (no SGLang here)."""
    import importlib.util

    from codraft.server.serve import free_port
    from codraft.server.serve_config import ServeConfig
    from codraft.server.sglang import serve
    from codraft.server.sglang.engine import ENV

    monkeypatch.setenv(ENV, "")  # main sets it for SGLang's scheduler; restored after
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "sglang" else real(n, *a)
    )
    front = SimpleNamespace(tokenizer_worker_num=1, enable_http2=False)
    monkeypatch.setattr(serve, "parse_sglang_args", lambda argv: front)
    started = []
    monkeypatch.setattr(serve, "run", lambda *a: started.append(a))
    draft = write_new_draft(tmp_path / "v0", tiny_llama_dir, draft_vocab_size=DV, version=0)

    def cfg(**kw) -> ServeConfig:
        return ServeConfig(engine="sglang", model=str(tiny_llama_dir), draft=str(draft),
                           work_dir=str(tmp_path / "work"), resume_draft=False, **kw)  # fmt: skip

    front.tokenizer_worker_num = 2
    assert serve.main(cfg()) == 2 and not started
    front.tokenizer_worker_num, front.enable_http2 = 1, True
    assert serve.main(cfg()) == 2 and not started
    front.enable_http2 = False
    port = free_port()
    assert serve.main(cfg(control_port=port)) == 0
    csock = started[-1][5]  # run(cfg, server_args, token, endpoint, record, csock, store)
    assert started[-1][6].name.startswith("drafts-")
    assert csock.getsockname()[1] == port
    assert serve.main(cfg(control_port=port)) == 2  # taken
    csock.close()


def test_on_a_gpu_the_engine_is_lossless_captures_exactly_and_swaps(tmp_path: Path) -> None:
    """The GPU half of these tests: greedy outputs identical to SGLang without speculation,
    every captured row equal to a fresh prefill's, a swapped draft changing acceptance and a
    rollback restoring it (scripts/gpu_sglang/engine_checks.py, on SmolLM2). Runs where SGLang
    and CUDA are; on the CPU it is skipped, saying why."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip(
            "SGLang runs on CUDA machines only (no CPU build of its kernels reaches this "
            "machine): on the H200 run scripts/gpu_sglang/engine_checks.py (docs/sglang.md)"
        )
    repo = Path(__file__).parents[1]
    work = repo / "runs" / "gpu_work" / "sgl"
    if not (work / "target" / "config.json").is_file():
        pytest.skip(f"no prepared target at {work}: run eagle3_smoke.py prepare first")
    r = subprocess.run(
        [sys.executable, str(repo / "scripts/gpu_sglang/engine_checks.py"), "--work", str(work),
         "--out", str(tmp_path), "--prompts", "8", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=1800, cwd=repo,
    )  # fmt: skip
    report = json.loads((tmp_path / "sglang_engine_checks.json").read_text())
    assert r.returncode == 0, report.get("checks")


def test_sglang_memory_release_keeps_the_draft_and_its_own_weight_routes_leave_it(
    setup, monkeypatch
) -> None:
    """SGLang's release/resume of memory keeps the target's non-parameter state and nothing of
    the draft's: codraft keeps the draft on the host and writes it back (here the release is
    played by overwriting the draft's memory). SGLang's own target-weight routes become policy
    versions, and its reloads of the speculative worker's draft leave codraft's draft alone."""
    from codraft.server.sglang import plugin

    s, e = setup, setup.engine
    before = e.handle("codraft_draft_digest", {})
    assert before["ok"] and before["tensors"] and not any("embed" in n for n in before["tensors"])
    kept = {n: p.clone() for n, p in s.model.named_parameters()}
    monkeypatch.setattr(plugin, "_engine", e)
    original = lambda manager, req: None  # noqa: E731 (SGLang's release, played below)
    plugin._release(original, None, SimpleNamespace(tags=["kv_cache"]))
    assert e.sleep_copy is None  # the weights stay: nothing to keep
    plugin._release(original, None, SimpleNamespace(tags=None))
    with torch.no_grad():
        for name, p in s.model.named_parameters():
            if name != "embed":
                p.fill_(float("nan"))  # memory mapped again with undefined contents
    plugin._resume(None, None, SimpleNamespace(tags=["weights"]))
    for name, p in s.model.named_parameters():
        assert torch.equal(p, kept[name]), name
    assert e.handle("codraft_draft_digest", {})["tensors"] == before["tensors"]
    # SGLang's own routes
    plugin._target_updated("tensor")(SimpleNamespace(success=True), None)
    plugin._target_updated("disk")(SimpleNamespace(success=False), None)
    assert e.info()["policy"]["version"] == 1 and e.info()["policy"]["path"] == "sglang:tensor"
    assert plugin._draft_kept(lambda *a: (False, "loaded"), None, None)[0] is True
    to_target = SimpleNamespace(target_worker=SimpleNamespace(
        update_weights_from_tensor=lambda req: (True, "target")))  # fmt: skip
    assert plugin._tensor_to_target(lambda *a: (True, "both"), to_target, None) == (True, "target")


@pytest.mark.parametrize(
    "setup",
    [{"tap_max_tokens": 4}, {"tap_max_tokens": 4, "tap_assembly": "thread"}],
    indirect=True,
    ids=["process", "thread"],
)
def test_a_long_request_goes_out_in_chunks_while_it_runs(setup) -> None:
    """With messages of at most 4 tokens, a request's first chunks go out before it finishes;
    each is checked against the tokens SGLang has appended to the request's output ids so
    far (given to the capture step by step): every chunk arrives, none counted inconsistent."""
    s, e = setup, setup.engine
    a = Req("a", [1, 2, 3])
    prev = step(s, [a], [(1, 0), (2, 1), (3, 2)], True, [3])
    cur = step(s, [a], [(4, 3), (5, 4), (6, 5)], False, accept=[3])
    a.output_ids = [4]  # SGLang appends as it processes each step's result
    e.on_result(*prev)
    prev, cur = cur, step(s, [a], [(7, 6), (8, 7), (9, 8)], False, accept=[3])
    a.output_ids += [5, 6, 7]
    e.on_result(*prev)
    e.stats(flush=True)  # rows 0..6 are known, chunks 0..3 and 4..7 can go out before the end
    a.output_ids += [8, 9, 10]
    a.done = True
    e.on_result(*cur)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    got = []
    while s.pull.poll(2000):
        got.append(decode(s.pull.recv_multipart()))
    assert e.stats(flush=True)["tap"]["requests_inconsistent"] == 0
    ids = [t for m in got for t in m.token_ids.tolist()]
    assert len(got) >= 2 and ids == seq[: len(ids)] and len(ids) >= len(seq) - 1, ids


@pytest.mark.parametrize(
    "setup", [{}, {"tap_assembly": "thread"}], indirect=True, ids=["process", "thread"]
)
def test_every_request_of_a_batch_after_a_warm_up_is_delivered(setup) -> None:
    """As the GPU checks serve: SGLang's warm-up request (one token, finished with its
    prefill), then 16 requests prefilled together, the first with the longest prompt, then
    verifications until all finish in the same step. Every request's message arrives, the
    first's included (on an H100 in float32 the checks' sink once never got it)."""
    s, e = setup, setup.engine
    warm = Req("warm", [5, 6, 7])
    prev = step(s, [warm], [(5, 0), (6, 1), (7, 2)], True, [3])
    warm.output_ids, warm.done = [8], True
    e.on_result(*prev)
    lens = [2500] + [140 + i for i in range(15)]
    reqs = [Req(f"r{i}", [1 + j % 50 for j in range(n)]) for i, n in enumerate(lens)]
    rows = [(t, p) for r in reqs for p, t in enumerate(r.origin_input_ids)]
    prev = step(s, reqs, rows, True, lens)
    for r in reqs:
        r.output_ids = [60]
    for k in range(8):  # k = 3 rows a request, no draft accepted
        verify = []
        for r in reqs:
            n = len(r.origin_input_ids) + len(r.output_ids) - 1
            verify += [(r.output_ids[-1], n), (99, n + 1), (98, n + 2)]
        cur = step(s, reqs, verify, False, accept=[1] * len(reqs))
        e.on_result(*prev)
        for r in reqs:
            r.output_ids = [*r.output_ids, 61 + k]
            r.done = k == 7
        prev = cur
    e.on_result(*prev)
    got: dict[str, int] = {}
    while s.pull.poll(3000):
        m = decode(s.pull.recv_multipart())
        got[m.header.request_id] = got.get(m.header.request_id, 0) + m.num_tokens
    assert set(got) == {"warm", *(r.rid for r in reqs)}, sorted(got)
    for r in reqs:  # the whole sequence but the last token (never an input)
        assert got[r.rid] == len(r.origin_input_ids) + len(r.output_ids) - 1
    assert e.stats(flush=True)["tap"]["requests_incomplete"] == 0


@pytest.mark.parametrize(
    "setup", [{}, {"tap_assembly": "thread"}], indirect=True, ids=["process", "thread"]
)
def test_a_prefill_chunked_over_two_steps_comes_out_whole(setup) -> None:
    """SGLang's chunked prefill: a prompt longer than the step's token budget is extended in
    two steps, its first chunk beside other requests' whole prompts (no token appended for
    it), its rest alone in the next step (its first output token then), before the batch
    decodes. Its message carries every row of both chunks, once, in order."""
    s, e = setup, setup.engine
    long, short = Req("long", [1 + j % 50 for j in range(40)]), Req("short", [7, 8, 9])
    first = [(t, p) for p, t in enumerate(long.origin_input_ids[:25])]
    first += [(t, p) for p, t in enumerate(short.origin_input_ids)]
    prev = step(s, [long, short], first, True, [25, 3])
    rest = [(t, p) for p, t in enumerate(long.origin_input_ids) if p >= 25]
    cur = step(s, [long], rest, True, [15])
    short.output_ids = [60]  # the chunked request gets no token from its first chunk
    e.on_result(*prev)
    prev = cur
    n_long = len(long.origin_input_ids)
    verify = [(61, n_long), (99, n_long + 1), (98, n_long + 2), (60, 3), (99, 4), (98, 5)]
    cur = step(s, [long, short], verify, False, accept=[1, 1])
    long.output_ids = [61]
    e.on_result(*prev)
    long.output_ids, short.output_ids = [61, 62], [60, 63]
    long.done = short.done = True
    e.on_result(*cur)
    got = {}
    while s.pull.poll(3000):
        m = decode(s.pull.recv_multipart())
        got[m.header.request_id] = m
    assert e.stats(flush=True)["tap"]["requests_incomplete"] == 0
    assert set(got) == {"long", "short"}, sorted(got)
    m = got["long"]
    assert m.token_ids.tolist() == [*long.origin_input_ids, 61]
    expected = torch.stack([feats(p, t, s.taps, s.h) for p, t in
                            enumerate([*long.origin_input_ids, 61])])  # fmt: skip
    taps = torch.as_tensor(m.taps).reshape(len(expected), -1).float()
    assert torch.allclose(taps, expected[:, : s.taps * s.h])
