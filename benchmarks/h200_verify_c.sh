# One GPU (H200, or H100 80 GB): (1) a first-time user's `pdserve up --device cuda --model random:llama-3-8b` (no KV,
# memory or batch flags: 1 prefill + 1 decode on the one GPU) serving C256 at 1024/256 (`pdserve bench serve`, byte
# tokenizer): failed/429 counts and the KV pools the engines logged against the memory nvidia-smi showed free before
# the start; (2) 1P1D over cuda-ipc at C512 and C256, 1024/256, logprobs on, where the decode's share of one GPU holds
# fewer tokens than the burst: Reserves wait their turn for blocks (router --block-wait-s, decode --reserve-wait-s).
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
timeout -s INT -k 10 200 python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions \
  --input-tokens 1024 --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 256 \
  --requests 256 --tokenizer byte --num-gpus 1 --no-progress --no-plots --label up-defaults --out $W/up/bench \
  > $W/up/bench.log 2>&1
echo "bench rc=$? at $(el) s" >> $W/up/bench.log
kill -INT $UP 2>/dev/null
for i in $(seq 40); do kill -0 $UP 2>/dev/null || break; sleep 1; done
kill -KILL $UP 2>/dev/null; wait $UP 2>/dev/null
{ cat $W/up/ready.txt; cat $W/up/nvidia_smi_before.txt $W/up/nvidia_smi_ready.txt; grep -E "^\|" $W/up/bench.log | tail -3
  grep -hE "kv cache|KV cache of|gpu-memory-utilization|Traceback|Error|error:" $W/up/up.log $W/up/logs/*.log 2>/dev/null | cut -c1-400 | head -20
  tail -3 $W/up/bench.log; } > $OUT/c_up_summary.txt
cat $OUT/c_up_summary.txt
left=$(( 540 - $(el) )); echo "1P1D budget $left s"
if [ $left -gt 120 ]; then
  timeout -s INT -k 20 $left python3 benchmarks/h200_served.py --out $W/pd --modes 1p1d --shapes 1024x256 \
    --concurrency 512,256 --logprobs on --engine-core process --budget-s $(( left - 100 )) > $W/pd/h200_served.log 2>&1
  echo "h200_served rc=$? at $(el) s" >> $W/pd/h200_served.log
  tail -15 $W/pd/h200_served.log | cut -c1-400 > $OUT/c_pd_summary.txt; cat $OUT/c_pd_summary.txt
fi
tar -czf $OUT/c.tar.gz -C /tmp c --exclude='*.safetensors' 2>/dev/null
ls -la $OUT
