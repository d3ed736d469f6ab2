# Call R: cuBLAS blockwise FP8 GEMM via torch._scaled_mm: the FP8 tests, the GEMM bench, and the DeepSeek-V3-shaped FP8
# model (random:deepseek-v3-cut) engine rows with it and with PDSERVE_FP8_GEMM=triton in the same call.
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
TAILN=4 step fp8_tests 45 "${PYTEST[@]}" tests/kernels/test_fp8_block_gemm.py
TAILN=16 step fp8_gemm 70 python3 benchmarks/fp8_gemm_bench.py --no-sweep --out $OUT/fp8_gemm.json
TAILN=8 step v3cut 90 python3 -m benchmarks.mla_bench --section engine --model random:deepseek-v3-cut --batches 1,64 --out $OUT/v3cut.json
TAILN=8 PDSERVE_FP8_GEMM=triton step v3cut_triton 90 python3 -m benchmarks.mla_bench --section engine --model random:deepseek-v3-cut --batches 1,64 --out $OUT/v3cut_triton.json
