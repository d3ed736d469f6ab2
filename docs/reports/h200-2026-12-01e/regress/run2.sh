# The weights test after the GPU tests that ran before it in run.sh (it now measures what the load adds to
# the memory earlier tests still hold). From the repo root: bash docs/reports/h200-2026-12-01e/regress/run2.sh
source .mc/setup.sh
timeout -s INT -k 10 300 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/engine/test_layer_groups.py \
  tests/engine/test_spec_gpu.py tests/engine/test_weights.py > $OUT/gpu_tests2.log 2>&1
echo "pytest rc=$?" >> $OUT/gpu_tests2.log; tail -6 $OUT/gpu_tests2.log
