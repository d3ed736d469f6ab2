python3 -m benchmarks.moe_bench --skip-ref --skip-cases --engine-models qwen3-30b-a3b --engine-batches 1,16,64 --out $OUT/moe.json
