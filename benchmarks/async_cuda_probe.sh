#!/usr/bin/env bash
# One H200: async scheduling against synchronous steps on CUDA, one variant per process (a device-side
# assert poisons the CUDA context), CUDA_LAUNCH_BLOCKING=1 so a failure names its kernel.
#   bash benchmarks/async_cuda_probe.sh      (repository root; .whl carries the packages the image lacks)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in eager-greedy graphs-greedy eager-mixed graphs-mixed graphs-greedy-lp; do
  CUDA_LAUNCH_BLOCKING=1 timeout 150 python3 -m benchmarks.async_cuda_probe "$v" > "$OUT/$v.log" 2>&1
  grep RESULT "$OUT/$v.log" || { echo "$v: no result"; tail -5 "$OUT/$v.log"; }
done
