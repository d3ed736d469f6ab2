#!/usr/bin/env bash
# One H200: the model-path GPU checks and benchmarks (latent attention, FP8 block-scaled weights), results under $OUT.
#   bash benchmarks/h200_models.sh tests     # GPU tests: MLA kernels + DeepSeek-V2 engine, the Triton backend, FP8 GEMM + engine
#   bash benchmarks/h200_models.sh bench     # mla_bench (kernels; engine decode step at batch 1/64/256), fp8_gemm_bench
#   bash benchmarks/h200_models.sh moe       # fused MoE GPU tests (both paths, graph replay), the pair-path sweep in
#                                            # CUDA graphs, kernel rows + engine decode/prefill (pdserve bench moe)
# Each step has its own time limit, so one that hangs leaves the others their time.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)'; } > "$OUT/machine.txt" 2>&1
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "== $name"; timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
  tail -n 25 "$OUT/$name.log" | cut -c1-220
}
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5)
case "${1:-tests}" in
  tests)
    step mla_pytest 200 "${PYTEST[@]}" tests/kernels/test_mla_decode_attention.py tests/kernels/test_mla_prefill_attention.py \
      tests/engine/test_deepseek_gpu.py
    step backend_pytest 150 "${PYTEST[@]}" -m gpu tests/engine/test_gpu_engine.py tests/engine/test_attention_sinks.py
    step fp8_pytest 180 "${PYTEST[@]}" tests/kernels/test_fp8_block_gemm.py tests/engine/test_fp8_block_weights.py
    ;;
  bench)
    step mla_kernels 120 python3 -m benchmarks.mla_bench --section kernels --out "$OUT/mla_kernels.json"
    step mla_engine 200 python3 -m benchmarks.mla_bench --section engine --batches 1,64,256 --out "$OUT/mla_engine.json"
    step fp8_gemm 200 python3 benchmarks/fp8_gemm_bench.py --out "$OUT/fp8_gemm.json"
    ;;
  moe)
    step moe_route 40 "${PYTEST[@]}" tests/kernels/test_moe_route.py
    step moe_pytest 150 "${PYTEST[@]}" -m gpu tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_graphs.py \
      tests/engine/test_moe_gpu.py
    step moe_sweep 150 python3 -m benchmarks.moe_bench --pair-sweep --skip-cases --skip-engine --skip-ref \
      --out "$OUT/moe_sweep.json"
    step moe_bench 240 python3 -m benchmarks.moe_bench --skip-ref --out "$OUT/moe.json"
    ;;
esac
