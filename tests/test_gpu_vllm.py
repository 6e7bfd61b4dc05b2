"""The GPU serving kit (scripts/gpu_vllm/) and the vLLM-release switches in codraft.server.compat,
checked without a GPU and without starting an engine."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "scripts" / "gpu_vllm"


def test_release_defaults_are_version_gated(
    monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from codraft.draft.init import write_new_draft
    from codraft.server import compat
    from codraft.server.serve_config import ServeConfig, vllm_argv

    # codraft runs vLLM's own engine defaults on both releases: compiled, CUDA graphs, async
    # scheduling and the model runner vLLM picks
    for version in ("0.32.0", "0.26.0"):
        assert compat.engine_kwargs(version) == {}
        assert compat.default_serve_args([], version) == []
    assert dict(compat.traits("0.26.0").env) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert compat.traits("0.26.0").serve_api == "openai"
    assert compat.traits("0.32.0").serve_api == "launchers"

    monkeypatch.setattr(compat, "vllm_version", lambda: "0.26.0")
    draft = write_new_draft(tmp_path / "d", tiny_llama_dir, draft_vocab_size=64)
    argv = vllm_argv(ServeConfig(vllm_args=["--max-num-seqs", "8"]), Path("/m"), draft)
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert not {"--no-async-scheduling", "--enforce-eager"} & set(argv)


def test_serve_api_resolves_on_the_installed_vllm() -> None:
    from codraft.server import compat

    api = compat.serve_api()
    for name in (
        "build_async_engine_client",
        "build_app",
        "init_app_state",
        "setup_server",
        "create_server_socket",
        "serve_http",
        "NoSignalServer",
        "make_arg_parser",
        "validate_parsed_serve_args",
        "FlexibleArgumentParser",
    ):
        assert callable(getattr(api, name)), name
    assert hasattr(api.envs, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
    # the 0.26 stand-in for NoSignalServer: a uvicorn server that leaves signals alone
    server = compat.no_signal_server()(SimpleNamespace())
    with server.capture_signals():
        pass


def test_worker_extension_takes_every_engine_mode() -> None:
    """Compiled, CUDA graphs, async scheduling: nothing in the engine check refuses them (the
    capture is configured at load, codraft.server.hooks); pipeline parallelism still is refused."""
    from vllm.config import CUDAGraphMode

    from codraft.server.weights import SwapError
    from codraft.server.worker_ext import CodraftEngine

    def engine(pp: int = 1) -> SimpleNamespace:
        cfg = SimpleNamespace(
            speculative_config=SimpleNamespace(method="eagle3"),
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
            compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
            scheduler_config=SimpleNamespace(async_scheduling=True),
        )
        return SimpleNamespace(vllm_config=cfg)

    CodraftEngine._check_engine(engine())  # type: ignore[arg-type]
    with pytest.raises(SwapError, match="pipeline parallelism") as e:
        CodraftEngine._check_engine(engine(pp=2))  # type: ignore[arg-type]
    assert e.value.status == 503


def test_prompts_file_has_disjoint_train_and_heldout() -> None:
    sys.path.insert(0, str(KIT))
    from make_prompts import DEFAULT, load_prompts

    data = load_prompts(DEFAULT)
    assert len(data["heldout"]) == 64 and len(set(data["heldout"])) == 64
    assert len(data["train"]) > 1000
    assert not set(data["train"]) & set(data["heldout"])
    assert DEFAULT.stat().st_size < 200_000  # it travels in every device call
    raw = json.loads(gzip.decompress(DEFAULT.read_bytes()))
    assert raw["train"] == data["train"]


def test_kit_scripts_parse_and_smoke() -> None:
    for script in ("install.sh", "run_all.sh"):
        subprocess.run(["bash", "-n", str(KIT / script)], check=True)
    r = subprocess.run(
        [sys.executable, str(KIT / "bench_serving.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0 and "smoke ok" in r.stdout, r.stdout + r.stderr
    assert "engine defaults on 0.26.0: {}" in r.stdout
    scripts = (
        "run_all.py", "cotrain.py", "check_vllm_src.py", "make_prompts.py", "bench_scale.py",
        "engine_checks.py",
    )  # fmt: skip
    for script in scripts:
        r = subprocess.run(
            [sys.executable, str(KIT / script), "--help"], capture_output=True, text=True
        )
        assert r.returncode == 0, (script, r.stderr)


# a Python without setuptools gets from link_codraft.py what `pip install -e .` gives
CHECKOUT_CHECK = """
import importlib.metadata as md, importlib.util, sys
from pathlib import Path
repo = Path(sys.argv[1])
assert importlib.util.find_spec("setuptools") is None and importlib.util.find_spec("pip") is None
import codraft.server.plugin as plugin
import codraft.client, codraft.learner, codraft.learner.online
assert Path(plugin.__file__) == repo / "server" / "plugin.py", plugin.__file__
assert Path(codraft.client.__file__) == repo / "client" / "__init__.py"
assert Path(codraft.learner.online.__file__) == repo / "learner" / "online" / "__init__.py"
for top in ("server", "learner", "client"):
    assert importlib.util.find_spec(top) is None, top
