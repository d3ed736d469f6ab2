# Regression on one H200 after session 7's changes (malloc tuning, compiled-decode crossover, tp_bench
# --shard-of): every GPU-marked test that one GPU can run. From the repo root:
#   bash docs/reports/h200-2026-12-01e/regress/run.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MC_TCP_BIND_ADDRESS=127.0.0.1
source .mc/setup.sh
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log --oneline -1 2>/dev/null; } > $OUT/machine.txt 2>&1
F=$(grep -rl 'mark.gpu' tests | sort)  # the GPU-marked files (others import packages the device lacks)
timeout -s INT -k 10 480 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $F > $OUT/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests.log; tail -25 $OUT/gpu_tests.log
