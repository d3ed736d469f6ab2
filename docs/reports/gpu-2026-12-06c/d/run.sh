# Call D: the GPU tests after the index-key store fix, the MoE / MLA engine decode steps with the tuned pair path.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
step gpu_tests 110 "${PYTEST[@]}" -m gpu tests/engine/test_deepseek_v32_gpu.py tests/engine/test_deepseek_gpu.py \
  tests/engine/test_random_fp8.py tests/kernels/test_fused_moe_graphs.py
TAILN=8 step moe_engine 110 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16 \
  --skip-engine-prefill --out $OUT/moe.json
