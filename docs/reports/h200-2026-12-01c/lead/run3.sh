# Lead's device call 3 (nvidia-h200), from the repo root: bash docs/reports/h200-2026-12-01c/lead/run3.sh
# The P/D path on the GPU after the review fixes (claim without an engine-thread wait, held blocks, lazy prefix
# hashing, Reserve checks): GPU page tests, then the 2K phase timeline for cuda-ipc and mooncake with colocated.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
source .mc/setup.sh
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
(date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) > $OUT/machine3.txt 2>&1
timeout -s INT -k 10 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rA --timeout 100 tests/prefill/test_kv_pages.py \
  tests/prefill/test_shared_kv.py > $OUT/gpu_tests3.log 2>&1
echo "tests rc=$?" >> $OUT/gpu_tests3.log; grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests3.log | tail -8; clean
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 10 200 python3 -m benchmarks.pd_plumbing --model random:llama-3-8b --device cuda \
  --dtype bfloat16 --kv-transport cuda-ipc,mooncake --prompt-tokens 2000 --chunk 2048 --kv-cache-bytes 8589934592 \
  --requests 12 --warmup 2 --service-flags "--kv-mooncake-engines 8" --json $OUT/pd_plumbing3.json > $OUT/pd_plumbing3.log 2>&1
echo "plumbing rc=$?" >> $OUT/pd_plumbing3.log; tail -32 $OUT/pd_plumbing3.log
