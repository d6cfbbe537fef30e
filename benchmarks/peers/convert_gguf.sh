#!/usr/bin/env bash
# A catalog model that ships no GGUF (llama-1b) as a bf16 GGUF, made by llama.cpp's own converter
# (convert_hf_to_gguf.py and its gguf-py, from the llama.cpp that build_llama_server.sh unpacked, so
# the file matches the server that reads it), for the serving benchmark's llama-server peer; the
# benchmark requantises it to Q8_0 and Q4_0 with llama.cpp as it does SmolLM2's.
#
#   bash benchmarks/peers/convert_gguf.sh llama-1b     # ~1-2 min the first time, prints the file
#
# The file lands in ~/.cache/accelab/peers/MODEL-bf16.gguf (ACCELAB_CACHE moves it).
set -euo pipefail

MODEL="${1:?usage: convert_gguf.sh MODEL (a catalog name, fetched: accelab models fetch MODEL)}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD="${LLAMA_SERVER_BUILD:-$ROOT/benchmarks/peers/build}"
LLAMA="$BUILD/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
CACHE="${ACCELAB_CACHE:-$HOME/.cache/accelab}"
OUT="$CACHE/peers/$MODEL-bf16.gguf"
SRC="$("$ROOT/.venv/bin/python" -c "from accelab.catalog.store import model_dir; print(model_dir('$MODEL'))")"

if [ -f "$OUT" ]; then
  echo "$OUT"
  exit 0
fi
[ -f "$LLAMA/convert_hf_to_gguf.py" ] || {
  echo "no $LLAMA/convert_hf_to_gguf.py: run bash benchmarks/peers/build_llama_server.sh first" >&2
  exit 1
}
mkdir -p "$(dirname "$OUT")"
PYTHONPATH="$LLAMA/gguf-py" "$ROOT/.venv/bin/python" "$LLAMA/convert_hf_to_gguf.py" "$SRC" \
  --outtype bf16 --outfile "$OUT.part" >&2
mv "$OUT.part" "$OUT"
echo "$OUT"
