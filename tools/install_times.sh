#!/usr/bin/env bash
# The wall time of each install step of `make test` (its make targets, in its order), one
# `target seconds` line each into OUT: run it in a fresh clone to see what CI pays before the
# tests. `python tools/suite_times.py` turns it into the README's table.
#   bash tools/install_times.sh OUT
set -euo pipefail
out=${1:?usage: install_times.sh OUT}
cd "$(dirname "$0")/.."
: > "$out"
for target in install lint models browser vllm monitoring guidellm; do
  start=$(date +%s.%N)
  make "$target" > /dev/null
  echo "$target $(python3 -c "import time; print(round(time.time() - $start, 1))")" >> "$out"
done
cat "$out"
