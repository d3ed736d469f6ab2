# Lead's device call 1 (nvidia-h200), from the repo root: bash docs/reports/h200-2026-12-01c/lead/run1.sh
# GPU tests after this session's engine changes (device guard in _init_gpu, export on two side streams, Mooncake
# settle polling), then the engine regression bench.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .mc/setup.sh
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 $p; done; pkill -9 -f "services\." ; sleep 1; }
(date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch;print(torch.__version__, torch.cuda.device_count())"; lscpu | grep -E "Model name|^CPU\(s\)") > $OUT/machine.txt 2>&1
timeout -s INT -k 10 260 python3 -m pytest -q -m gpu -p no:cacheprovider -rA --timeout 120 \
  tests/kernels tests/engine/test_gpu_engine.py tests/engine/test_weights.py tests/prefill/test_kv_pages.py \
  tests/prefill/test_shared_kv.py tests/engine/test_spec_gpu.py > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?" >> $OUT/gpu_tests.log; grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/gpu_tests.log | tail -20; clean
timeout -s INT -k 10 200 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused > $OUT/gpu_bench.log 2>&1
echo "bench rc=$?" >> $OUT/gpu_bench.log; tail -40 $OUT/gpu_bench.log
