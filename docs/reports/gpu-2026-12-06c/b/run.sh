# Call B: served MoE at C64, MLA P/D over cuda-ipc, the DeepSeek-V3-shaped FP8 model, V3.2 / random-FP8 GPU tests.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-14} "$OUT/$name.log" | cut -c1-300; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5)
step kernel_tests 60 "${PYTEST[@]}" tests/kernels/test_sparse_mla.py tests/kernels/test_moe_route.py
step gpu_tests 130 "${PYTEST[@]}" -m gpu tests/engine/test_random_fp8.py tests/engine/test_deepseek_v32_gpu.py
step served_moe 190 python3 benchmarks/h200_served.py --out $OUT/served_moe --model random:qwen3-30b-a3b --modes engine,colocated \
  --shapes 1024x256 --concurrency 64 --logprobs off --engine-core process --budget-s 160
step mla_pd 120 python3 benchmarks/gpu_kv_table.py --model random:deepseek-v2-lite --prompts 2000,8000 --transports cuda-ipc \
  --repeats 3 --chunk 2048 --json $OUT/mla_pd.json
TAILN=30 step v3cut 90 python3 -m benchmarks.mla_bench --section engine --model random:deepseek-v3-cut --batches 1,64 --out $OUT/v3cut.json
