# Call M3: the expanded MLA form for chunks after a prefix on the GPU: DeepSeek GPU tests, the engine's chunked
# prefill (8192 tokens in 2048-token chunks) absorbed against expanded, then latent-page P/D TTFT over cuda-ipc
# against colocated at 2K/8K with the expanded form as the default.
source .whl/pre.sh
LIMIT=${LIMIT:-330}
TAILN=6 step ds_gpu 110 "${PYTEST[@]}" -m gpu tests/engine/test_deepseek_gpu.py
TAILN=12 step mla_chunked 100 python3 -m benchmarks.mla_bench --section engine --batches 1 --prefill-tokens 8192 --prefill-chunk 2048 --prefill-forms absorbed,expanded --out $OUT/mla_chunked.json
TAILN=20 step mla_pd $(left $LIMIT) python3 benchmarks/gpu_kv_table.py --model random:deepseek-v2-lite --prompts 2000,8000 --transports cuda-ipc --repeats 3 --chunk 2048 --json $OUT/mla_pd.json
echo "total $(( $(date +%s) - T0 )) s"
