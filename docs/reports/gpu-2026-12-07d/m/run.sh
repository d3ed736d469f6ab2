# MoE and latent-attention engines, FP8 GEMM, latent-page P/D TTFT on one GPU
source .whl/common.sh  # docs/reports/gpu-2026-12-07d/common.sh
TAILN=14 step mla_engine 110 python3 -m benchmarks.mla_bench --section engine --model random:deepseek-v2-lite --batches 1,64,256 --out $OUT/mla_engine.json
TAILN=14 step fp8_gemm 70 python3 benchmarks/fp8_gemm_bench.py --no-sweep --out $OUT/fp8_gemm.json
TAILN=14 step mla_pd 140 python3 benchmarks/gpu_kv_table.py --model random:deepseek-v2-lite --prompts 2000,8000 --transports cuda-ipc --repeats 3 --chunk 2048 --json $OUT/mla_pd.json
TAILN=10 step qwen3_engine 120 python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64,256 --skip-engine-prefill --out $OUT/moe_qwen3.json
TAILN=10 step mixtral_engine $(left 575) python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models mixtral-8x7b --engine-batches 1,64 --skip-engine-prefill --out $OUT/moe_mixtral.json
echo "total $(( $(date +%s) - T0 )) s"
