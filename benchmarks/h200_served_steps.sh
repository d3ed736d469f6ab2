# One H200: where the served step time goes. The in-process engine and `pdserve up` (colocated and 1P1D over
# cuda-ipc, decode step loop in an engine-core process) at the same points, each with its step summary (mean step,
# tokens and rows per step, CUDA-graphed share) and first-token times; then colocated again with a
# decode-priority schedule (--mixed-step-interval 8). random:llama-3-8b bf16, 1024/256, logprobs on.
#   bash benchmarks/h200_served_steps.sh   (on the GPU host, from the repository root; results under $OUT)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
mkdir -p $OUT/a $OUT/b
timeout -s INT -k 20 340 python3 benchmarks/h200_served.py --out $OUT/a --modes engine,colocated,1p1d --shapes 1024x256 \
  --concurrency 64,256 --logprobs on --engine-core process --budget-s 250 > $OUT/a/h200_served.log 2>&1
echo "a rc=$?" >> $OUT/a/h200_served.log; tail -12 $OUT/a/h200_served.log
timeout -s INT -k 20 200 python3 benchmarks/h200_served.py --out $OUT/b --modes colocated --shapes 1024x256 \
  --concurrency 64,256 --logprobs on --engine-core process --decode-args "--mixed-step-interval 8" --budget-s 120 \
  > $OUT/b/h200_served.log 2>&1
echo "b rc=$?" >> $OUT/b/h200_served.log; tail -8 $OUT/b/h200_served.log
grep -h "steps over\|steps {\|KV pool\|max_num_seqs" $OUT/a/h200_served.log $OUT/b/h200_served.log | cut -c1-400
