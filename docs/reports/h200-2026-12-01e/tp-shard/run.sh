# One H200: per-rank compute of TP=2 (one rank's share of Llama-3-8B run whole, no collectives) against
# TP=1, kernel profiles of both decode steps, decode attention partition sweep. From the repo root:
#   bash docs/reports/h200-2026-12-01e/tp-shard/run.sh
source .mc/setup.sh
D=docs/reports/h200-2026-12-01e/tp-shard
(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; lscpu | grep -E "Model name|^CPU\(s\)") > $OUT/machine.txt 2>&1
timeout -s INT -k 10 150 python3 $D/attn_sweep.py > $OUT/attn_sweep.log 2>&1; echo "rc=$?" >> $OUT/attn_sweep.log; cat $OUT/attn_sweep.log
timeout -s INT -k 10 240 python3 benchmarks/tp_bench.py --device cuda --model random:llama-3-8b --dtype bfloat16 --decode-batch 64 --context 2048 --prefill-tokens 8192 --shard-of 2 --profile-steps 5 --profile-top 30 > $OUT/shard2.log 2>&1; echo "rc=$?" >> $OUT/shard2.log
grep -E "ratio|rc=|Error" $OUT/shard2.log | tail -5
timeout -s INT -k 10 150 python3 benchmarks/tp_bench.py --device cuda --model random:llama-3-8b --dtype bfloat16 --decode-batch 64 --context 2048 --prefill-tokens 8192 --shard-of 2 --graphs off --profile-steps 3 --profile-top 30 > $OUT/shard2_eager.log 2>&1; echo "rc=$?" >> $OUT/shard2_eager.log
grep -E "ratio|rc=|Error" $OUT/shard2_eager.log | tail -5
