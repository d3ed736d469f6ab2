# Call C (H100 80 GB, commit in machine.txt): where the in-process engine's steps go with logprobs off and on (C64,
# C256, one round each, one prompt-carrying step profiled per first round), then a first `pdserve up --device cuda
# --model random:llama-3-8b` (defaults: mTLS, kvstore embedded, the prefill's loop in its engine core) at C256
# 1024/256. Run from the repository root of `git archive` of that commit, beside the wheels the GPU host lacks
# (cryptography and cffi among them: mTLS is the default).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 benchmarks/engine_step_probe.py --concurrency 64,256 --rounds 1 --profile > $OUT/probe.log 2>&1
W=/tmp/up; mkdir -p $W/logs
python3 -m services.cli up --device cuda --model random:llama-3-8b --log-dir $W/logs > $OUT/up.log 2>&1 &
UP=$!
until python3 -c "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:8000/v1/models', timeout=3)" 2>/dev/null; do sleep 1; done
python3 -m services.cli bench serve --base-url http://127.0.0.1:8000/v1 --api completions --input-tokens 1024 \
  --input-spread 0 --output-tokens 256 --output-spread 0 --ignore-eos --concurrency 256 --requests 256 --tokenizer byte \
  --num-gpus 1 --no-progress --no-plots --label up-defaults-c256 --out $W/bench256 > $OUT/up_c256.log 2>&1
kill -INT $UP; wait $UP
