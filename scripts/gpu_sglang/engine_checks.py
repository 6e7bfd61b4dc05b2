"""codraft's SGLang engine on the GPU: `codraft serve --engine sglang` checked end to end.

In the SGLang venv (scripts/gpu_sglang/install.sh links codraft into it), after
`eagle3_smoke.py prepare` wrote the target under --work:

    .gpu_sglang_venv/bin/python scripts/gpu_sglang/engine_checks.py --work runs/gpu_work/sgl \\
        --out "$OUT" --trained runs/gpu_work/sgl-cotrain/draft-final

1. **Reference**: stock SGLang without speculation (`sglang.Engine`), greedy, --prompts held-out
   questions x --max-tokens tokens (ignore_eos), batched.
2. **codraft serve --engine sglang** with codraft's untrained EAGLE-3 draft (v0), the tap on to
   a PULL socket this script binds, the radix cache off (so a fresh prefill computes every
   position). The same requests through SGLang's /generate: outputs identical to the
   reference (lossless), acceptance from each response's counts.
3. **Capture = fresh prefill**: every tap message of those requests against the message of a
   fresh prefill of the final sequence (the same request's tokens sent again as a prompt,
   one token generated), position by position: the tap layers and the final hidden state of
   each input the decode captured (max relative error per row, bf16 kernels of other batch
   shapes), and the token ids.
4. **Swap**: with --trained (a codraft EAGLE-3 checkpoint, e.g. cotrain.py --engine sglang's
   draft-final): `POST /v1/draft` while serving, the same requests again (outputs identical
   to the reference, acceptance against v0's), then `POST /v1/draft/rollback` and once more
   (back to v0's acceptance); a draft with another vocabulary map or from another target is
   refused with the previous draft serving.
5. /v1/completions carries X-Codraft-Draft-Version; the server's stats (GET /v1/tap) count the
   captured requests and no hook errors.

In bf16 a verification runs SGLang's extend kernels where plain decoding runs its decode
kernels, and near-tied choices move, stock speculation's as much as codraft's: outputs are then
held to stock SGLang speculating with the same draft. `--dtype float32` runs every arm in
float32, the ops sgl_kernel has no float32 kernel for through SGLang's own torch code
(`native_ops/sitecustomize.py`, a check-side shim), Triton's float32 dots at IEEE precision
rather than its TF32 default (TRITON_F32_DEFAULT=ieee), and holds every served draft's outputs
to plain SGLang's (`lossless_<draft>`).

Writes $OUT/sglang_engine_checks.json; exit 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "gpu_vllm"))  # make_prompts, stages
sys.path.insert(0, str(HERE))
from stages import Stages  # noqa: E402


def joined(msgs: list[Any]) -> dict[int, tuple[int, Any, Any]]:
    """position -> (token id, taps row, last row) over a request's messages (chunks in order)."""
    out, pos = {}, 0
    for m in sorted(msgs, key=lambda m: m.header.created):
        for i in range(m.num_tokens):
            out[pos + i] = (int(m.token_ids[i]), m.taps[i].float(), m.last_hidden[i].float())
        pos += m.num_tokens
    return out


def compare_capture(decoded: list[Any], fresh: list[Any], tol: float) -> dict[str, Any]:
    """A request's captured rows against the fresh prefill's, position by position. bf16 kernels
    of other batch shapes (a verification, a prefill) differ by a few percent of a row's
    largest entry; a row of another position differs by far more. So besides the a-priori
    `tol`, each row must be nearer its own position's fresh row than any captured row is to
    the next position's (the margin a misplaced row would cross)."""
    a, b = joined(decoded), joined(fresh)
    common = sorted(set(a) & set(b))

    def rel(x: Any, y: Any) -> float:
        return float((x - y).abs().max() / y.abs().max().clamp_min(1e-6))

    tap_err, last_err, shifted, id_mismatch = [], [], [], 0
    for p in common:
        ta, xa, la = a[p]
        tb, xb, lb = b[p]
        id_mismatch += ta != tb
        tap_err.append(rel(xa, xb))
        last_err.append(rel(la, lb))
        if p + 1 in b:  # the row one position on, all its layers: what an off-by-one gives
            shifted.append(max(rel(xa, b[p + 1][1]), rel(la, b[p + 1][2])))
    worst = max(tap_err + last_err) if common else None
    median = sorted(tap_err + last_err)[len(common)] if common else None
    floor = min(shifted) if shifted else None
    return {
        "positions": len(a), "fresh_positions": len(b), "common": len(common),
        "token_id_mismatches": id_mismatch,
        "taps_max_rel_err": max(tap_err) if tap_err else None,
        "last_max_rel_err": max(last_err) if last_err else None,
        "median_rel_err": median, "next_position_min_rel_err": floor,
        "within_tol": worst is not None and worst <= tol,
        "ok": bool(common) and id_mismatch == 0 and worst is not None and floor is not None
        and worst < floor and len(common) >= len(a) - 1,
    }  # fmt: skip


