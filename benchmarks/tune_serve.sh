#!/usr/bin/env bash
# `accelab tune --scenario serve` on SmolLM2-135M at 1, 8 and 16 users with the default candidates
# (torch fp32 / bf16 / int8-bf16, llama.cpp Q4_1 and Q8_0, vLLM compiled bf16 when `make vllm` ran),
# 2 rounds of 15 s windows per level; the table goes to benchmarks/results/tune_serve.txt, the
# winner's plan to benchmarks/results/tune_serve.yaml. ~20 min on 2 cores.
#
#   bash benchmarks/tune_serve.sh                 # or: ROUNDS=3 WINDOW=20 bash benchmarks/tune_serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=benchmarks/results
ROUNDS=${ROUNDS:-2}
WINDOW=${WINDOW:-15}
mkdir -p "$RESULTS/tmp"
cmd=(.venv/bin/accelab tune smollm2-135m --scenario serve --concurrency 1,8,16 --rounds "$ROUNDS" --window "$WINDOW"
     --out "$RESULTS/tune_serve.yaml" --json "$RESULTS/tune_serve.json" --db "$RESULTS/tmp/tune_serve.db" --fresh)
{
  .venv/bin/python benchmarks/machine.py  # the CPU line: figures from different CPUs do not compare
  echo "reproduce: bash benchmarks/tune_serve.sh   (${cmd[*]})"
  COLUMNS=200 "${cmd[@]}"
} 2>&1 | tee "$RESULTS/tune_serve.txt"
