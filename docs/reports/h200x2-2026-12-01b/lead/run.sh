# Lead's device call (nvidia-h200-x2, or nvidia-h200: the TP tests skip and step 3 is left out), from the repo root: bash docs/reports/h200x2-2026-12-01b/lead/run.sh
# NVLink multicast stays off in every process started here (children inherit it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .mc/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
(date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch;print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())"; lscpu | grep -E "Model name|^CPU\(s\)") > $OUT/machine.txt 2>&1
# 1. GPU tests: TP=2 vs TP=1 (graphs/eager, one-shot all-reduce last), rank-to-rank cuda-ipc pages, spec both regions over cuda-ipc
timeout -s INT -k 10 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA --timeout 70 \
  tests/engine/test_tensor_parallel_gpu.py tests/e2e/test_tp_rank_pages_gpu.py tests/engine/test_spec_gpu.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?" >> $OUT/gpu_tests.log; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests.log | tail -20; clean
# 2. the issue-10 table for mooncake (fp8 codec, 8 engines per side), prefill tail rule off (0) and on (256) in one run
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 10 200 python3 -m benchmarks.gpu_kv_table --model random:llama-3-8b --device cuda:0 \
  --prompts 2000,8000 --transports mooncake --kv-wire-codec fp8-e4m3 --kv-mooncake-engines 8 --chunk 2048 --repeats 3 \
  --prefill-tail-tokens 0,256 --json $OUT/kv_table.json > $OUT/kv_table.log 2>&1
echo "table rc=$?" >> $OUT/kv_table.log; tail -30 $OUT/kv_table.log; clean
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || exit 0  # step 3 needs two GPUs
# 3. TP=2 decode step with the one-shot all-reduce against NCCL only (same run)
timeout -s INT -k 10 100 python3 benchmarks/tp_bench.py --device cuda --tp 2 --dtype bfloat16 --allreduce both \
  --model random:llama-3-8b --decode-batch 64 --context 2048 --prefill-tokens 2048 > $OUT/tp_bench.log 2>&1
echo "tp_bench rc=$?" >> $OUT/tp_bench.log; grep -E '^\{|rc=|Error|one-shot' $OUT/tp_bench.log | tail -10; clean
