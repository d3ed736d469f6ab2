# Call G: GPU tests of the changed kernels and engines, the skinny GEMM against cuBLAS, then the engine rows A/B
# (skinny GEMM off / on at <= 16 rows): qwen3-30b-a3b batch 1/16, Llama-3-8B gpu_bench.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-260; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5 -x)
TAILN=40 step skinny 150 python3 -m benchmarks.skinny_gemm_bench --sweep-rows 1 --out $OUT/skinny.json
TAILN=5 step kernel_tests 150 "${PYTEST[@]}" tests/kernels/test_paged_decode_attention.py tests/kernels/test_mla_decode_attention.py tests/kernels/test_fused_moe.py tests/kernels/test_fused_ops.py tests/kernels/test_skinny_gemm.py
TAILN=9 step moe_off 110 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --skip-engine-prefill --engine-models qwen3-30b-a3b --engine-batches 1,16 --skinny-rows 0 --out $OUT/moe_off.json
TAILN=9 step moe_on 110 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --skip-engine-prefill --engine-models qwen3-30b-a3b --engine-batches 1,16 --skinny-rows 16 --out $OUT/moe_on.json
