# Call A (H100 80 GB, commit in machine.txt): latent-page P/D TTFT over cuda-ipc with the expanded prompt form (the
# default), then chunks of 8-512 tokens after a 2048-token prefix, absorbed against expanded, on the GPU.
# Run from the repository root of `git archive` of that commit, beside the wheels the GPU host lacks.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 benchmarks/gpu_kv_table.py --model random:deepseek-v2-lite --prompts 2000,8000 --transports cuda-ipc --repeats 3 --chunk 2048 --json $OUT/mla_pd.json > $OUT/mla_pd.log 2>&1
python3 -m benchmarks.mla_prefill_ab --device cuda --prompts 8,32,64,128,171,256,512 --prefix 2048 --dtypes bfloat16 --min-chunk 1 --rounds 5 > $OUT/mla_short.log 2>&1
