# Call N: the one-launch MoE alignment and the RoPE kernel's K/V store on the GPU: tests, its own timing against the torch form, the qwen3 MoE engine
# (batch 1/16/64/256) with it, and batch 64 with the torch form (PDSERVE_MOE_ALIGN_MAX_PAIRS=0) in the same call.
set -u
mkdir -p /tmp/src && rm -rf /tmp/src/* && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
echo "commit $(cat .whl/rev)" >> $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
TAILN=6 step gpu_tests 210 "${PYTEST[@]}" tests/kernels/test_fused_moe.py tests/kernels/test_fused_moe_graphs.py tests/kernels/test_moe_route.py tests/kernels/test_fused_ops.py tests/engine/test_moe_gpu.py tests/engine/test_gpu_engine.py
TAILN=16 step align 60 python3 -m benchmarks.moe_bench --align --skip-cases --skip-engine --skip-ref --out $OUT/align.json
TAILN=12 step qwen3_engine 180 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64,256 --skip-engine-prefill --out $OUT/moe_qwen3.json
TAILN=6 PDSERVE_MOE_ALIGN_MAX_PAIRS=0 step qwen3_engine_torch_align 80 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 64 --skip-engine-prefill --out $OUT/moe_qwen3_torch_align.json
