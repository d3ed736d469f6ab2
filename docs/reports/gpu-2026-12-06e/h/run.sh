# Call H: Llama-3-8B engine A/B (skinny off / on), GPU engine tests with the skinny GEMM on.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-260; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5)
TAILN=12 step llama_off 90 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --skinny-rows 0 --out $OUT/llama_off.json
TAILN=12 step llama_on 90 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --skinny-rows 16 --out $OUT/llama_on.json
TAILN=6 step engine_tests 200 "${PYTEST[@]}" tests/engine/test_gpu_engine.py tests/engine/test_moe_gpu.py tests/engine/test_gpu_logprobs.py tests/engine/test_attention_sinks.py tests/engine/test_deepseek_gpu.py
