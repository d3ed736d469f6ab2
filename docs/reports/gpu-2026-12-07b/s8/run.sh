# Call S8: random:llama-3-8b bf16 8192/256: the in-process engine and colocated (decode engine-core process), C16/C64,
# logprobs on and off; ceilings measured by the bench.
source .whl/pre.sh
TAILN=30 step served8k_c 380 python3 benchmarks/h200_served.py --out $OUT/c --modes engine,colocated --shapes 8192x256 --concurrency 16,64 --logprobs off,on --engine-core process --max-prompt-tokens 2200000 --min-requests 16 --budget-s 330
echo "total $(( $(date +%s) - T0 )) s"
