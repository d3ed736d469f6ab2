#!/usr/bin/env bash
# The device run for the GPU engine path: tests, kernel bench, engine bench, logs under $OUT.
#   bash benchmarks/gpu_run.sh [quick|full]      (from the repository root, on the GPU box)
# quick: imports, GPU tests, a tiny engine run and --quick benches (smoke); full: the measured run.
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-/tmp/pdserve_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
QUICK=(); [ "$MODE" = quick ] && QUICK=(--quick)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'
  python3 -c 'import services.engine.engine, services.engine.cuda.gpu_attention, services.engine.cuda.cuda_graphs, kernels.paged_decode_attention; print("imports ok")'
} 2>&1 | tee "$OUT/env.log"
rc=0
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine/test_gpu_engine.py tests/engine/test_gpu_logprobs.py  2>&1 | tee "$OUT/pytest.log" || rc=1
python3 benchmarks/kernels_bench.py "${QUICK[@]}" --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels_bench.log" || rc=1
python3 benchmarks/gpu_bench.py "${QUICK[@]}" --out "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log" || rc=1
exit $rc
