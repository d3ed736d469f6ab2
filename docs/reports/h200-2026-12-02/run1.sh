# One H200, call 1: every one-GPU GPU-marked test, then `pdserve bench moe` (kernel at real MoE shapes and
# the engine's MoE decode/prefill steps against the copy and matmul ceilings of the same run).
#   bash docs/reports/h200-2026-12-02/run1.sh        (repository root; .whl carries the packages the image lacks)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)'; } > $OUT/machine.txt 2>&1
F=$(grep -rl 'mark.gpu' tests | grep -v -e tensor_parallel_gpu -e tp_rank_pages_gpu | sort)
timeout -s INT -k 10 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs $F > $OUT/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests.log; tail -30 $OUT/gpu_tests.log
timeout -s INT -k 10 200 python3 -m services.cli bench moe --skip-ref --out $OUT/moe.json > $OUT/moe.log 2>&1
echo "moe rc=$?" >> $OUT/moe.log; tail -40 $OUT/moe.log
