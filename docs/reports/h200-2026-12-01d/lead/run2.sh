# Lead's device call 2 (nvidia-h200): where a 2K P/D request's TTFT goes with early prefill off and on (cuda-ipc,
# mooncake; alternating clusters), then the engine regression bench (decode steps, 8K prefill, ceilings).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
MODEL=${MODEL:-random:llama-3-8b}; DEVICE=${DEVICE:-cuda}; TOKENS=${TOKENS:-2000}
[ "$DEVICE" = cuda ] && source .mc/setup.sh  # the device lacks these wheels; a CPU check here has them
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; uptime; } > $OUT/machine2.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 10 300 python3 -m benchmarks.pd_plumbing --model $MODEL --device $DEVICE \
  --dtype bfloat16 --kv-transport cuda-ipc,mooncake --early-prefill off,on --prompt-tokens $TOKENS --chunk 2048 \
  --kv-cache-bytes 8589934592 --requests 10 --warmup 2 --service-flags "--kv-mooncake-engines 8" \
  --json $OUT/pd_plumbing2.json > $OUT/pd_plumbing2.log 2>&1
echo "plumbing rc=$?" >> $OUT/pd_plumbing2.log; tail -40 $OUT/pd_plumbing2.log; clean
if [ "$DEVICE" = cuda ]; then
  timeout -s INT -k 10 230 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --out $OUT/gpu_bench2.json > $OUT/gpu_bench2.log 2>&1
  echo "bench rc=$?" >> $OUT/gpu_bench2.log; tail -22 $OUT/gpu_bench2.log
fi
