# Call K: a default `pdserve up --device cuda` (embedded kvstore, write-back through the writer process) at C256
# 1024/256 against the same with write-back off.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
ready() { python3 -c "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8000/v1/models', timeout=3)" 2>/dev/null; }
one() {
  local name=$1; shift; local W=/tmp/up_$name; mkdir -p $W
  python3 -m services.cli up --device cuda --model random:llama-3-8b --log-dir $W/logs --metrics-port-base 9300 "$@" > $W/up.log 2>&1 &
  local UP=$! i
  for i in $(seq 1 200); do ready && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
  echo "$name: ready after $i s" | tee -a $OUT/summary.txt
  timeout -s INT -k 10 200 python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions \
    --input-tokens 1024 --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 256 \
    --requests 256 --tokenizer byte --num-gpus 1 --no-progress --no-plots --label $name --seed 11 --out $W/bench > $W/bench.log 2>&1
  grep -hE "^\| $name" $W/bench.log | tee -a $OUT/summary.txt
  for p in 9303 9301; do python3 -c "import urllib.request as u; print(u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:$p/metrics', timeout=5).read().decode())" > $OUT/metrics_${name}_$p.txt 2>&1; done
  grep -hE "^pdserve_prefill_kvstore_errors_total|^process_cpu_seconds_total" $OUT/metrics_${name}_9303.txt >> $OUT/summary.txt
  grep -hE "^pdserve_kvstore_(pages|bytes|put)[a-z_]*(total)?[{ ]" $OUT/metrics_${name}_9301.txt | head -8 >> $OUT/summary.txt
  ps -eo pid,pcpu,cputime,args | grep -E "kvstore_writer|services.cli prefill|prefill" | grep -v grep | cut -c1-160 >> $OUT/summary.txt
  kill -INT $UP; for i in $(seq 40); do kill -0 $UP 2>/dev/null || break; sleep 1; done; kill -KILL $UP 2>/dev/null; wait $UP 2>/dev/null
  grep -hE "Traceback|Error|error:|writer" $W/up.log $W/logs/*.log 2>/dev/null | cut -c1-300 | head -8 >> $OUT/summary.txt
}
one defaults
PDSERVE_KVSTORE_WRITE_BACK=0 one no_writeback
cat $OUT/summary.txt
