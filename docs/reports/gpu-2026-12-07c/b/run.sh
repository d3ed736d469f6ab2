# Call B (H100 80 GB, commit in machine.txt): the served matrix in one run, random:llama-3-8b bf16, 1024/256: the
# in-process engine (with the parts of the 1P1D time-sharing ceiling: prompts prefilled alone, full-batch decode
# steps), colocated and 1P1D over cuda-ipc, C 256/512/64/16/1, logprobs on and off, decode loops in engine cores.
# Run from the repository root of `git archive` of that commit, beside the wheels the GPU host lacks.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 benchmarks/h200_served.py --out $OUT/s --modes engine,colocated,1p1d --shapes 1024x256 --concurrency 256,512,64,16,1 --logprobs on,off --engine-core process --budget-s 520 > $OUT/served.log 2>&1
python3 benchmarks/h200_served_plot.py $OUT/s/h200_served.json $OUT/s/throughput_vs_tpot.png
