#!/usr/bin/env bash
# vLLM CPU's int8: a compressed-tensors W8A8 checkpoint (int8 weights a channel, int8 activations a
# token, made at run time) of a catalog model, made by llm-compressor as its docs show, for the
# serving benchmark's int8-against-int8 peer (benchmarks/serve_llm.py --only vllm-w8a8).
#
#   bash benchmarks/peers/make_w8a8.sh smollm2-135m        # ~3-5 min the first time (its venv), ~10 s after
#
# llm-compressor lives in a venv of its own (.venv-llmcompressor: it resolves transformers 5.17 and
# compressed-tensors 0.19, the main venv has 5.24), torch 2.13.0 (the CPU wheel) installed first.
# Data-free: W8A8's activations are quantized per token at run time, so no calibration set is
# needed; the output layer stays as it is (llm-compressor's own example leaves lm_head out).
# The checkpoint lands in ~/.cache/accelab/peers/MODEL-w8a8 (ACCELAB_CACHE moves it).
set -euo pipefail

MODEL="${1:?usage: make_w8a8.sh MODEL (a catalog name, fetched: accelab models fetch MODEL)}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${LLMCOMPRESSOR_VENV:-$ROOT/.venv-llmcompressor}"
CACHE="${ACCELAB_CACHE:-$HOME/.cache/accelab}"
OUT="$CACHE/peers/$MODEL-w8a8"
SRC="$("$ROOT/.venv/bin/python" -c "from accelab.catalog.store import model_dir; print(model_dir('$MODEL'))")"

if [ -f "$OUT/config.json" ]; then
  echo "$OUT"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --upgrade pip
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
  "$VENV/bin/pip" install --quiet "torch==2.13.0" "llmcompressor==0.14.0.1"
  # PyPI's torchvision is a CUDA build that breaks imports beside the CPU torch; text needs none
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
mkdir -p "$(dirname "$OUT")"
"$VENV/bin/python" - "$SRC" "$OUT.part" <<'PY'
import shutil
import sys

from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")  # the checkpoint's own precision
tokenizer = AutoTokenizer.from_pretrained(src)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
for name in ("chat_template.jinja", "generation_config.json"):
    try:
        shutil.copy(f"{src}/{name}", f"{out}/{name}")
    except FileNotFoundError:
        pass
PY
rm -rf "$OUT"
mv "$OUT.part" "$OUT"
echo "$OUT"
