# Call E (H100 80 GB, commit in machine.txt): with the engine's start-up warm-up, the step probe's first round (C64,
# logprobs off then on), then the served 1024/256 matrix in one run (engine, colocated, 1P1D with the time-sharing
# ceiling); the run's 440 s budget ended after 1P1D C256 / C512 with logprobs. Run from the repository root of
# `git archive` of that commit, beside the wheels the GPU host lacks.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 benchmarks/engine_step_probe.py --concurrency 64 --rounds 1 --max-model-len 9216 > $OUT/probe.log 2>&1
python3 benchmarks/h200_served.py --out $OUT/s --modes engine,colocated,1p1d --shapes 1024x256 --concurrency 256,512,64,16,1 --logprobs on,off --engine-core process --budget-s 440 > $OUT/served.log 2>&1
python3 benchmarks/h200_served_plot.py $OUT/s/h200_served.json $OUT/s/throughput_vs_tpot.png
