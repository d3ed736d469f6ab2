# One GPU (H200, or H100 80 GB): (1) a first-time user's `pdserve up --device cuda --model random:llama-3-8b` (no KV,
# memory or batch flags: 1 prefill + 1 decode on the one GPU) serving C256 and C512 at 1024/256 (`pdserve bench serve`, byte
# tokenizer): failed/429 counts and the KV pools the engines logged against the memory nvidia-smi showed free before
# the start; then C512 on the same cluster, where the decode's share of the GPU holds fewer tokens than the burst
# (Reserves wait their turn for blocks: router --block-wait-s, decode --reserve-wait-s); refusals counted from the logs.
# Everything lands in $OUT/c.tar.gz plus two summaries (the runner returns few files).
#   bash benchmarks/h200_verify_c.sh   (on the GPU host, from the repository root; <= ~9 min)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
W=/tmp/c; mkdir -p $W/up $W/pd
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,memory.used,memory.free,driver_version --format=csv > $W/up/nvidia_smi_before.txt
python3 -m services.cli up --device cuda --model random:llama-3-8b --log-dir $W/up/logs > $W/up/up.log 2>&1 &
UP=$!
ready() { python3 -c "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8000/v1/models', timeout=3)" 2>/dev/null; }
for i in $(seq 1 300); do ready && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
echo "up ready after $i s (rc of up if it ended: $(kill -0 $UP 2>/dev/null && echo running || echo ended))" | tee $W/up/ready.txt
nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv > $W/up/nvidia_smi_ready.txt
for c in 256 512; do
  timeout -s INT -k 10 170 python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions \
    --input-tokens 1024 --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency $c \
    --requests $c --tokenizer byte --num-gpus 1 --no-progress --no-plots --label up-defaults-c$c --out $W/up/bench$c \
    > $W/up/bench$c.log 2>&1
  echo "bench C$c rc=$? at $(el) s" >> $W/up/bench$c.log
done
kill -INT $UP 2>/dev/null
for i in $(seq 40); do kill -0 $UP 2>/dev/null || break; sleep 1; done
kill -KILL $UP 2>/dev/null; wait $UP 2>/dev/null
{ cat $W/up/ready.txt; cat $W/up/nvidia_smi_before.txt $W/up/nvidia_smi_ready.txt; grep -hE "^\| up-" $W/up/bench256.log $W/up/bench512.log
  grep -hE "kv cache|KV cache of|gpu-memory-utilization|Traceback|Error|error:" $W/up/up.log $W/up/logs/*.log 2>/dev/null | cut -c1-400 | head -20
  tail -n 2 $W/up/bench256.log $W/up/bench512.log
  echo "refusals in the service logs:"; grep -hoiE "(RESOURCE_EXHAUSTED|OVERLOADED|429)[^\"]{0,160}" $W/up/logs/*.log | sort | uniq -c | sort -rn | head -8
  grep -hE "gpu-memory-utilization" $W/up/up.log | head -3; } > $OUT/c_up_summary.txt
cat $OUT/c_up_summary.txt
tar -czf $OUT/c.tar.gz -C /tmp c --exclude='*.safetensors' 2>/dev/null
ls -la $OUT
