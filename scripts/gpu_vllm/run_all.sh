#!/usr/bin/env bash
# The GPU serving session of issue #12 in one command (see run_all.py for the phases, outputs
# and time budget). From anywhere; runs from the repository root. Only python3 (the image's, with
# torch) and bash are needed before the install phase; `pip` need not be on PATH.
#
#   bash scripts/gpu_vllm/run_all.sh --out "$OUT"                       # all phases
#   bash scripts/gpu_vllm/run_all.sh --out "$OUT" --phases install,env,prepare,identity,cotrain \
#       --cotrain-minutes 3
#   bash scripts/gpu_vllm/run_all.sh --out "$OUT" --phases env,bench
#
# Environment: PYTHON (default python3: runs the driver and is the base of .gpu_venv),
# CODRAFT_GPU_VENV (.gpu_venv), CODRAFT_WHEELS (.gpu_wheels).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-python3}" scripts/gpu_vllm/run_all.py "$@"
