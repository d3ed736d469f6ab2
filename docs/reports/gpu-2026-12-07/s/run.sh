# Call S: random:llama-3-8b bf16 served 8192/256 on one GPU: the in-process engine, colocated and 1P1D over cuda-ipc
# (decode engine-core processes), C16/64/256, logprobs on and off; ceilings measured by the bench.
source .whl/pre.sh
TAILN=30 step served8k_a 280 python3 benchmarks/h200_served.py --out $OUT/a --modes engine,colocated --shapes 8192x256 --concurrency 64,256,16 --logprobs on,off --engine-core process --max-prompt-tokens 2200000 --min-requests 16 --budget-s 230
TAILN=30 step served8k_b $(left 540) python3 benchmarks/h200_served.py --out $OUT/b --modes 1p1d --shapes 8192x256 --concurrency 256,64,16 --logprobs on,off --engine-core process --max-prompt-tokens 2200000 --min-requests 16 --budget-s $(( $(left 540) - 50 ))
echo "total $(( $(date +%s) - T0 )) s"
timeout 20 python3 benchmarks/h200_served_plot.py $OUT/a/h200_served.json $OUT/a/throughput_vs_tpot.png 2>&1 | tail -1
