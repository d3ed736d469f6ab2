# Lead's second device call (nvidia-h200): the issue-10 table for every transport with today's defaults
# (native codec, prefill tail rule 256, 8 mooncake engines per side), one run.
source .mc/setup.sh
(date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv) > $OUT/machine2.txt 2>&1
CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 5 210 python3 -m benchmarks.gpu_kv_table --model random:llama-3-8b --device cuda:0 \
  --prompts 2000,8000 --transports cuda-ipc,mooncake,grpc --kv-wire-codec native --kv-mooncake-engines 8 --chunk 2048 \
  --repeats 3 --prefill-tail-tokens 256 --json $OUT/kv_table2.json > $OUT/kv_table2.log 2>&1
echo "table rc=$?" >> $OUT/kv_table2.log; tail -22 $OUT/kv_table2.log
