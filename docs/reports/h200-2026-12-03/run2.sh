# One H200, call 2: where the served path's CPU goes at C256 (colocated, 1024/256, logprobs on), step loop on a
# thread and in an engine-core process: cores used by each process over the point, and a 12 s py-spy profile of
# the router, the decode front and the engine core while the point runs.
#   bash docs/reports/h200-2026-12-03/run2.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
(
  for core in thread process; do
    until grep -q "colocated-$core-1024x256-lp1\] concurrency 256: random" $OUT/h200_served.log 2>/dev/null; do sleep 1; done
    sleep 12
    for role in services.router services.decode core_process; do
      pid=$(pgrep -f "$role" | head -1)
      [ -n "$pid" ] && timeout 30 py-spy record -d 12 -r 50 -f raw -o $OUT/pyspy-$core-${role#services.}.txt  -p $pid > /dev/null 2>&1 &
    done
    wait
  done
) &
timeout -s INT -k 20 400 python3 benchmarks/h200_served.py --out $OUT --modes colocated --shapes 1024x256 \
  --concurrency 256 --logprobs on --engine-core thread,process --budget-s 330 > $OUT/h200_served.log 2>&1
echo "served rc=$?" >> $OUT/h200_served.log; grep -E "cores used|concurrency 256:" $OUT/h200_served.log; tail -4 $OUT/h200_served.log
for f in $OUT/pyspy-*.txt; do echo "== $f"; python3 - "$f" <<'PY'
import sys, collections
c = collections.Counter(); tot = 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); tot += n
    frames = stack.split(";")
    seen = set()
    for fr in frames:
        fn = fr.split(" (")[0]
        if fn not in seen:
            seen.add(fn); c[fn] += n
print("samples", tot)
for fn, n in c.most_common(45): print(f"{100*n/tot:5.1f}% {fn}")
PY
done
# The async-scheduling probe after the padding-row fix (the CUDA-graph variants asserted before it).
for v in graphs-greedy graphs-greedy-lp graphs-mixed; do
  CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -m benchmarks.async_cuda_probe "$v" > "$OUT/probe-$v.log" 2>&1
  grep RESULT "$OUT/probe-$v.log" || { echo "$v: no result"; tail -5 "$OUT/probe-$v.log"; }
done
