# Call Q: FP8 GEMM tests and bench (cuBLAS blockwise beside the Triton kernels); on an H200 the qwen3-30b-a3b engine and
# mixtral-8x7b batch 1 and 64 (93 GB: H200 only), then the few-row decode attention from CUDA graphs.
set -u
mkdir -p /tmp/src && rm -rf /tmp/src/* && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
echo "commit $(cat .whl/rev)" >> $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
TAILN=4 step fp8_tests 45 "${PYTEST[@]}" tests/kernels/test_fp8_block_gemm.py
TAILN=16 step fp8_gemm 70 python3 benchmarks/fp8_gemm_bench.py --no-sweep --out $OUT/fp8_gemm.json
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${mem:-0}" -gt 120000 ]; then  # an H200: the MoE engines at its sizes (an H100's qwen3 rows are in report f/n)
  TAILN=8 step qwen3_engine 140 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64,256 --skip-engine-prefill --out $OUT/moe_qwen3.json
  TAILN=10 step mixtral_engine 200 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models mixtral-8x7b --engine-batches 1,64 --skip-engine-prefill --out $OUT/moe_mixtral.json
fi
TAILN=10 step few_rows 45 python3 -m benchmarks.attention_sweep --sections few-rows --out $OUT/few_rows.json
