# One H200, call 2: the served path against its own engine (random:llama-3-8b, bf16), 1024/256, C1-C512,
# logprobs off and on: in-process engine, `pdserve up` colocated and 1P1D over cuda-ipc, bandwidth ceiling.
#   bash docs/reports/h200-2026-12-02/run2.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
timeout -s INT -k 20 560 python3 benchmarks/h200_served.py --out $OUT --shapes 1024x256 --budget-s 440 \
  > $OUT/h200_served.log 2>&1
echo "served rc=$?" >> $OUT/h200_served.log; tail -60 $OUT/h200_served.log
