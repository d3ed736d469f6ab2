# H100 (no H200 came): GPU tests of the fresh-prompt route, the SDPA bucket probe, the qwen3-30b-a3b engine rows,
# then 8192/256 1P1D over cuda-ipc at C256 (the moving-queue reservation wait), colocated C256 as the budget allows
source .whl/common.sh  # docs/reports/gpu-2026-12-07d/common.sh
TAILN=6 step gpu_tests 110 "${PYTEST[@]}" tests/kernels/test_fresh_prompt_attention.py tests/engine/test_gpu_engine.py
TAILN=14 step sdpa_probe 50 python3 -m benchmarks.sdpa_shapes_probe --lengths 8
TAILN=40 step pd8k $(left 540) python3 benchmarks/h200_served.py --out $OUT/pd8k --modes 1p1d --shapes 8192x256 --concurrency 256 --logprobs off --engine-core process --max-prompt-tokens 2200000 --budget-s $(left 500)
TAILN=30 step colo8k $(left 545) python3 benchmarks/h200_served.py --out $OUT/colo8k --modes colocated --shapes 8192x256 --concurrency 256 --logprobs off --engine-core process --max-prompt-tokens 2200000 --budget-s $(left 500)
echo "total $(( $(date +%s) - T0 )) s"
