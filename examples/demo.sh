#!/usr/bin/env bash
# The demo `make demo` runs after installing and fetching the models: the before/after tables
# of the blog posts, measured on this machine, with a quality verdict on every row. Each table
# has the techniques of the blog posts and the runtimes that can help where those do not (on a
# CPU without native bf16, ONNX Runtime and OpenVINO are what pays: `accelab env` says which
# techniques this CPU runs well).
set -euo pipefail
OUT=${DEMO_OUT:-out/demo}
mkdir -p "$OUT"

echo "== SmolLM2-135M (real weights), greedy decoding of 32 tokens, batch 1 and 16"
accelab compare smollm2-135m --scenario generate --new-tokens 32 --min-seconds 2 --min-iters 3 --warmup 1 \
  --plans baseline,bf16-autocast,fp16-autocast,static-cache,int8-weight --samples 8 \
  --markdown "$OUT/smollm2.md" --tag demo
accelab compare smollm2-135m --scenario generate --new-tokens 32 --min-seconds 2 --min-iters 3 --warmup 1 \
  --plans "baseline,baseline[batch_size=16]" --samples 8 --markdown "$OUT/smollm2-batch.md" --tag demo

echo "== all-MiniLM-L6-v2 (real weights), embeddings, batch 32, seq 128"
accelab compare minilm-l6 --batch-size 32 --seq-len 128 \
  --plans baseline,bf16-autocast,fp16-autocast,int8-dynamic,compile,onnxruntime-fused,onnxruntime-int8,openvino \
  --samples 32 \
  --markdown "$OUT/minilm.md" --tag demo

echo "== ResNet-50 (random weights, real size), 224px photos, batch 8"
accelab compare resnet-50 --batch-size 8 \
  --plans baseline,channels-last,bf16-autocast,compile,onnxruntime,openvino --samples 16 \
  --markdown "$OUT/resnet50.md" --tag demo
