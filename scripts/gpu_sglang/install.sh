#!/usr/bin/env bash
# Install the lean SGLang 0.5.17 set (scripts/gpu_sglang/prepare_lean_set.py) on the offline GPU
# machine: one H200 (sm_90), Python 3.12 with torch 2.11.0 + CUDA 13 preinstalled. Run from the
# repository root once every .gpu_sglang_wheels/partN has arrived (they may come in several
# calls, one part each):
#
#   bash scripts/gpu_sglang/install.sh      # -> .gpu_sglang_venv (system site packages)
#   .gpu_sglang_venv/bin/python -c 'import sglang; print(sglang.__version__)'
#
# Steps: reassemble the wheels from the parts (sha256 of every piece and file checked against
# manifest.json); a venv with --system-site-packages (plus $PYTHON's own site folders when
# $PYTHON is itself a venv, as the image's python3 is: that is where torch lives);
# `pip install --no-deps --no-index --no-compile` of every wheel in the set; then the checks:
# torch is the image's 2.11.0, the versions of sglang, sgl_kernel (which loads its sm90
# common_ops on the H200), flashinfer, deep_gemm, xgrammar and tvm_ffi, every requirement of
# the installed set met by the set or the image (or left out on purpose, as manifest.json
# says), and an import of the modules that `Engine` / `launch_server` load for a dense Llama
# with EAGLE-3 (scheduler, model runner, Llama + Llama-EAGLE-3 models, both EAGLE workers, the
# fa3 / flashinfer / triton attention backends and the ones eagle_worker_v2 imports on CUDA).
# Environment: PYTHON (default python3), CODRAFT_SGLANG_WHEELS (.gpu_sglang_wheels),
# CODRAFT_SGLANG_VENV (.gpu_sglang_venv). Idempotent: a second run reinstalls nothing that is
# already there (pip skips installed versions) and re-runs the checks.
set -euo pipefail

PYTHON=${PYTHON:-python3}
SRC=${CODRAFT_SGLANG_WHEELS:-.gpu_sglang_wheels}
VENV=${CODRAFT_SGLANG_VENV:-.gpu_sglang_venv}
WHL="$SRC/whl"

[ -f pyproject.toml ] || { echo "run from the codraft repository root" >&2; exit 2; }
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
    || { echo "need Python 3.12 (the set is cp312); set PYTHON=" >&2; exit 2; }

# ---------------------------------------------------------------- 1. reassemble + verify
"$PYTHON" scripts/gpu_vllm/reassemble.py "$SRC" "$WHL"

# ---------------------------------------------------------------- 2. venv
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV" 2>/dev/null \
        || "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
fi
PY="$VENV/bin/python"
# --system-site-packages gives the BASE interpreter's site-packages. When $PYTHON is itself a
# venv (the GPU image's python3, which holds torch, is one), its packages are invisible to the
# new venv: add its site folders after the venv's own, through site.addsitedir so that their
# .pth files are processed too.
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
    "$PY" - "$("$PYTHON" -c 'import site; print(repr(site.getsitepackages()))')" <<'EOF'
import ast, sys, sysconfig
from pathlib import Path
dirs = [d for d in ast.literal_eval(sys.argv[1]) if Path(d).is_dir() and d not in sys.path]
pth = Path(sysconfig.get_paths()["purelib"]) / "codraft-parent-site.pth"
pth.write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
print(f"{pth}: adds {dirs}")
EOF
fi
if "$PY" -m pip --version >/dev/null 2>&1; then
    PIP=("$PY" -m pip)
else  # a venv without pip: the image's pip installs into it (no `pip` on PATH needed)
    PIP=("$PYTHON" -m pip --python "$PY")
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)
assert torch.__version__.split("+")[0] == "2.11.0", "sglang 0.5.17 pins torch==2.11.0"'

