# Call C: engine figures after the tile changes and the fresh-prompt SDPA route, then the kernel tests on the GPU.
set -u
mkdir -p /tmp/src && rm -rf /tmp/src/* && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
TAILN=30 step gpu_bench 170 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --out $OUT/gpu_bench.json
TAILN=30 step moe_engine 170 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64 --out $OUT/moe.json
TAILN=6 step kernel_tests 150 "${PYTEST[@]}" tests/kernels/test_prefill_attention.py tests/kernels/test_paged_decode_attention.py tests/kernels/test_fresh_prompt_attention.py tests/kernels/test_fused_moe.py
