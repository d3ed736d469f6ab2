# Lead's device call 3 (nvidia-h200), from the repo root: bash docs/reports/h200-2026-12-01d/lead/run1.sh
# After the review fixes of layer groups and early prefill: the GPU page tests, then cuda-ipc and mooncake rows again.
# (router early prefill on, layer-group export 4, native codec, tail 256, 8 Mooncake engines per side).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
MODEL=${MODEL:-random:llama-3-8b}; DEVICE=${DEVICE:-cuda}; PROMPTS=${PROMPTS:-2000,8000}
[ "$DEVICE" = cuda ] && source .mc/setup.sh  # the device lacks these wheels; a CPU check here has them
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; uptime; } > $OUT/machine3.txt 2>&1
if [ "$DEVICE" = cuda ]; then
  CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 5 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_layer_groups.py \
    tests/prefill/test_kv_pages.py tests/prefill/test_shared_kv.py > $OUT/gpu_tests3.log 2>&1
  echo "pytest rc=$?" >> $OUT/gpu_tests3.log; tail -3 $OUT/gpu_tests3.log; clean
fi
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 5 330 python3 -m benchmarks.gpu_kv_table --model $MODEL --device $DEVICE \
  --prompts $PROMPTS --transports cuda-ipc,mooncake --kv-wire-codec native --kv-mooncake-engines 8 --chunk 2048 \
  --repeats 3 --prefill-tail-tokens 256 --json $OUT/kv_table3.json > $OUT/kv_table3.log 2>&1
echo "table rc=$?" >> $OUT/kv_table3.log; tail -20 $OUT/kv_table3.log
