#!/bin/bash
# alternate before (5dc61a2) / after (working tree) runs of the same bench
for i in 1 2 3 4 5; do  # run as 1 2, then 3 4 5
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/tps/before_tree
    (cd $dir && echo "== $side $i $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" && timeout 900 python -m benchmarks.tp_rank_writes_bench --requests 8 2>/dev/null | python -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({k:(v['compute_ms_per_request'] if isinstance(v,dict) and 'compute_ms_per_request' in v else v) for k,v in d.items() if k!='args'}))")
  done
done
