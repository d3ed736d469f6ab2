# Call A: MoE kernels (pair path, routing), MoE / V3.2 / random-FP8 engines on the GPU, the MoE engine figures.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)' | tee -a $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-12} "$OUT/$name.log" | cut -c1-260; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=4)
step kernel_tests 70 "${PYTEST[@]}" tests/kernels/test_moe_route.py tests/kernels/test_sparse_mla.py
step moe_gpu_tests 110 "${PYTEST[@]}" -m gpu tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_graphs.py tests/engine/test_moe_gpu.py
TAILN=16 step moe_sweep 90 python3 -m benchmarks.moe_bench --pair-sweep --skip-cases --skip-engine --skip-ref --out $OUT/moe_sweep.json
TAILN=40 step moe_bench 200 python3 -m benchmarks.moe_bench --skip-ref --engine-models qwen3-30b-a3b --out $OUT/moe.json
step model_gpu_tests 100 "${PYTEST[@]}" -m gpu tests/engine/test_random_fp8.py tests/engine/test_deepseek_v32_gpu.py
