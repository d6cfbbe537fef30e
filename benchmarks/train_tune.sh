#!/usr/bin/env bash
# `accelab train --tune` on vit-tiny / digits (32 px) and ResNet-50 / digits at 32 px: every
# candidate plan screened in short interleaved runs, the finalists and two baseline seeds trained
# to convergence, the winner by time-to-target. Tables to benchmarks/results/train_tune_<model>.txt,
# the winners' plans beside them, then each winner trained with `accelab train --plan`.
# ~25 min on 2 cores.
#
#   bash benchmarks/train_tune.sh                 # or: MODELS=vit-tiny EPOCHS=3 bash benchmarks/train_tune.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
EPOCHS=${EPOCHS:-2}
BUDGET=${BUDGET:-20m}
MODELS=${MODELS:-"vit-tiny resnet-50"}
mkdir -p "$RESULTS/tmp"
for model in $MODELS; do
  extra=()
  if [ "$model" = resnet-50 ]; then extra=(--image-size 32 --reinit-head); fi
  out="$RESULTS/train_tune_$model"
  cmd=(.venv/bin/accelab train --tune --model "$model" --dataset digits "${extra[@]}" --tune-epochs "$EPOCHS"
       --budget "$BUDGET" --out "$out.yaml" --json "$out.json" --db "$RESULTS/tmp/train_tune.db" --no-progress
       --output-dir "$RESULTS/tmp/train_tune_$model-$(date +%s)")
  {
    .venv/bin/python benchmarks/machine.py  # the CPU line: figures from different CPUs do not compare
    echo "reproduce: bash benchmarks/train_tune.sh   (${cmd[*]})"
    grep -E "^(steal|cpu)" /proc/stat | head -1
    COLUMNS=200 /usr/bin/time -f "wall %e s" "${cmd[@]}"
    grep -E "^(steal|cpu)" /proc/stat | head -1
  } 2>&1 | grep -v -E "torchao|pytree|Loading weights|Writing model" | tee "$out.txt"
done
