#!/bin/bash
# kv-layers (issue 10), device call 1: the GPU page/export and layer-group tests, then the issue-10 table with
# layer-group export off (0) and on (4 layers per group): mooncake and cuda-ipc, 2000 and 8000 tokens, chunked
# transfer on and off, native codec, 8 Mooncake engines per side, chunk 2048, tail floor 256, plus colocated.
# Usage (device, repo root): source .mc/setup.sh; bash docs/reports/h200-2026-12-01d/kv-layers/run1.sh
# CPU check of the same commands: MODEL=random:tiny-llama DEVICE=cpu PROMPTS=40 OUT=/tmp/x bash run1.sh
MODEL=${MODEL:-random:llama-3-8b}
DEVICE=${DEVICE:-cuda}
PROMPTS=${PROMPTS:-2000,8000}
GROUPS_=${GROUPS_:-0,4}
TRANSPORTS=${TRANSPORTS:-mooncake,cuda-ipc}
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; nproc;
  lscpu | grep -E "Model name|Flags"; python3 -c "import torch; print('torch', torch.__version__)"; uptime; } \
  > "$OUT/machine.txt" 2>&1
if [ "$DEVICE" = cuda ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_layer_groups.py \
    tests/prefill/test_kv_pages.py > "$OUT/pytest_gpu.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
fi
CUDA_VISIBLE_DEVICES=0 MC_TCP_BIND_ADDRESS=127.0.0.1 timeout 420 python3 -m benchmarks.gpu_kv_table --model "$MODEL" \
  --device "$DEVICE" --prompts "$PROMPTS" --transports "$TRANSPORTS" --kv-wire-codec native --kv-mooncake-engines 8 \
  --chunk 2048 --repeats 3 --prefill-tail-tokens 256 --kv-export-layer-group "$GROUPS_" --json "$OUT/table.json" \
  > "$OUT/table.txt" 2>&1
echo "table rc=$?" >> "$OUT/table.txt"
