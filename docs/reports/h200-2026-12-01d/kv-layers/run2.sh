#!/bin/bash
# kv-layers (issue 10), device call 2, after the layer-group write learnt to stage before decode's claim answer
# (it submits nothing before it): the GPU layer-group tests, then mooncake rows with layer groups off/on with the
# router's early prefill off (the writer is known before compute), and on (today's default).
# Usage (device, repo root): source .mc/setup.sh; bash docs/reports/h200-2026-12-01d/kv-layers/run2.sh
# CPU check: MODEL=random:tiny-llama DEVICE=cpu PROMPTS=40 OUT=/tmp/x bash run2.sh
MODEL=${MODEL:-random:llama-3-8b}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-2000,8000}
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; uptime; } > "$OUT/machine2.txt" 2>&1
if [ "$DEVICE" = cuda ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_layer_groups.py \
    tests/prefill/test_kv_pages.py > "$OUT/pytest_gpu2.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu2.txt"
fi
table() {  # $1: output name, $2: layer groups, $3: router flags
  CUDA_VISIBLE_DEVICES=0 MC_TCP_BIND_ADDRESS=127.0.0.1 timeout 200 python3 -m benchmarks.gpu_kv_table --model "$MODEL" \
    --device "$DEVICE" --prompts "$PROMPTS" --transports mooncake --kv-wire-codec native --kv-mooncake-engines 8 \
    --chunk 2048 --repeats 3 --prefill-tail-tokens 256 --kv-export-layer-group "$2" --router-flags="$3" \
    --json "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
  echo "table rc=$?" >> "$OUT/$1.txt"
}
table table2_no_early 0,4 "--no-early-prefill"
table table2_early 4 ""
