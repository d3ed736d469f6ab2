# H200, from the repository root of git archive of commit 826d378 (after k/run.sh installed the wheels):
python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models mixtral-8x7b --engine-batches 1,16,64,256 --out $OUT/moe_mixtral.json
python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64,256 --out $OUT/moe_qwen3.json
python3 benchmarks/h200_served.py --model random:mixtral-8x7b --modes colocated --shapes 1024x256 --concurrency 64 --logprobs off --engine-core process --out $OUT/served_mixtral
