# One H200, call 3: every one-GPU GPU-marked test (after the async-scheduling test's removal), logs under $OUT.
#   bash docs/reports/h200-2026-12-02/run3.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
F=$(grep -rl 'mark.gpu' tests | grep -v -e tensor_parallel_gpu -e tp_rank_pages_gpu | sort)
timeout -s INT -k 10 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --tb=line $F > $OUT/gpu_tests.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests.log; grep -E "^FAILED|^ERROR|passed|failed|Fatal|\.py:[0-9]+: " $OUT/gpu_tests.log | tail -40
