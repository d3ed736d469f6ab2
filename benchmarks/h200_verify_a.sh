# One GPU (H200, or H100 80 GB): the served matrix at 1024/256 for the verification goals. random:llama-3-8b bf16,
# the in-process engine, `pdserve up` colocated and 1P1D over cuda-ipc (decode step loop in an engine-core process),
# C 16/64/256/512, logprobs on and off (C1 left out to fit the device time); then the throughput-vs-TPOT plot, the engines' KV pool lines and every
# failed/429 count. h200_served.py runs points mode by mode (engine, colocated, 1p1d), then logprobs, then the
# concurrencies in the order given, and records a point that would start after --budget-s as skipped: the order
# below (logprobs on first; C256, C512, C64, C16) means what a short budget drops is 1P1D's logprobs-off C16/C64 first.
#   bash benchmarks/h200_verify_a.sh   (on the GPU host, from the repository root; results under $OUT; <= ~7 min)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv,noheader > $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
cat $OUT/machine.txt
timeout -s INT -k 20 390 python3 benchmarks/h200_served.py --out $OUT/a --modes engine,colocated,1p1d --shapes 1024x256 \
  --concurrency 256,512,64,16 --logprobs on,off --engine-core process --budget-s 315 > $OUT/a/h200_served.log 2>&1
echo "a rc=$? after $(( $(date +%s) - T0 )) s" >> $OUT/a/h200_served.log
tail -40 $OUT/a/h200_served.log | cut -c1-300
grep -h "kv cache\|KV cache of\|KV pool\|gpu-memory-utilization\|max_num_seqs" $OUT/a/h200_served.log | cut -c1-500 > $OUT/a/kv_pool.txt
grep -h "errors\|429\|Traceback\|Error\|timed out\|skipped" $OUT/a/h200_served.log | cut -c1-400 > $OUT/a/failures.txt
timeout 60 python3 benchmarks/h200_served_plot.py $OUT/a/h200_served.json $OUT/a/throughput_vs_tpot.png 2>&1 | tail -3
echo "total $(( $(date +%s) - T0 )) s"
