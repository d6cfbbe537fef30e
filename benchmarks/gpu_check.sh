#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU and the machine's own torch, run accelab from the
# source tree: `accelab env`, then the bench suite on the catalog models that build offline
# (random weights at real sizes: speed does not depend on the weights), then a short training
# benchmark. JSON results go to the folder given as the first argument. Budget: < 8 minutes.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export ACCELAB_CACHE=${ACCELAB_CACHE:-$OUT/cache}
PY=${PYTHON:-python3}
DB="$OUT/results.db"
start=$(date +%s)
run() {  # a failing step is logged and the check goes on
  echo "+ accelab $*" | tee -a "$OUT/log.txt"
  timeout "${STEP_TIMEOUT:-240}" "$PY" -m accelab "$@" >>"$OUT/log.txt" 2>&1 || echo "  (exit $?)" | tee -a "$OUT/log.txt"
}

"$PY" benchmarks/machine.py >>"$OUT/log.txt" 2>&1 || true  # the CPU line, first in the log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.csv" 2>&1 || true
run env --json "$OUT/env.json"
run models fetch vit-base resnet-50 convnext-tiny vit-tiny

# classifiers: precision, compile, memory format, TF32 side by side, with quality verdicts
for model in resnet-50 vit-base convnext-tiny; do
  run compare "$model" --batch-size 64 --min-seconds 2 --samples 16 --db "$DB" --json "$OUT/compare-$model.json" \
    --plans baseline,tf32,bf16-autocast,fp16-autocast,fp16,channels-last,compile,fp8
done
# batch scaling of one classifier
run compare resnet-50 --min-seconds 2 --no-quality --db "$DB" --json "$OUT/batch-resnet-50.json" \
  --plans "baseline[batch_size=1],baseline[batch_size=32],baseline[batch_size=256],bf16-autocast[batch_size=256]"

# models that need the SmolLM2 / MiniLM files: only where they are present (carried or fetched)
for model in minilm-l6 smollm2-135m smolvlm-tiny; do
  if "$PY" -m accelab models info "$model" >/dev/null 2>&1; then
    scenario=$([ "$model" = minilm-l6 ] && echo forward || echo generate)
    run compare "$model" --scenario "$scenario" --batch-size 8 --new-tokens 32 --min-seconds 2 --samples 8 \
      --db "$DB" --json "$OUT/compare-$model.json" --plans baseline,bf16-autocast,fp16-autocast,bf16,static-cache,compile-static
  fi
done

# short training benchmark: baseline, bf16, fp16 (GradScaler), accumulation
run train --bench --model vit-tiny --dataset digits --epochs 1 --db "$DB" --json "$OUT/train-bench.json"

echo "gpu_check finished in $(( $(date +%s) - start )) s; results in $OUT" | tee -a "$OUT/log.txt"