(ep,) = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "codraft"]
assert (ep.name, ep.value) == ("codraft", "codraft.server.plugin:register"), ep
assert ep.load() is plugin.register
assert md.entry_points(group="console_scripts")["codraft"].value == "codraft.cli:main"
print("checkout ok")
"""


def test_link_codraft_gives_the_import_names_without_setuptools(tmp_path: Path) -> None:
    """install.sh's fallback, in a venv made without pip (so without setuptools) that sees this
    environment's packages but not its codraft install."""
    import sysconfig

    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    deps = tmp_path / "deps"
    deps.mkdir()
    skip = ("codraft", "__editable__", "setuptools", "pip", "pkg_resources", "_distutils_hack")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(skip) and entry.name != "distutils-precedence.pth":
            (deps / entry.name).symlink_to(entry)
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "deps.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")

    link = [py, str(KIT / "link_codraft.py"), str(REPO)]
    r = subprocess.run(link, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "codraft.server -> " + str(REPO / "server") in r.stdout
    r = subprocess.run(
        [py, "-c", CHECKOUT_CHECK, str(REPO)], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0 and "checkout ok" in r.stdout, r.stdout + r.stderr


def test_run_all_records_a_failing_phase_and_goes_on(tmp_path: Path) -> None:
    """A phase whose python does not exist fails; the next phase still runs (phases run in
    their fixed order); all is recorded in at most 8 flat files."""
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(
        [sys.executable, str(KIT / "run_all.py"), "--phases", "prepare,env", "--out", str(out),
         "--work", str(work), "--python", str(tmp_path / "no-such-python"), "--budget-s", "60"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["phases"]) == ["env", "prepare"]
    assert summary["phases"]["prepare"]["status"] == "failed"
    assert summary["phases"]["env"]["status"] == "failed"
    assert "nvidia_smi" in summary["env"]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["logs.tar.gz", "run.log", "summary.json"], files
    assert "[prepare] FAILED" in (out / "run.log").read_text()


def test_run_all_sglang_phases_hand_the_cotrained_draft_on(tmp_path: Path) -> None:
    """The SGLang phases run their scripts with the SGLang venv's python (a recording script
    stands in for it here: no SGLang on this machine): the checks and the sweep get the draft
    the co-training left, and each report comes back to --out; nothing of them runs by default."""
    out, work = tmp_path / "out", tmp_path / "work"
    calls = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        f"{sys.executable} - \"$@\" <<'EOF'\n"
        "import json, sys\nfrom pathlib import Path\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv[1:]\n"
        "if a[0].endswith('cotrain.py'):\n"
        "    d = Path(a[a.index('--work') + 1]) / 'draft-final'\n"
        "    d.mkdir(parents=True); (d / 'config.json').write_text('{}')\n"
        "    (d.parent / 'cotrain.json').write_text(json.dumps({'final_draft_version': 7}))\n"
        "else:\n"
        "    o = Path(a[a.index('--out') + 1]); o.mkdir(parents=True, exist_ok=True)\n"
        "    name = 'sglang_' + ('engine_checks' if 'checks' in a[0] else 'eagle3') + '.json'\n"
        "    (o / name).write_text(json.dumps({'checks': {'capture': True}, 'ok': True}))\n"
        "EOF\n"
    )
    fake.chmod(0o755)
    r = subprocess.run(
        [sys.executable, str(KIT / "run_all.py"), "--phases",
         "sglang_bench,sglang_checks,sglang_cotrain", "--out", str(out), "--work", str(work),
         "--sglang-python", str(fake), "--budget-s", "2000", "--cotrain-minutes", "2",
         "--dflash", "d/flash"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    argv = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [Path(a[0]).name for a in argv] == ["cotrain.py", "engine_checks.py", "eagle3_smoke.py"]
    final = str(work / "sgl-cotrain" / "draft-final")
    assert argv[0][argv[0].index("--minutes") + 1] == "2.0" and "sglang" in argv[0]
    assert argv[1][argv[1].index("--trained") + 1] == final
    assert argv[2][argv[2].index("--eagle3-draft") + 1] == final and "--codraft" in argv[2]
    assert argv[2][argv[2].index("--dflash") + 1] == "d/flash"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["sglang_cotrain"]["note"] == "final draft v7"
    assert summary["phases"]["sglang_checks"]["checks"] == {"capture": True}
    files = sorted(f.name for f in out.iterdir())
    assert {"sglang_engine_checks.json", "sglang_eagle3.json", "sglang_cotrain.json"} <= set(files)
    default = subprocess.run([sys.executable, str(KIT / "run_all.py"), "--help"],
                             capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert "sglang_install" in default.stdout  # named, but not in the default list
    sys.path.insert(0, str(KIT))
    from run_all import VLLM_PHASES

    assert not any(p.startswith("sglang") for p in VLLM_PHASES)


@pytest.mark.skipif(
    not (REPO / ".vllm-src" / "0.26.0" / "vllm").is_dir(), reason="no unpacked vLLM 0.26.0"
)
def test_codraft_fits_the_vllm_0_26_source() -> None:
    r = subprocess.run(
        [sys.executable, str(KIT / "check_vllm_src.py"), "--src", ".vllm-src/0.26.0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    report = json.loads(r.stdout[r.stdout.index("{") : r.stdout.rindex("}") + 1])
    # codraft serve leaves async scheduling to vLLM (None: on by default with CUDA)
    assert report["hook_problems"] == [] and report["serve_async_scheduling"] is None


def test_run_all_overlap_runs_identity_beside_cotrain(tmp_path: Path) -> None:
    """--overlap: identity waits for the co-training server and starts when cotrain has ended
    without one; both phases are recorded."""
    out, work = tmp_path / "out", tmp_path / "work"
    r = subprocess.run(
        [sys.executable, str(KIT / "run_all.py"), "--phases", "identity,cotrain", "--overlap",
         "--out", str(out), "--work", str(work), "--python", str(tmp_path / "no-such-python"),
         "--budget-s", "400", "--cotrain-minutes", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["phases"]) == {"identity", "cotrain"}
    assert summary["overlapped"] == ["identity", "cotrain"]
    assert {p["status"] for p in summary["phases"].values()} == {"failed"}
    log = (out / "run.log").read_text()
    assert log.index("[cotrain] start") < log.index("[identity] starts beside cotrain")


def test_bench_scale_models_are_llama_8b_and_its_eagle3_draft(tmp_path: Path) -> None:
    """The scale benchmark's dummy target is Llama-3.1-8B's geometry and its draft config reads
    back as codraft's draft for that target (taps inside the target's depth)."""
    sys.path.insert(0, str(KIT))
    from bench_scale import LLAMA_8B, make_models

    from codraft.draft.config import DraftConfig
    from codraft.prepare import resolve_model

    target, draft = make_models(tmp_path, resolve_model("smollm2"), 8192, draft_weights=False)
    assert json.loads((target / "config.json").read_text()) == LLAMA_8B
    assert (target / "tokenizer.json").is_file() and not list(target.glob("*.safetensors"))
    cfg = DraftConfig.from_hf_dict(json.loads((draft / "config.json").read_text()))
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (4096, 8, 128256)
    assert cfg.draft_vocab_size == 8192 and all(0 <= t < 32 for t in cfg.tap_layers)


def test_engine_checks_chi_square() -> None:
    """engine_checks.chi_square: equal samples give p = 1; a planted shift of one category
    gives p ~ 0; pooling keeps rare categories from inflating the statistic."""
    from collections import Counter

    sys.path.insert(0, str(KIT))
    from engine_checks import chi_square

    a = Counter({1: 500, 2: 300, 3: 200})
    stat, df, p = chi_square(a, Counter(a))
    assert stat == 0.0 and df == 2 and p == pytest.approx(1.0)
    stat, df, p = chi_square(a, Counter({1: 800, 2: 100, 3: 100}))
    assert p < 1e-20
    # a 2x3 table by hand: both rows expect 400 / 200 / 200
    stat, _, _ = chi_square(Counter({1: 500, 2: 200, 3: 100}), Counter({1: 300, 2: 200, 3: 300}))
    assert stat == pytest.approx(2 * (100**2 / 400) + 0 + 2 * (100**2 / 200))
    rare = chi_square(Counter({1: 500, 7: 1}), Counter({1: 500, 8: 1}))
    assert rare[1] == 1 and rare[2] > 0.5  # 7 and 8 pooled into one category


def test_a_set_split_into_parts_is_joined_and_checked_there(tmp_path: Path) -> None:
    """prepare_lean_set's split (files in pieces across parts) and reassemble.py (run on the
    GPU machine by both kits' install.sh): the joined wheels equal the originals; a damaged
    piece or a missing part stops it with the part named."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location("pls", KIT / "prepare_lean_set.py")
    pls = importlib.util.module_from_spec(spec)
    sys.modules["pls"] = pls  # its dataclasses look their module up
    spec.loader.exec_module(pls)
    src = tmp_path / "wheels"
    src.mkdir()
    files = {"big-1.0-py3-none-any.whl": 9, "small-1.0-py3-none-any.whl": 1}  # MiB
    for name, mib in files.items():
        (src / name).write_bytes(bytes(range(256)) * (mib << 12))
    wheels = [pls.Wheel(src / name, "keep") for name in files]
    manifest = pls.split_into_parts(wheels, tmp_path / "set", part_bytes=4 << 20)
    assert len(manifest["parts"]) >= 3  # the 9 MiB file went in pieces

    def join(out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(KIT / "reassemble.py"), str(tmp_path / "set"), str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    r = join(tmp_path / "out")
    assert r.returncode == 0, r.stderr
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    piece = manifest["files"][0]["pieces"][1]
    path = tmp_path / "set" / piece["part"] / piece["file"]
    path.write_bytes(b"x" + path.read_bytes()[1:])
    r = join(tmp_path / "out2")
    assert r.returncode != 0 and f"{piece['part']}/{piece['file']}: sha256 mismatch" in r.stderr
    shutil.rmtree(tmp_path / "set" / manifest["parts"][-1])
    r = join(tmp_path / "out3")
    assert r.returncode != 0 and "parts still missing" in r.stderr


# scripts/gpu_sglang/capture_probe.py runs on the GPU only (SGLang has no CPU build here); its
# row bookkeeping and the plugin it writes are checked here.
def _probe():
    sys.path.insert(0, str(REPO / "scripts" / "gpu_sglang"))
    import capture_probe

    return capture_probe


def test_the_capture_probe_compares_final_rows_and_sees_rejected_ones() -> None:
    import torch

    probe = _probe()
    torch.manual_seed(0)
    final = [5, 6, 7, 8, 9, 10]  # prompt 5 6 7, output 8 9 10
    ref = torch.randn(6, 4)
    prefill = {"positions": torch.arange(6), "hidden": ref}

    def rec(mode, ids, pos, hidden):
        return {"mode": mode, "input_ids": torch.tensor(ids), "positions": torch.tensor(pos),
                "hidden": hidden}  # fmt: skip

    decode = [
        rec("EXTEND", [5, 6, 7], [0, 1, 2], ref[:3].clone()),
        # verify: bonus 8 at 3, drafts 9 (accepted) and 4 (rejected) at 4 and 5
        rec("TARGET_VERIFY", [8, 9, 4], [3, 4, 5], torch.cat([ref[3:5], ref[5:] + 3.0])),
    ]
    r = probe.compare(final, decode, prefill, tol=0.05)
    assert r["final_rows"] == 5 and r["rejected_rows"] == 1 and r["ok"]
    assert r["positions_covered"] == r["positions_expected"] == 5
    assert r["final_rows_max_rel_err"] == 0.0 and r["rejected_rows_min_rel_err"] > 0.5
    # a capture off by one row (planted from here) is caught
    decode[1]["hidden"] = torch.cat([ref[4:6], ref[5:]])
    assert not probe.compare(final, decode, prefill, tol=0.05)["ok"]
    # a row that matches by chance after a rejection is not final
    decode[1] = rec("TARGET_VERIFY", [8, 4, 10], [3, 4, 5], ref[3:6].clone())
    r = probe.compare(final, decode, prefill, tol=0.05)
    assert r["final_rows"] == 4 and r["rejected_rows"] == 2 and not r["ok"]  # 4 not covered


def test_the_engine_checks_tell_bf16_noise_from_a_misplaced_row() -> None:
    """engine_checks.compare_capture: captured rows a few percent off the fresh prefill's (as
    bf16 kernels of other shapes give) pass even above the a-priori tolerance, as long as each
    is nearer its own position than any row is to the next one; one row shifted by a position
    (planted here) fails, as does a token id that differs."""
    import importlib.util

    import torch

    sys.path.insert(0, str(REPO / "scripts" / "gpu_vllm"))  # its imports (stages)
    path = REPO / "scripts" / "gpu_sglang" / "engine_checks.py"  # vLLM's has the same name
    spec = importlib.util.spec_from_file_location("sglang_engine_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    compare_capture = module.compare_capture

    torch.manual_seed(0)
    n, h = 12, 16
    taps, last = torch.randn(n, 2 * h), torch.randn(n, h)
    ids = torch.arange(100, 100 + n)

    def msg(rows: slice, taps, last, ids, created: float):
        header = SimpleNamespace(created=created)
        return SimpleNamespace(header=header, num_tokens=len(ids[rows]), token_ids=ids[rows],
                               taps=taps[rows], last_hidden=last[rows])  # fmt: skip

    fresh = [msg(slice(0, n), taps, last, ids, 0.0)]
    noisy_taps = taps * (1 + 0.03 * torch.randn_like(taps).clamp(-2, 2))
    decoded = [msg(slice(0, 5), noisy_taps, last, ids, 0.0),
               msg(slice(5, n - 1), noisy_taps, last, ids, 1.0)]  # fmt: skip
    r = compare_capture(decoded, fresh, tol=0.05)
    assert r["ok"] and r["common"] == n - 1 and r["token_id_mismatches"] == 0
    assert r["taps_max_rel_err"] > 0.05 and not r["within_tol"]  # above tol, below the floor
    assert r["next_position_min_rel_err"] > r["taps_max_rel_err"]
    shifted = noisy_taps.clone()
    shifted[7] = taps[8]  # the row of the next position
    bad = [msg(slice(0, n - 1), shifted, last, ids, 0.0)]
    assert not compare_capture(bad, fresh, tol=0.05)["ok"]
    other = ids.clone()
    other[3] += 1
    assert not compare_capture([msg(slice(0, n - 1), taps, last, other, 0.0)], fresh, 0.05)["ok"]


def test_the_engine_checks_reuse_stock_outputs_only_for_the_same_settings(tmp_path: Path) -> None:
    """engine_checks.kept_or: a reference run once is read back by the next call with the same
    settings (no engine started), run again when any setting or the draft differs, and a stage
    that failed keeps nothing."""
    import importlib.util

    sys.path.insert(0, str(REPO / "scripts" / "gpu_vllm"))  # its imports (stages)
    path = REPO / "scripts" / "gpu_sglang" / "engine_checks.py"
    spec = importlib.util.spec_from_file_location("sglang_engine_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from stages import Stages

    runs: list[str] = []

    def ref(tag: str):
        def fn():
            runs.append(tag)
            return [[1, 2, 3], [tag == "b" and 5 or 4]]

        return fn

    kept = tmp_path / "references.json"
    key = {"dtype": "float32", "draft": "aa", "prompts": [[7, 8]]}
    first = Stages({}, "t")
    assert module.kept_or(kept, key, "reference", ref("a"), first) == [[1, 2, 3], [4]]
    assert module.kept_or(kept, key, "stock", ref("s"), first) == [[1, 2, 3], [4]]
    again = Stages({}, "t")
    assert module.kept_or(kept, key, "reference", ref("b"), again) == [[1, 2, 3], [4]]
    assert runs == ["a", "s"] and again.report["stages"]["reference"]["kept_from"] == str(kept)
    other = {**key, "draft": "bb"}  # another draft: stock outputs are run again
    assert module.kept_or(kept, other, "reference", ref("b"), Stages({}, "t")) == [[1, 2, 3], [5]]
    assert runs == ["a", "s", "b"]
    assert module.kept_or(kept, other, "stock", ref("c"), Stages({}, "t")) is not None
    assert runs[-1] == "c"  # the old key's stock outputs went with it

    def broken():
        raise RuntimeError("engine did not start")

    assert module.kept_or(kept, {**key, "k": 2}, "reference", broken, Stages({}, "t")) is None
    assert "reference" in json.loads(kept.read_text())  # what was kept is untouched


def test_the_capture_probe_writes_a_plugin_sglang_finds(tmp_path: Path, monkeypatch) -> None:
    import importlib.metadata as md

    probe = _probe()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    probe.install_plugin(tmp_path)
    (ep,) = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == probe.PLUGIN]
    assert ep.value == f"{probe.PLUGIN}:register"
    compile((tmp_path / f"{probe.PLUGIN}.py").read_text(), "plugin", "exec")
    assert str(tmp_path) in __import__("os").environ["PYTHONPATH"]


def test_the_capture_probe_cuts_a_batch_by_request_and_checks_sglangs_accept_lengths() -> None:
    import torch

    probe = _probe()
    torch.manual_seed(1)
    finals = {"a": [1, 2, 3, 4, 5], "b": [7, 8, 9, 6]}  # prompts [1, 2, 3] and [7, 8]
    refs = {r: torch.randn(len(f), 4) for r, f in finals.items()}

    def forward(mode, ids, pos, hidden):
        return {"kind": "forward", "mode": mode, "input_ids": torch.tensor(ids),
                "positions": torch.tensor(pos), "hidden": hidden}  # fmt: skip

    a, b = refs["a"], refs["b"]
    records = [
        forward("EXTEND", [1, 2, 3, 7, 8], [0, 1, 2, 0, 1], torch.cat([a[:3], b[:2]])),
        {
            "kind": "batch",
            "rids": ["a", "b"],
            "extend_lens": [3, 2],
            "accept_lens": None,
            "num_draft_tokens": None,
        },  # fmt: skip
        # verify, 2 rows each: a [4 (bonus), 5 (accepted)]; b [9 (bonus), 0 (rejected)]
        forward("TARGET_VERIFY", [4, 5, 9, 0], [3, 4, 2, 3], torch.cat([a[3:], b[2:3], b[3:] + 1])),
        {
            "kind": "batch",
            "rids": ["a", "b"],
            "extend_lens": None,
            "accept_lens": torch.tensor([2, 1]),
            "num_draft_tokens": 2,
        },  # fmt: skip
    ]
    per = probe.split_by_request(records)
    assert sorted(per) == ["a", "b"] and [len(r["input_ids"]) for r in per["b"]] == [2, 2]
    for rid, final in finals.items():
        prefill = {"positions": torch.arange(len(final)), "hidden": refs[rid]}
        r = probe.compare(final, per[rid], prefill, tol=0.05)
        assert r["ok"] and r["accept_len_mismatches"] == 0, (rid, r)
    # SGLang saying b accepted a draft it did not (planted here) is caught
    records[3]["accept_lens"] = torch.tensor([2, 2])
    per = probe.split_by_request(records)
    prefill = {"positions": torch.arange(4), "hidden": b}
    assert probe.compare(finals["b"], per["b"], prefill, tol=0.05)["accept_len_mismatches"] == 1
    assert probe.split_by_request([r for r in records if r["kind"] == "forward"]) is None


def test_the_sglang_sweep_counts_acceptance_per_batch_and_catches_a_differing_output() -> None:
    """scripts/gpu_sglang/eagle3_smoke.py's bookkeeping (its engines run on the GPU only)."""
    sys.path.insert(0, str(REPO / "scripts" / "gpu_sglang"))
    import eagle3_smoke as smoke

    def out(ids, verify=0, correct=0):
        meta = {"spec_verify_ct": verify, "spec_num_correct_drafts": correct} if verify else {}
        return {"output_ids": ids, "meta_info": meta}

    row = smoke.batch_row([out([1, 2, 3], 2, 1), out([4, 5, 6], 2, 3)], seconds=2.0)
    assert row["tokens_per_s"] == 3.0 and row["acceptance_length"] == 1 + 4 / 4
    assert smoke.batch_row([out([1])], 1.0)["acceptance_length"] is None  # no speculation
    plain = {"batches": [smoke.batch_row([out([1, 2])], 1.0), smoke.batch_row([out([3, 4])], 1.0)]}
    spec = {"batches": [smoke.batch_row([out([1, 2], 1, 1)], 0.5),
                        smoke.batch_row([out([3, 9], 1, 1)], 0.5)]}  # fmt: skip
    ours = {"batches": [smoke.batch_row([out([1, 2], 1, 1)], 0.5),
                        smoke.batch_row([out([3, 4], 1, 1)], 0.5)]}  # fmt: skip
    arms = {"plain": plain, "eagle3": spec, "eagle3-codraft": ours, "dflash": None}
    report, lossless = smoke.compare_arms(arms)
    assert lossless == {"eagle3": False, "eagle3-codraft": True}  # eagle3's 2nd batch differs
    assert [r["identical_outputs"] for r in report["eagle3"]] == ["1/1", "0/1"]
    assert report["eagle3"][0]["speedup"] == 2.0 and "dflash" not in report
    # codraft's arm against the stock one it runs inside (either assembly)
    assert [r["identical_to_stock"] for r in report["eagle3-codraft"]] == ["1/1", "0/1"]
    report, _ = smoke.compare_arms({**arms, "eagle3-codraft-thread": ours})
    assert [r["identical_to_stock"] for r in report["eagle3-codraft-thread"]] == ["1/1", "0/1"]


def test_a_profiled_sglang_step_is_summarised_per_step(tmp_path: Path) -> None:
    """eagle3_smoke.py --profile-batch: a Chrome trace (as torch's profiler writes it, gzipped)
    reduced to counts and microseconds per step, the host's waits and copies named, and those
    of the thread that runs the scheduler's steps told from a helper thread's."""
    sys.path.insert(0, str(REPO / "scripts" / "gpu_sglang"))
    import eagle3_smoke as smoke

    def ev(cat, name, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "dur": dur, "ts": 0, "pid": 7, "tid": tid}

    events = [ev("cuda_runtime", "cudaStreamSynchronize", 300.0)] * 2 + [
        ev("cuda_runtime", "cudaLaunchKernel", 5.0)] * 40 + [
        ev("kernel", "gemm", 20.0)] * 10 + [ev("cpu_op", "aten::index_select", 50.0)] * 4 + [
        {"ph": "i", "cat": "cpu_op", "name": "marker"}]  # fmt: skip
    # the step thread (1) runs scheduler.run_batch; a helper thread (2) waits on an event
    events += [ev("user_annotation", "scheduler.run_batch", 900.0)] * 2
    events += [ev("cuda_runtime", "cudaEventSynchronize", 40.0, tid=2)] * 2
    (tmp_path / "p").mkdir()
    with gzip.open(tmp_path / "p" / "x-TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = smoke.summarize_trace(tmp_path / "p", steps=2)
    assert got["per_step"]["cuda_runtime"] == {"count": 22.0, "us": 440.0}
    assert got["per_step"]["kernel"] == {"count": 5.0, "us": 100.0}
    assert got["waits_and_copies"] == {
        "cudaEventSynchronize": {"count": 1.0, "us": 40.0},
        "cudaStreamSynchronize": {"count": 1.0, "us": 300.0},
    }
    assert got["waits_and_copies_on_step_thread"] == {  # the helper thread's wait left out
        "cudaStreamSynchronize": {"count": 1.0, "us": 300.0}}  # fmt: skip
    assert got["cuda_runtime"][0]["name"] == "cudaStreamSynchronize"
    assert got["host_ops"] == [
        {"name": "scheduler.run_batch", "count": 1.0, "us": 900.0},
        {"name": "aten::index_select", "count": 2.0, "us": 100.0},
    ]
    with pytest.raises(FileNotFoundError):
        smoke.summarize_trace(tmp_path / "empty", steps=1)


def test_codraft_hooks_are_named_in_a_real_profiler_trace(tmp_path: Path, monkeypatch) -> None:
    """The plugin's step hooks run inside "codraft.*" ranges while torch's profiler records
    (and outside any range when it does not), and summarize_trace reads them back from the
    trace torch writes, so an SGLang profile names codraft's host time per step."""
    sys.path.insert(0, str(REPO / "scripts" / "gpu_sglang"))
    import eagle3_smoke as smoke
    import torch

    from codraft.server.sglang import plugin

    calls: list[str] = []

    class Engine:  # stands in for SGLangEngine: what the hooks call, recorded
        def on_batch(self, batch):
            calls.append(f"on_batch:{torch.autograd._profiler_enabled()}")

        def end_batch(self, result):
            calls.append("end_batch")

        def on_result(self, batch, result):
            calls.append("on_result")

        def poll(self):
            calls.append("poll")

    monkeypatch.setattr(plugin, "_engine", Engine())
    plugin._generation(lambda worker, batch: "result", None, "batch")  # no profiler
    steps = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            assert plugin._generation(lambda worker, batch: "result", None, "batch") == "result"
            plugin._batch_result(None, None, "batch", "result")
            plugin._inputs(None, None)
    (tmp_path / "p").mkdir()
    prof.export_chrome_trace(str(tmp_path / "p" / "trace.json"))
    assert calls[0] == "on_batch:False" and calls[1:5] == [
        "end_batch", "on_batch:True", "end_batch", "on_result"]  # fmt: skip
    hooks = smoke.summarize_trace(tmp_path / "p", steps=steps)["codraft_hooks"]
    assert sorted(hooks) == [
        "codraft.end_batch", "codraft.on_batch", "codraft.on_result", "codraft.poll"]  # fmt: skip
    assert all(v["count"] == 1.0 and v["us"] > 0 for v in hooks.values()), hooks


def test_sglang_kit_scripts_parse() -> None:
    """The SGLang kit's scripts run on the GPU machine only; here: they parse and answer --help
    (their imports of SGLang and of the GPU's packages are inside their functions)."""
    kit = REPO / "scripts" / "gpu_sglang"
    subprocess.run(["bash", "-n", str(kit / "install.sh")], check=True)
    for script in (
        "engine_checks.py",
        "eagle3_smoke.py",
        "capture_probe.py",
        "check_sglang_src.py",
    ):
        r = subprocess.run([sys.executable, str(kit / script), "--help"], capture_output=True,
                           text=True, cwd=REPO)  # fmt: skip
        assert r.returncode == 0, (script, r.stderr)
