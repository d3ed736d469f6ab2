# Call C: the pair path after its down-kernel rework (tests, sweep, engine batch 1/16/64), V3.2 / random-FP8 GPU tests,
# the fp8 index-key codec on the GPU, V2-Lite MLA engine decode at batch 1/64/256, served MoE at C64 (printing).
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-10} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
step kernel_tests 60 "${PYTEST[@]}" tests/kernels/test_sparse_mla.py tests/kernels/test_moe_route.py
step gpu_tests 150 "${PYTEST[@]}" -m gpu tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_graphs.py tests/engine/test_moe_gpu.py \
  tests/engine/test_random_fp8.py tests/engine/test_deepseek_v32_gpu.py tests/engine/test_deepseek_gpu.py
TAILN=14 step moe_sweep 80 python3 -m benchmarks.moe_bench --pair-sweep --skip-cases --skip-engine --skip-ref --out $OUT/moe_sweep.json
TAILN=16 step moe_engine 130 python3 -m benchmarks.moe_bench --skip-ref --engine-models qwen3-30b-a3b --engine-batches 1,16,64 \
  --skip-engine-prefill --out $OUT/moe.json
TAILN=12 step mla_engine 100 python3 -m benchmarks.mla_bench --section engine --batches 1,64,256 --out $OUT/mla_engine.json
