# a default `pdserve up --device cuda --model random:llama-3-8b` (1P1D on the one GPU, mTLS, kvstore) at C512 1024/256
source .whl/common.sh  # docs/reports/gpu-2026-12-07d/common.sh
W=/tmp/up; mkdir -p $W/logs
python3 -m services.cli up --device cuda --model random:llama-3-8b --log-dir $W/logs > $OUT/up.log 2>&1 &
UP=$!
for i in $(seq 200); do python3 -c "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8000/v1/models', timeout=3)" 2>/dev/null && break; sleep 1; done
echo "ready after $(( $(date +%s) - T0 )) s"
TAILN=6 step up_c512 $(left 300) python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions --input-tokens 1024 \
  --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 512 --requests 512 --tokenizer byte \
  --num-gpus 1 --no-progress --no-plots --label up-defaults-c512 --out $W/bench512
kill -INT $UP; wait $UP
grep -h "kv cache sized" $W/logs/*.log | cut -c1-260 > $OUT/up_pools.txt; cat $OUT/up_pools.txt
cp $W/bench512/*/report.json $OUT/ 2>/dev/null; echo "total $(( $(date +%s) - T0 )) s"
