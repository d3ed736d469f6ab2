# Call E: (1) fp8-e4m3 index keys on CUDA, in process, CUDA_LAUNCH_BLOCKING=1; (2) a default `pdserve up --device cuda`
# at C256 1024/256: as is, with the prefill's kvstore write-back off, and without a kvstore (attribution).
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-300; }
TAILN=40 CUDA_LAUNCH_BLOCKING=1 step fp8_repro 150 python3 .whl/fp8_index_repro.py
ready() { python3 -c "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8000/v1/models', timeout=3)" 2>/dev/null; }
one() {  # name, extra up flags...
  local name=$1; shift; local W=/tmp/up_$name; mkdir -p $W
  python3 -m services.cli up --device cuda --model random:llama-3-8b --log-dir $W/logs --metrics-port-base 9300 "$@" > $W/up.log 2>&1 &
  local UP=$! i
  for i in $(seq 1 200); do ready && break; kill -0 $UP 2>/dev/null || break; sleep 1; done
  echo "$name: ready after $i s" | tee -a $OUT/summary.txt
  (sleep 45; top -b -n1 -w 200 | head -25 > $OUT/top_$name.txt) &
  timeout -s INT -k 10 200 python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions \
    --input-tokens 1024 --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 256 \
    --requests 256 --tokenizer byte --num-gpus 1 --no-progress --no-plots --label $name --seed 7 --out $W/bench > $W/bench.log 2>&1
  grep -hE "^\| $name" $W/bench.log | tee -a $OUT/summary.txt
  for p in 9303 9304 9301; do python3 -c "import urllib.request as u; print(u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:$p/metrics', timeout=5).read().decode())" > $OUT/metrics_${name}_$p.txt 2>&1; done
  grep -hE "kvstore_(errors|write)|write_back" $OUT/metrics_${name}_9303.txt | grep -v "^#" | head -12 >> $OUT/summary.txt
  kill -INT $UP; for i in $(seq 40); do kill -0 $UP 2>/dev/null || break; sleep 1; done; kill -KILL $UP 2>/dev/null; wait $UP 2>/dev/null
  grep -hE "Traceback|Error|error:" $W/up.log $W/logs/*.log 2>/dev/null | cut -c1-300 | head -8 >> $OUT/summary.txt
  tar -czf $OUT/up_$name.tar.gz -C $W logs bench 2>/dev/null
}
one defaults
PDSERVE_KVSTORE_WRITE_BACK=0 one no_writeback
one no_kvstore --kvstore none
cat $OUT/summary.txt
