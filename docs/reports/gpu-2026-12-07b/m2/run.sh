# Call M2: the expanded MLA prompt form on the GPU: the DeepSeek GPU tests with both forms, then the engine's
# one-prompt prefill of random:deepseek-v2-lite at 2048 / 8192 tokens, absorbed against expanded, same run.
source .whl/pre.sh
LIMIT=${LIMIT:-400}
TAILN=12 step ds_gpu 200 "${PYTEST[@]}" -m gpu tests/engine/test_deepseek_gpu.py tests/engine/test_deepseek_v32_gpu.py
TAILN=16 step mla_prefill $(left $LIMIT) python3 -m benchmarks.mla_bench --section engine --batches 1 --prefill-tokens 2048,8192 --prefill-forms absorbed,expanded --out $OUT/mla_prefill.json
echo "total $(( $(date +%s) - T0 )) s"
