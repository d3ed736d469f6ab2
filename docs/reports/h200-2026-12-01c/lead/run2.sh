# Lead's device call 2 (nvidia-h200), from the repo root: bash docs/reports/h200-2026-12-01c/lead/run2.sh
# 1. where a 2K P/D request's TTFT goes on the H200 (phase timeline per transport, colocated beside it);
# 2. the issue-10 table for every transport with today's defaults (native codec, tail 256, 8 Mooncake engines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
source .mc/setup.sh
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
(date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) > $OUT/machine2.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 10 220 python3 -m benchmarks.pd_plumbing --model random:llama-3-8b --device cuda \
  --dtype bfloat16 --kv-transport cuda-ipc,mooncake,grpc --prompt-tokens 2000 --chunk 2048 --kv-cache-bytes 8589934592 \
  --requests 10 --warmup 2 --service-flags "--kv-mooncake-engines 8" --json $OUT/pd_plumbing.json > $OUT/pd_plumbing.log 2>&1
echo "plumbing rc=$?" >> $OUT/pd_plumbing.log; tail -45 $OUT/pd_plumbing.log; clean
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 5 240 python3 -m benchmarks.gpu_kv_table --model random:llama-3-8b --device cuda:0 \
  --prompts 2000,8000 --transports cuda-ipc,mooncake,grpc --kv-wire-codec native --kv-mooncake-engines 8 --chunk 2048 \
  --repeats 3 --prefill-tail-tokens 256 --json $OUT/kv_table.json > $OUT/kv_table.log 2>&1
echo "table rc=$?" >> $OUT/kv_table.log; tail -24 $OUT/kv_table.log
