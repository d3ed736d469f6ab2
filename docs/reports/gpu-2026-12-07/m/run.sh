# Call M: the deepseek-v2-lite latent engine at batch 1/64/256, the FP8 GEMM against the fp8 ceiling, latent-page P/D
# TTFT over cuda-ipc at 2K/8K (the three rows, one run); then the latent kernels, the v3-cut FP8 engine and
# the fused forward with partial RoPE (GLM-4.5) on the GPU while time is left.
source .whl/pre.sh
LIMIT=${LIMIT:-570}
TAILN=14 step mla_engine 150 python3 -m benchmarks.mla_bench --section engine --batches 1,64,256 --out $OUT/mla_engine.json
TAILN=30 step fp8_gemm 90 python3 benchmarks/fp8_gemm_bench.py --no-sweep --out $OUT/fp8_gemm.json
TAILN=20 step mla_pd 220 python3 benchmarks/gpu_kv_table.py --model random:deepseek-v2-lite --prompts 2000,8000 --transports cuda-ipc --repeats 3 --chunk 2048 --json $OUT/mla_pd.json
TAILN=6 step glm_gpu $(left $((LIMIT - 10))) "${PYTEST[@]}" tests/kernels/test_fused_ops.py -k model_fused
[ "$(left $LIMIT)" -gt 100 ] && TAILN=14 step mla_kernels $(left $LIMIT) python3 -m benchmarks.mla_bench --section kernels --out $OUT/mla_kernels.json
echo "total $(( $(date +%s) - T0 )) s"
