"""Correctness of codraft's engine in vLLM's default mode (torch.compile, CUDA graphs, async
scheduling, the model runner vLLM picks), on tiny random Llama models built here. Each engine
runs in a subprocess of its own; everything is recorded in `<out>/checks.json`.

* `sampling`: sampled tokens stay the target's. One prompt, temperature 1, `--samples`
  requests of 4 tokens, with a draft that proposes one fixed token (codraft.testing's agreeing
  draft: token 300 at probability ~0.997 under its own softmax), three engines, each with its
  own seed: plain vLLM without speculation, plain vLLM with that draft, codraft's engine
  (`codraft serve`'s engine arguments, tap on) with it. At every output position, a two-sample
  chi-square test of the token distribution against no speculation (categories with fewer than
  5 expected samples pooled), and how often the proposed token was drawn.
* `swap`: a swap under graphs changes what is proposed, not only what is loaded. The target
  always emits token 300 (codraft.testing.make_constant_target); the engine starts with a random
  draft (acceptance length ~1), swaps in the agreeing draft (~k+1), rolls back (~1), then stages
  and commits another agreeing copy (two-phase swap). Greedy outputs stay the constant target's
  throughout. Then a policy reload to the random target: outputs must equal plain vLLM's on
  that target (same engine mode), with the draft still serving. Captured features of the
  constant phase against a fresh fp32 prefill of codraft's own target model.

    .gpu_venv/bin/python scripts/gpu_vllm/engine_checks.py --out runs/checks [--checks swap]

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

CHECKS = ("sampling", "swap")
PROMPT = [5, 17, 42, 99, 7, 3]
K = 3


# ---------------------------------------------------------------------------- statistics
def chi_square(a: Counter, b: Counter) -> tuple[float, int, float]:
    """Two-sample chi-square test of homogeneity: (statistic, degrees of freedom, p-value).
    Categories with fewer than 5 expected samples in either sample are pooled into one."""
    import torch

    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    rows, pooled = [], [0, 0]
    for k in keys:
        total = a[k] + b[k]
        if min(total * na, total * nb) / (na + nb) < 5:
            pooled[0] += a[k]
            pooled[1] += b[k]
        else:
            rows.append((a[k], b[k]))
    if sum(pooled):
        rows.append(tuple(pooled))
    stat = 0.0
    for x, y in rows:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = max(len(rows) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))  # fmt: skip
    return stat, df, p


# ---------------------------------------------------------------------------- engines
def _llm(
    target: str, draft: str | None, codraft: bool, tap: str | None, eager: bool, seed: int = 0
):
    from vllm import LLM

    from codraft.server.compat import apply_engine_env

    apply_engine_env()
    common: dict[str, Any] = dict(
        dtype="float32", max_model_len=256, max_num_seqs=64, enable_prefix_caching=False,
        gpu_memory_utilization=0.15, enforce_eager=eager, seed=seed,
    )  # fmt: skip
    if codraft:
        from codraft.server.serve_config import ServeConfig, offline_engine_kwargs

        cfg = ServeConfig(draft=draft, num_speculative_tokens=K, tap_endpoint=tap,
                          dtype="float32", max_model_len=256)  # fmt: skip
        kwargs = {**offline_engine_kwargs(cfg, Path(target), Path(str(draft))), **common}
        kwargs["additional_config"]["codraft"].update(auto_rollback=False)
        return LLM(**kwargs)
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": K} if draft else None
    return LLM(model=target, speculative_config=spec, **common)


def _ids(outs: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def worker_sampling(job: dict) -> dict:
    from vllm import SamplingParams

    llm = _llm(
        job["target"], job.get("draft"), job["codraft"], job.get("tap"), job["eager"], job["seed"]
    )
    if job["codraft"]:
        assert llm.collective_rpc("codraft_info")[0]["ok"]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}] * job["samples"]
    t0 = time.perf_counter()
    outs = _ids(llm.generate(prompts, params, use_tqdm=False))
    res: dict[str, Any] = {"outputs": outs, "seconds": time.perf_counter() - t0}
    if job["codraft"]:
        res["stats"] = llm.collective_rpc("codraft_stats", kwargs={"flush": True})[0]
    return res


def worker_swap(job: dict) -> dict:
    from vllm import SamplingParams

    from codraft.tap import decode

    messages: list = []
    stop = threading.Event()
    endpoint = job.get("tap")

    def receive() -> None:
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(endpoint)
        while not stop.is_set():
            if sock.poll(100):
                messages.append(decode(sock.recv_multipart()))
        sock.close(linger=0)
        ctx.term()

    if endpoint:
        rx = threading.Thread(target=receive, daemon=True)
        rx.start()
    llm = _llm(job["target"], job.get("draft"), job["codraft"], endpoint, job["eager"])
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": [p + i for p in PROMPT]} for i in range(16)]
    if not job["codraft"]:
        return {"outputs": _ids(llm.generate(prompts, greedy, use_tqdm=False))}

    def rpc(name: str, **kwargs: Any) -> dict:
        return llm.collective_rpc(name, kwargs=kwargs)[0]

    def phase(name: str, **extra: Any) -> dict:
        before = rpc("codraft_stats")["acceptance"]
        outs = _ids(llm.generate(prompts, greedy, use_tqdm=False))
        after = rpc("codraft_stats", flush=True)
        version = str(after["draft_version"])
        a, b = after["acceptance"].get(version, {}), before.get(version, {})
        drafts = a.get("drafts", 0) - b.get("drafts", 0)
        accepted = a.get("accepted_tokens", 0) - b.get("accepted_tokens", 0)
        length = 1 + accepted / drafts if drafts else None
        return {"name": name, "draft_version": after["draft_version"], "outputs": outs,
                "acceptance_length": length, **extra}  # fmt: skip

    phases = [phase("start")]
    phases.append(phase("swap", reply=rpc("codraft_load_draft", path=job["agree"], version=1)))
    phases.append(phase("rollback", reply=rpc("codraft_rollback_draft", reason="check")))
    ticket = rpc("codraft_prepare_draft", path=job["agree2"], version=2)
    for _ in range(2000):
        commit = rpc("codraft_commit_draft", ticket=ticket["ticket"])
        if not (commit.get("ok") and not commit.get("ready")):
            break
        time.sleep(0.005)
    phases.append(phase("two-phase swap", reply=commit))
    phases.append(phase("policy", reply=rpc("codraft_load_policy", path=job["policy"], version=1)))
    stats = rpc("codraft_stats", flush=True)
    time.sleep(1.0)
    stop.set()
    for p in phases:
        p.get("reply", {}).pop("draft", None)
    return {"phases": phases, "stats": stats, "messages": [_message(m) for m in messages]}


def _message(m: Any) -> dict:
    return {
        "request_id": m.header.request_id,
        "policy_version": m.header.policy_version,
        "tap_layers": list(m.header.tap_layers),
        "ids": m.token_ids.tolist(),
        "taps": m.taps.tolist() if m.taps is not None else None,
        "last": m.last_hidden.tolist() if m.last_hidden is not None else None,
    }


def run_job(kind: str, job: dict, work: Path, timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    spec, out, log = (work / f"{job['name']}{s}" for s in (".job.json", ".out.json", ".log"))
    spec.write_text(json.dumps(job))
    out.unlink(missing_ok=True)
    with open(log, "w") as f:
        # A session of its own: the worker leaves with os._exit, and the engine's own processes
        # (EngineCore, VllmWorker) would outlive it holding their memory; the group goes with it.
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, str(spec), str(out)],
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{job['name']} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------- checks
def models(work: Path) -> dict[str, str]:
    from codraft.draft.init import write_new_draft
    from codraft.testing import make_agreeing_draft, make_constant_target, make_tiny_target

    work.mkdir(parents=True, exist_ok=True)
    target = make_tiny_target(work / "target", arch="llama")
    constant = work / "constant"
    if not (constant / "config.json").is_file():
        make_constant_target(target, constant)
    out = {"target": str(target), "constant": str(constant)}
    for name, version in (("agree", 1), ("agree2", 2)):
        d = work / name
        if not (d / "codraft.json").is_file():
            make_agreeing_draft(constant, d)
        meta = json.loads((d / "codraft.json").read_text())
        meta["version"] = version
        (d / "codraft.json").write_text(json.dumps(meta))
        out[name] = str(d)
    random_draft = work / "random"
    if not (random_draft / "codraft.json").is_file():
        write_new_draft(random_draft, constant, draft_vocab_size=64, seed=3)
    out["random"] = str(random_draft)
    return out


def check_sampling(m: dict, args: argparse.Namespace, work: Path) -> dict:
    common = {"target": m["target"], "samples": args.samples, "eager": args.eager}
    # each engine its own seed: the samples compared are independent (with one seed vLLM's
    # seeded sampler draws nearly the same tokens in every arm, and the test would say little)
    arms = {
        "no speculation": {**common, "name": "sampling-base", "codraft": False, "seed": 1},
        "vLLM EAGLE-3": {**common, "name": "sampling-eagle3", "codraft": False,
                         "draft": m["agree"], "seed": 2},
        "codraft": {**common, "name": "sampling-codraft", "codraft": True, "draft": m["agree"],
                    "tap": f"tcp://127.0.0.1:{_free_port()}", "seed": 3},
    }  # fmt: skip
    runs = {k: run_job("sampling", job, work, args.timeout) for k, job in arms.items()}
    from codraft.testing import CONSTANT_TOKEN

    base = runs["no speculation"]["outputs"]
    report: dict[str, Any] = {"samples": args.samples, "proposed_token": CONSTANT_TOKEN}
    ok = True
    for name in ("vLLM EAGLE-3", "codraft"):
        outs = runs[name]["outputs"]
        rows = []
        for pos in range(4):
            a = Counter(o[pos] for o in base if len(o) > pos)
            b = Counter(o[pos] for o in outs if len(o) > pos)
            stat, df, p = chi_square(a, b)
            drawn = [a[CONSTANT_TOKEN], b[CONSTANT_TOKEN]]
            rows.append({"position": pos + 1, "chi2": stat, "df": df, "p": p,
                         "proposed_token_drawn": drawn})  # fmt: skip
        report[name] = {"positions": rows, "seconds": runs[name]["seconds"]}
        if name == "codraft":
            st = runs[name]["stats"]
            report[name]["acceptance"] = st.get("acceptance")
            report[name]["hooks"] = st.get("hooks")
            ok = all(r["p"] > 1e-3 for r in rows)
    report["ok"] = ok
    return report


def check_swap(m: dict, args: argparse.Namespace, work: Path) -> dict:
    from codraft.testing import CONSTANT_TOKEN

    tap = f"tcp://127.0.0.1:{_free_port()}"
    ref = run_job("swap", {"name": "swap-ref", "target": m["target"], "codraft": False,
                           "eager": args.eager}, work, args.timeout)  # fmt: skip
    job = {"name": "swap-codraft", "target": m["constant"], "draft": m["random"], "codraft": True,
           "tap": tap, "eager": args.eager, "agree": m["agree"], "agree2": m["agree2"],
           "policy": m["target"]}  # fmt: skip
    run = run_job("swap", job, work, args.timeout)
    al = {p["name"]: p["acceptance_length"] for p in run["phases"]}
    constant_ok = all(
        all(t == CONSTANT_TOKEN for o in p["outputs"] for t in o)
        for p in run["phases"]
        if p["name"] != "policy"
    )
    policy = next(p for p in run["phases"] if p["name"] == "policy")
    policy_ok = policy["outputs"] == ref["outputs"]
    swaps_ok = (
        al["start"] < 1.5 and al["swap"] > K and al["rollback"] < 1.5 and al["two-phase swap"] > K
    )
    capture = capture_error({0: m["constant"], 1: m["target"]}, run["messages"])
    capture["rows_via"] = (run["stats"].get("tap") or {}).get("rows_via")  # "device ring"
    report = {
        "acceptance_length": al,
        "draft_versions": [p["draft_version"] for p in run["phases"]],
        "replies_ok": [p.get("reply", {}).get("ok", True) for p in run["phases"]],
        "outputs_constant_through_swaps": constant_ok,
        "policy_outputs_equal_plain_vllm": policy_ok,
        "capture": capture,
        "stats": {k: run["stats"].get(k) for k in ("tap", "hooks", "swaps", "rollbacks")},
    }
    report["ok"] = bool(constant_ok and policy_ok and swaps_ok and capture["ok"])
    return report


def capture_error(targets: dict[int, str], messages: list[dict]) -> dict:
    """Captured features of each request against one fresh fp32 prefill of codraft's own model
    of the policy that served it (the constant target's features are its embeddings; the random
    target's go through every layer). The bound is relative to the reference's largest value:
    vLLM's fp32 kernels on a GPU (TF32 matrix products, Triton attention) round differently from
    the CPU reference by about 1e-3 of the values' scale; a wrong row is off by its whole scale."""
    import torch

    from codraft.models.llama import load_target

    models = {v: load_target(t) for v, t in targets.items()}
    worst = worst_rel = 0.0
    n = 0
    with torch.no_grad():
        for msg in messages:
            model = models.get(msg["policy_version"])
            if model is None or msg["taps"] is None or "#" in msg["request_id"]:
                continue
            ids = torch.tensor([msg["ids"]])
            ref = model(ids, tap_layers=msg["tap_layers"], return_logits=False)
            for got, want in ((msg["taps"], ref.taps[0]), (msg["last"], ref.last_hidden[0])):
                err = float((torch.tensor(got) - want).abs().max())
                worst = max(worst, err)
                worst_rel = max(worst_rel, err / max(float(want.abs().max()), 1e-6))
            n += 1
    by_policy = Counter(m["policy_version"] for m in messages)
    return {"requests": n, "by_policy": dict(by_policy), "max_abs_error": worst,
            "max_rel_error": worst_rel, "ok": n > 0 and worst_rel < 1e-2}  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/checks")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per engine")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "JOB", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        kind, job, out = args.worker
        fn = {"sampling": worker_sampling, "swap": worker_swap}[kind]
        Path(out).write_text(json.dumps(fn(json.loads(Path(job).read_text()))))
        os._exit(0)  # skip the engines' interpreter teardown: everything is written
    out = Path(args.out).resolve()
    work = out / "work"
    m = models(work / "models")
    report: dict[str, Any] = {"command": " ".join([Path(sys.executable).name, *sys.argv])}
    for name in [c for c in args.checks.split(",") if c]:
        t0 = time.perf_counter()
        try:
            report[name] = {"sampling": check_sampling, "swap": check_swap}[name](m, args, work)
        except Exception as e:
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: report[name]}, indent=1, default=str)[:6000], flush=True)
        (out / "checks.json").write_text(json.dumps(report, indent=1, default=str))
    ok = all(report[c].get("ok") for c in report if c != "command")
    print(f"checks: {'ok' if ok else 'FAILED'} -> {out / 'checks.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
