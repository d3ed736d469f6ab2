# One GPU (H200, or H100 80 GB): (1) a first-time user's `pdserve up --device cuda --model random:llama-3-8b` (no KV,
# memory or batch flags: 1 prefill + 1 decode on the one GPU, kvstore embedded, kv-transport auto) serving C256 at
# 1024/256 with `pdserve bench serve` (byte tokenizer, so prompts are exactly 1024 tokens): 429/failed counts, and
# the KV pools the engines logged against the device memory nvidia-smi showed free before the start; (2) the long-prompt
# served points: 8192/256, C64/C16, logprobs on, in-process engine, colocated and 1P1D over cuda-ipc (engine-core
# process). C1 and C256 at 8192/256 are left out to fit the device time (C256: 2.1M prompt tokens per mode).
#   bash benchmarks/h200_verify_b.sh   (on the GPU host, from the repository root; results under $OUT; <= ~7 min)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/b/up $OUT/b/long
nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv,noheader > $OUT/machine_b.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine_b.txt
cat $OUT/machine_b.txt

# (1) first-time user
nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv > $OUT/b/up/nvidia_smi_before.txt
python3 -m services.cli up --device cuda --model random:llama-3-8b > $OUT/b/up/up.log 2>&1 &
UP=$!
python3 - <<'EOF' > $OUT/b/up/ready.txt 2>&1
import time, urllib.request
op = urllib.request.build_opener(urllib.request.ProxyHandler({}))
t0 = time.monotonic()
while time.monotonic() - t0 < 120:
    try:
        op.open("http://127.0.0.1:8000/v1/models", timeout=3).read()
        print(f"ready after {time.monotonic() - t0:.1f} s"); break
    except OSError:
        time.sleep(1)
else:
    print("not ready after 120 s")
EOF
cat $OUT/b/up/ready.txt
nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv > $OUT/b/up/nvidia_smi_ready.txt
timeout -s INT -k 10 100 python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions \
  --input-tokens 1024 --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 256 \
  --requests 256 --tokenizer byte --num-gpus 1 --no-progress --no-plots --label up-defaults --out $OUT/b/up/bench \
  > $OUT/b/up/bench.log 2>&1
echo "bench rc=$? at $(el) s" >> $OUT/b/up/bench.log
tail -8 $OUT/b/up/bench.log | cut -c1-400
kill -INT $UP 2>/dev/null   # pdserve up: router first, then the engines, each tier drains
for i in $(seq 30); do kill -0 $UP 2>/dev/null || break; sleep 1; done
kill -0 $UP 2>/dev/null && { echo "up still running after 30 s: second SIGINT (kills what is left)"; kill -INT $UP; sleep 8; }
kill -0 $UP 2>/dev/null && { echo "up still running: SIGKILL"; kill -KILL $UP; sleep 3; }
wait $UP; echo "up rc=$? at $(el) s" >> $OUT/b/up/up.log
grep -h "kv cache\|KV cache of\|KV pool\|gpu-memory-utilization\|Traceback\|Error\|OOM\|out of memory" $OUT/b/up/up.log \
  | cut -c1-500 > $OUT/b/up/kv_pool.txt
echo "access-log wire statuses:" $(grep -o 'wire=[^ ,]*' $OUT/b/up/up.log | sort | uniq -c) >> $OUT/b/up/kv_pool.txt
echo "access-log status values:" $(grep -o ' status=[^ ,]*' $OUT/b/up/up.log | sort | uniq -c) >> $OUT/b/up/kv_pool.txt
cat $OUT/b/up/nvidia_smi_before.txt $OUT/b/up/kv_pool.txt
nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader > $OUT/b/up/nvidia_smi_after_stop.txt
echo "(1) done at $(el) s"

# (2) 8192/256 at C64, C16, logprobs on
REM=$(( 395 - $(el) ))
timeout -s INT -k 15 $REM python3 benchmarks/h200_served.py --out $OUT/b/long --modes engine,colocated,1p1d \
  --shapes 8192x256 --concurrency 64,16 --logprobs on --engine-core process --budget-s $(( REM - 75 )) \
  > $OUT/b/long/h200_served.log 2>&1
echo "long rc=$? at $(el) s" >> $OUT/b/long/h200_served.log
tail -12 $OUT/b/long/h200_served.log | cut -c1-300
grep -h "kv cache\|KV cache of\|errors\|429\|Traceback\|timed out" $OUT/b/long/h200_served.log | cut -c1-500 \
  > $OUT/b/long/kv_and_failures.txt

echo "total $(el) s"
