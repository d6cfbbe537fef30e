#!/usr/bin/env bash
# The wall time of the install step of `make test` (`make deps`: its targets side by side), one
# `make-arguments seconds` line into OUT: run it in a fresh clone to see what CI pays before the
# tests. With --each, each target alone in `make test`'s order instead (what each one costs).
# `python tools/suite_times.py` turns OUT into the table in docs/development.md.
#   bash tools/install_times.sh OUT [--each]
set -euo pipefail
out=${1:?usage: install_times.sh OUT [--each]}
cd "$(dirname "$0")/.."
: > "$out"
timed() {
  local start
  start=$(date +%s.%N)
  make --no-print-directory "$@" > /dev/null
  echo "$* $(python3 -c "import time; print(round(time.time() - $start, 1))")" >> "$out"
}
if [ "${2:-}" = "--each" ]; then
  for target in lint models browser vllm openvino monitoring guidellm; do timed "$target"; done
else
  timed deps
fi
cat "$out"
