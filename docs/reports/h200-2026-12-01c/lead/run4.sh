# Lead's device call 4 (nvidia-h200): the engine bench again after its CPU reference engine was made eager.
source .mc/setup.sh
(date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) > $OUT/machine4.txt 2>&1
timeout -s INT -k 10 240 python3 benchmarks/gpu_bench.py --skip-hf --skip-unfused --out $OUT/gpu_bench4.json > $OUT/gpu_bench4.log 2>&1
echo "bench rc=$?" >> $OUT/gpu_bench4.log; tail -22 $OUT/gpu_bench4.log
