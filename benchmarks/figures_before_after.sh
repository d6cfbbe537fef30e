#!/usr/bin/env bash
# The hardware figures of an older commit and of this checkout, back to back on this machine, with
# the same venv and models: `accelab env --refresh`, a MiniLM compare at batch 32 (MFU, bf16 and
# int8 rows) and a SmolLM2 decode bench (roofline). Each tree gets a cache of its own, so both
# measure their limits afresh.
#
#     bash benchmarks/figures_before_after.sh [BASE_COMMIT]   # default 262a202 (before issue 14)
set -u
base=${1:-262a202}
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python
old=$(mktemp -d)/old
git -C "$root" worktree add -q "$old" "$base"
trap 'git -C "$root" worktree remove --force "$old"' EXIT
models=${ACCELAB_CACHE:-$HOME/.cache/accelab}/models
PYTHONPATH=$root/src $py "$root/benchmarks/machine.py"  # the CPU line, first: both trees run on this CPU
for tree in before after; do
  src=$root/src; [ $tree = before ] && src=$old/src
  cache=$(mktemp -d); ln -s "$models" "$cache/models"
  export ACCELAB_CACHE=$cache PYTHONPATH=$src COLUMNS=200
  echo "=== $tree ($([ $tree = before ] && echo "$base" || git -C "$root" rev-parse --short HEAD)): env --refresh"
  $py -m accelab env --refresh 2>&1 | grep -A40 "measured limits"
  echo "=== $tree: compare minilm-l6 batch 32"
  timeout 900 $py -m accelab compare minilm-l6 --batch-size 32 --plans baseline,bf16-autocast,int8-dynamic \
    --min-iters 2 --min-seconds 2 --samples 8 --no-store 2>&1 | tail -12
  echo "=== $tree: bench smollm2 generate"
  timeout 600 $py -m accelab bench smollm2-135m --scenario generate --new-tokens 32 --no-store 2>&1 \
    | grep -E "roofline|decode tokens|note"
done
