#!/usr/bin/env bash
# EAGLE-3 against DFlash (and DSpark) on SmolLM2-135M, one H200, at one training-token budget.
#
#   bash scripts/gpu_vllm/drafters.sh train "$OUT"   # answers + both drafters trained (~8 min)
#   bash scripts/gpu_vllm/drafters.sh bench "$OUT"   # vLLM 0.26: base / EAGLE-3 / DFlash arms
#
# train: scripts/smollm2_gpu.py's gpu stage on runs/smollm2_gpu/prompts.json (carried; written
# here by its prompts stage): SmolLM2's greedy answers, then `codraft learn --from-dir
# --recompute` for DFlash and then EAGLE-3 with the same steps of the same --token-budget
# tokens (the second drafter gets exactly the steps the first reached). The bf16 drafts go to
# $OUT/dflash and $OUT/eagle3 (weights over 15 MiB in pieces) and stay in runs/gpu_work.
# bench: bench_serving.py once per draft in one call (base + the first drafter's arm, then one
# arm per other drafter; vLLM's default engine: compiled, CUDA graphs, async scheduling),
# batches 1/8/32/64, 128 tokens, k = 3. DRAFTERS (default dflash,eagle3; first = the budget
# setter) picks the drafters, e.g. DRAFTERS=dflash,dspark,eagle3.
# Needs the lean vLLM set installed (install.sh; run_all.sh --phases install).
set -euo pipefail
DRAFTERS=${DRAFTERS:-dflash,eagle3}
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
STAGE=$1
OUT=$2
WORK=runs/gpu_work
PY=.gpu_venv/bin/python
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1 CODRAFT_CACHE=$WORK/cache TRITON_CACHE_DIR=$WORK/triton-cache
export VLLM_CACHE_ROOT=$WORK/vllm-cache
mkdir -p "$OUT" "$WORK"
case $STAGE in
train)
    $PY scripts/smollm2_gpu.py gpu --prompts runs/smollm2_gpu/prompts.json --work $WORK/sg \
        --export $WORK/drafters --drafters "$DRAFTERS" --limit "${LIMIT:-3000}" \
        --steps "${STEPS:-200}" --train-seconds "${TRAIN_S:-170}" --save-every 50 \
        --token-budget 16384 --same-budget --reuse-answers 2>&1 | tee $WORK/train.log
    for d in ${DRAFTERS//,/ }; do [ -d $WORK/drafters/$d ] && cp -r $WORK/drafters/$d "$OUT"/; done
    cp $WORK/drafters/smollm2_gpu_train.json "$OUT"/
    ;;
bench)
    first=1
    for d in ${DRAFTERS//,/ }; do
        rm -rf $WORK/drafters/$d/whole && mkdir $WORK/drafters/$d/whole
        cp $WORK/drafters/$d/config.json $WORK/drafters/$d/codraft.json $WORK/drafters/$d/whole/
        cat $WORK/drafters/$d/model.safetensors* > $WORK/drafters/$d/whole/model.safetensors
        arms=trained && [ $first = 1 ] && arms=base,trained  # one base arm for all
        first=0
        $PY scripts/gpu_vllm/bench_serving.py --out "$OUT" --name "bench_$d" \
            --arms $arms --draft $WORK/drafters/$d/whole --arm-timeout 240
    done
    ;;
*)
    echo "usage: $0 train|bench OUT" >&2
    exit 2
    ;;
esac