# ---------------------------------------------------------------- 3. wheels
mapfile -t WHEELS < <("$PY" -c 'import json, sys
from pathlib import Path
whl = Path(sys.argv[1])
for e in json.loads((whl / "manifest.json").read_text())["files"]:
    print(whl / e["name"])' "$WHL")
# --no-compile: sglang alone is thousands of modules; Python compiles what it imports, once
"${PIP[@]}" install --no-deps --no-index --no-compile --disable-pip-version-check -q "${WHEELS[@]}"

# ---------------------------------------------------------------- 4. check
"$PY" -c 'import sglang; print("sglang", sglang.__version__)'
"$PY" - <<'EOF'
import importlib.metadata as md
import sgl_kernel
import flashinfer
print("sgl_kernel", sgl_kernel.__version__, "common_ops:", sgl_kernel.common_ops.__file__)
print("flashinfer", flashinfer.__version__)
import importlib.util
if importlib.util.find_spec("sgl_kernel.flash_ops") is None:
    print("sgl_kernel has no FA3 (set built with --no-fa3): serve with "
          "--attention-backend flashinfer (the H200 default, fa3, would fail)")
import deep_gemm, tvm_ffi, xgrammar  # noqa: E401  (imported on the EAGLE-3 path too)
for dist in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy",
             "sglang", "sglang-kernel", "flashinfer-python", "sgl-deep-gemm", "xgrammar",
             "apache-tvm-ffi", "openai", "fastapi", "pydantic"):
    try:
        print(f"  {dist:18s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist:18s} MISSING")
EOF
"$PY" - "$WHL/manifest.json" <<'EOF'
# every requirement (no extras) of every installed wheel of the set: met, or left out on purpose
import importlib.metadata as md, json, re, sys
from packaging.requirements import Requirement
from packaging.version import Version

info = json.loads(open(sys.argv[1]).read())
left_out, accepted = info.get("left_out", {}), info.get("accepted", {})
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
bad, warn, notes = [], [], []
for wheel in (e["name"] for e in info["files"]):
    dist = md.distribution(wheel.split("-")[0])
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = norm(req.name)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            (notes if name in left_out else bad).append(f"{dist.metadata['Name']}: {req} missing")
            continue
        if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
            where = f"{dist.metadata['Name']}: {req}, have {have}"
            (notes if name in accepted else warn).append(where)
print(f"requirements: {len(notes)} left out / accepted on purpose, {len(warn)} other versions, "
      f"{len(bad)} missing")
for w in warn:  # the image's version differs from a pin: the import check below decides
    print(f"  WARN  {w}")
for b in bad:  # not in the set, not on the image, not left out on purpose: the set is short
    print(f"  MISSING {b}")
raise SystemExit(1 if bad else 0)
EOF
"$PY" - <<'EOF'
# the modules Engine / launch_server import for a dense Llama with EAGLE-3 on an H200
import importlib, time
mods = [
    "sglang.srt.entrypoints.engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.llama_eagle3",
    "sglang.srt.speculative.eagle_worker_v2",
    "sglang.srt.speculative.draft_utils",
    "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.flashinfer_backend",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.dsa_backend",  # eagle_worker_v2 imports these three on CUDA
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.layers.attention.flashmla_backend",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.layers.sampler",
]
t0, failed = time.time(), []
for name in mods:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001
        failed.append(name)
        print(f"  IMPORT FAILED {name}: {type(e).__name__}: {e}")
print(f"imported {len(mods) - len(failed)}/{len(mods)} serving modules in {time.time() - t0:.0f} s")
raise SystemExit(1 if failed else 0)
EOF
# ---------------------------------------------------------------- 5. codraft itself
# codraft's own requirements (pyproject.toml): the SGLang set or the image has them; a missing
# one comes from the vLLM set's wheels when those are here too (pip resolves among local wheels)
MISSING=$("$PY" -c 'import importlib.metadata as md, re, tomllib
for req in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9_.-]+", req).group()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(name)')
if [ -n "$MISSING" ]; then
    echo "codraft needs, not in the SGLang venv:" $MISSING "(from ${CODRAFT_WHEELS:-.gpu_wheels}/whl)"
    # shellcheck disable=SC2086  # one word per requirement
    "${PIP[@]}" install --no-index --no-compile --disable-pip-version-check -q \
        --find-links "${CODRAFT_WHEELS:-.gpu_wheels}/whl" --find-links "$WHL" $MISSING
fi
# this checkout importable there with its entry points (the `sglang.srt.plugins` one is codraft's
# SGLang engine, enabled only by `codraft serve --engine sglang`)
"$PY" scripts/gpu_vllm/link_codraft.py
"$PY" -c 'import codraft.server.sglang.plugin, codraft.cli; print("codraft importable")'
echo "installed: $PY  (sglang serve / python -m sglang.launch_server with that interpreter)"