def kept_or(path: Path, key: dict, name: str, fn: Any, stages: Stages) -> Any:
    """`name`'s value kept in `path` by an earlier call with the same `key` (the settings it
    depends on), or stage `name` run now (fn()) and its value kept there beside the others of
    that key; None when the stage failed."""
    have = json.loads(path.read_text()) if path.is_file() else {}
    if have.get("key") == key and name in have:
        stages.report["stages"][name] = {"seconds": 0.0, "kept_from": str(path)}
        return have[name]
    value = stages.run(name, fn)
    if value is not None:
        have = have if have.get("key") == key else {"key": key}
        path.write_text(json.dumps({**have, name: value}))
    return value


def acceptance(outs: list[dict]) -> float | None:
    metas = [o.get("meta_info") or {} for o in outs]
    verify = sum(m.get("spec_verify_ct", 0) for m in metas)
    correct = sum(m.get("spec_num_correct_drafts", 0) for m in metas)
    return 1 + correct / verify if verify else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--work", default="runs/gpu_work/sgl")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--draft",
        default=None,
        help="the draft served at start (default: --work/draft, eagle3_smoke.py prepare's "
        "untrained EAGLE-3 one; a DFlash folder runs SGLang's DFlash)",
    )
    p.add_argument("--k", type=int, default=3, help="EAGLE-3 drafts per step")
    p.add_argument("--trained", default=None, help="a newer checkpoint of the same kind")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--capture-checks", type=int, default=4, help="requests checked vs prefill")
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--mem-fraction", type=float, default=0.3)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"),
        help="float32: every arm runs the ops of --native-ops through SGLang's torch code "
        "(native_ops/sitecustomize.py), and greedy outputs must equal plain SGLang's",
    )  # fmt: skip
    p.add_argument(
        "--native-ops", default="RMSNorm,SiluAndMul,RotaryEmbedding",
        help="with --dtype float32: SGLang op classes run through forward_native on float32",
    )  # fmt: skip
    p.add_argument("--ready-timeout", type=float, default=420.0)
    p.add_argument(
        "--references", action=argparse.BooleanOptionalAction, default=True,
        help="stock SGLang with and without speculation first (eagle3_smoke.py run --codraft "
        "compares the same arms batch by batch: --no-references saves their two starts)",
    )  # fmt: skip
    args = p.parse_args()

    import httpx
    from eagle3_smoke import TapSink, heldout_prompt_ids

    from codraft.client import CodraftClient
    from codraft.server.serve import free_port
    from codraft.server.sglang.serve import parse_sglang_args, speculative_argv

    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args)}
    # written as each stage starts and ends: a run cut off mid-way still says how far it came
    stages = Stages(report, "engine", out / "sglang_engine_checks.json")
    target = work / "target"
    draft = Path(args.draft or work / "draft").resolve()
    prompts = heldout_prompt_ids(target)[: args.prompts]
    params = {"temperature": 0.0, "max_new_tokens": args.max_tokens, "ignore_eos": True}
    checks: dict[str, bool] = {}
    if args.dtype == "float32":  # in every process SGLang starts from here on
        shim = str(HERE / "native_ops")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [shim, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        os.environ["CODRAFT_CHECK_NATIVE_OPS"] = args.native_ops
        # Triton's tl.dot takes float32 inputs at TF32 precision unless told otherwise, and
        # SGLang's Triton attention kernels do not say: its extend (a verification) and decode
        # kernels would then round at 1e-3, far above float32's. IEEE dots in every arm, from
        # a Triton cache of their own (a kernel compiled with TF32 dots is never reused here).
        os.environ["TRITON_F32_DEFAULT"] = "ieee"
        os.environ["TRITON_CACHE_DIR"] = str(work / "triton-f32-ieee")

    def reference(speculative: list[str] = ()) -> list[list[int]]:
        """Stock SGLang's greedy outputs; `speculative`: its speculative arguments. The radix
        cache off, as in codraft's server below: a prefix served from the cache is computed
        by other kernels, which moves bf16 ties."""
        import sglang

        server_args = parse_sglang_args([
            "--model-path", str(target), "--dtype", args.dtype, "--random-seed", "0",
            "--log-level", "warning", "--mem-fraction-static", str(args.mem_fraction),
            "--attention-backend", args.attention_backend, "--disable-radix-cache",
            *speculative,
        ])  # fmt: skip
        engine = sglang.Engine(server_args=server_args)
        try:
            return [
                list(o["output_ids"])
                for o in engine.generate(input_ids=prompts, sampling_params=params)
            ]
        finally:
            engine.shutdown()

    # Stock SGLang's outputs are kept in --out for the next call with the same settings and
    # draft: two engine starts a call saves when the checks go over two device calls.
    kept = out / "references.json"
    meta_file = draft / "codraft.json"  # a draft from elsewhere (DFlash's own) has none: its path
    key = {"dtype": args.dtype, "attention_backend": args.attention_backend, "k": args.k,
           "prompts": prompts, "max_tokens": args.max_tokens, "native_ops": args.native_ops,
           "draft": json.loads(meta_file.read_text()).get("weights_sha256") if meta_file.is_file()
           else str(draft)}  # fmt: skip

    ref = stock = None
    if args.references:
        ref = kept_or(kept, key, "reference", reference, stages)
        # stock SGLang speculating with the same draft: what codraft's engine inside must not
        # change
        stock = kept_or(
            kept, key, "reference_speculative",
            lambda: reference(speculative_argv(draft, work / "stock", args.k)), stages,
        )  # fmt: skip
        checks["references_ran"] = ref is not None and stock is not None
    port = free_port()
    token = secrets.token_hex(16)
    sink = TapSink(keep=True)
    log_path = out / "sglang_serve.log"
    server = None
    try:
        env = {**os.environ, "CODRAFT_CONTROL_TOKEN": token}
        server = subprocess.Popen(
            [sys.executable, "-m", "codraft.cli", "serve", "--engine", "sglang",
             "--model", str(target), "--port", str(port), "--dtype", args.dtype,
             "--tap-endpoint", sink.endpoint, "--work-dir", str(work / "serve"),
             "--no-resume-draft", "--mem-fraction-static", str(args.mem_fraction),
             "--attention-backend", args.attention_backend, "--disable-radix-cache",
             "--log-level", "warning", "--draft", str(draft),
             "--num-speculative-tokens", str(args.k)],
            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        control = CodraftClient(base, token=token)

        def wait_ready() -> float:
            t0 = time.time()
            while True:
                try:
                    control.wait_ready(timeout=5.0)
                    return time.time() - t0
                except Exception as e:
                    if server.poll() is not None or time.time() - t0 > args.ready_timeout:
                        tail = log_path.read_bytes()[-3000:].decode(errors="replace")
                        raise RuntimeError(f"codraft serve did not come up: {e!r}\n{tail}") from e

        report["server_ready_s"] = stages.run("server_start", wait_ready)
        http = httpx.Client(base_url=base, timeout=600)
        auth = {"Authorization": f"Bearer {token}"}

        def generate(ids: list[list[int]], **extra: Any) -> list[dict]:
            r = http.post(
                "/generate", json={"input_ids": ids, "sampling_params": {**params, **extra}}
            )
            r.raise_for_status()
            return r.json()

        def served(tag: str) -> dict[str, Any]:
            outs = generate(prompts)
            ids = [list(o["output_ids"]) for o in outs]
            # greedy outputs against stock SGLang without speculation: in bf16 speculation's
            # kernels (a verification is an extend) shift near-tied choices, stock SGLang's as
            # much as codraft's; against stock SGLang speculating with the same draft they
            # must be identical
            row = {"acceptance_length": acceptance(outs), "draft": control.draft().version,
                   "ids": ids}  # fmt: skip
            if ref is not None:
                same = [a == b for a, b in zip(ids, ref, strict=True)]
                row["identical"] = f"{sum(same)}/{len(ids)}"
                if args.dtype == "float32":  # no bf16 kernel ties: lossless, draft for draft
                    checks[f"lossless_{tag}"] = all(same)
            if tag == "v0" and ref is not None and stock is not None:  # the same draft
                as_stock = [a == b for a, b in zip(ids, stock, strict=True)]
                row["identical_to_stock"] = f"{sum(as_stock)}/{len(ids)}"
                stock_plain = [a == b for a, b in zip(stock, ref, strict=True)]
                row["stock_identical_to_plain"] = f"{sum(stock_plain)}/{len(stock_plain)}"
                checks["identical_to_stock"] = len(as_stock) == len(ids) and all(as_stock)
            row["outs"] = outs
            return row

        v0 = stages.run("serve_v0", lambda: served("v0"))
        if v0 is not None:
            outs = v0.pop("outs")
            report["v0"] = v0

            def capture() -> list[dict]:
                rows = []
                for o, prompt in list(zip(outs, prompts, strict=True))[: args.capture_checks]:
                    rid = o["meta_info"]["id"]
                    final = prompt + list(o["output_ids"])
                    decoded = sink.wait_for([rid])[rid]
                    again = generate([final], max_new_tokens=1)[0]
                    rid2 = again["meta_info"]["id"]
                    fresh = sink.wait_for([rid2])[rid2]
                    row = {"request": rid, **compare_capture(decoded, fresh, args.tol)}
                    if not decoded:  # what the tap had delivered when this one was missing
                        got = [o["meta_info"]["id"] in sink.messages for o in outs]
                        row["missing"] = {
                            "batch_index": outs.index(o),
                            "batch_requests_received": f"{sum(got)}/{len(got)}",
                            "sink_requests": len(sink.messages),
                            "sink_frames_received": sink.count,
                            "sink_alive": sink.thread.is_alive(),
                            "sink_rejected": list(sink.rejected),
                            "arrived_after_fresh": rid in sink.messages,
                            "tap_stats": http.get("/v1/tap", headers=auth).json().get("stats"),
                        }
                    rows.append(row)
                return rows

            rows = stages.run("capture", capture)
            report["capture"] = rows
            checks["capture"] = bool(rows) and all(r["ok"] for r in rows)
        model = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/v1/completions", json={"model": model, "prompt": "Hello",
                                                "max_tokens": 8, "temperature": 0})  # fmt: skip
        report["version_header"] = r.headers.get("x-codraft-draft-version")
        start_version = str(control.draft().version)
        checks["version_header"] = (
            r.status_code == 200 and report["version_header"] == start_version
        )
        if args.trained:
            trained = Path(args.trained).resolve()
            meta = json.loads((trained / "codraft.json").read_text())

            def swap() -> dict:
                t0 = time.time()
                d = control.load_draft(int(meta["version"]), str(trained))
                return {"version": d.version, "seconds": time.time() - t0}

            report["swap"] = stages.run("swap", swap)
            vt = stages.run("serve_trained", lambda: served("trained"))
            if vt is not None:
                vt.pop("outs")
                report["trained"] = vt
            stages.run("rollback", lambda: control.rollback_draft())
            vb = stages.run("serve_rolled_back", lambda: served("rolled_back"))
            if vb is not None:
                vb.pop("outs")
                report["rolled_back"] = vb
            if v0 and vb:  # the same draft again: the same outputs
                checks["rollback_restores_outputs"] = vb["ids"] == v0["ids"]
            if v0 and vt and vb:
                checks["swap_changes_acceptance"] = (vt["acceptance_length"] or 0) > (
                    v0["acceptance_length"] or 0
                ) + 0.05 and vt["draft"] == int(meta["version"])
                checks["rollback_restores_acceptance"] = (
                    vb["draft"] == v0["draft"]
                    and abs((vb["acceptance_length"] or 0) - (v0["acceptance_length"] or 0)) < 0.02
                )
        report["tap_stats"] = stages.run(
            "tap_stats", lambda: http.get("/v1/tap", headers=auth).raise_for_status().json()
        )
        stats = (report["tap_stats"] or {}).get("stats") or {}
        checks["no_hook_errors"] = stats.get("hook_errors") == 0 and bool(
            stats.get("requests_captured")
        )
        report["tap_rejected"] = sink.rejected[:10]
        checks["tap_decodes"] = not sink.rejected
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        sink.stop = True
        report["server_log_tail"] = log_path.read_bytes()[-4000:].decode(errors="replace") \
            if log_path.exists() else None  # fmt: skip
    for tag in ("v0", "trained", "rolled_back"):  # the outputs were for the checks above
        (report.get(tag) or {}).pop("ids", None)
    report["checks"] = checks
    report["ok"] = bool(checks) and all(checks.values())
    (out / "sglang_engine_checks.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: v for k, v in report.items() if k not in ("stages", "server_log_tail")},
                     indent=2, default=str))  # fmt: skip
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
