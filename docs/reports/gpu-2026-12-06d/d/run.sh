# Call D: GPU engine tests (bf16 + graphs vs the CPU fp32 engine), the qwen3 MoE engine after the fused q/k norm,
# V3.2 1P1D over cuda-ipc (the index region in place), Llama-8B engine rows, the MoE down-tile sweep, decode tiles.
set -u
mkdir -p /tmp/src && rm -rf /tmp/src/* && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
git_rev=$(cat .whl/rev 2>/dev/null); echo "commit $git_rev" >> $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5)
TAILN=6 step engine_tests 150 "${PYTEST[@]}" tests/engine/test_gpu_engine.py tests/engine/test_moe_gpu.py tests/engine/test_gpu_logprobs.py tests/engine/test_attention_sinks.py tests/kernels/test_fused_ops.py
TAILN=9 step moe_engine 130 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64 --out $OUT/moe.json
TAILN=6 step e2e_cuda_ipc 150 "${PYTEST[@]}" -m gpu tests/e2e/test_mla_cluster.py
TAILN=12 step gpu_bench 90 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --out $OUT/gpu_bench.json
TAILN=6 step moe_sweep 150 python3 -m benchmarks.moe_bench --skip-ref --skip-engine --sweep --sweep-phase prefill --out $OUT/moe_sweep.json
grep -E "^sweep|^down sweep" $OUT/moe_sweep.log
TAILN=7 step attn_decode 80 python3 -m benchmarks.attention_sweep --sections decode --out $OUT/attention_decode.json
