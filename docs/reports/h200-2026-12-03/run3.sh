# One H200, call 3: async scheduling on (every engine), the served path with the decode's step loop on a thread of the service (thread) and in an
# engine-core process of its own (process), colocated, random:llama-3-8b bf16, 1024/256, logprobs on, against
# the in-process engine at the same points and the copy ceiling, in one run.
#   bash docs/reports/h200-2026-12-03/run3.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
timeout -s INT -k 20 500 python3 benchmarks/h200_served.py --out $OUT --modes engine,colocated --shapes 1024x256 \
  --concurrency 64,256,512 --logprobs on --engine-core thread,process --async-scheduling on --budget-s 420 > $OUT/h200_served.log 2>&1
echo "served rc=$?" >> $OUT/h200_served.log; tail -40 $OUT/h200_served.log
