# tp-allreduce device call (nvidia-h200-x2), from the repo root: bash docs/reports/h200x2-2026-12-01b/tp-allreduce/run.sh
# NVLink multicast off in every process (the ranks and test children inherit it; group.connect sets it too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source .mc/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 $p; done; sleep 1; }
T="python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/engine/test_tensor_parallel_gpu.py"
B="python3 benchmarks/tp_bench.py --device cuda --tp 2 --dtype bfloat16"
(nvidia-smi topo -m; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch;print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())"; lscpu | grep -E "Model name|^CPU\(s\)"; env | grep -E "NVLS|MULTICAST") > $OUT/machine.txt 2>&1
# 1. the one-shot all-reduce against NCCL (decides whether the bench compares both paths)
timeout -s INT -k 10 90 $T -s -k oneshot > $OUT/gpu_test_oneshot.log 2>&1; rc=$?; echo "oneshot test rc=$rc" >> $OUT/gpu_test_oneshot.log
grep -E "PASSED|FAILED|passed|failed|^E |rc=" $OUT/gpu_test_oneshot.log | tail -8; clean
AR=both; [ $rc = 0 ] || AR=nccl
# 2. random Llama-3-8B decode (batch 64, 2K contexts, graphs) and 8K prefill, TP=2 vs TP=1, one-shot and NCCL only
timeout -s INT -k 10 120 $B --allreduce $AR --model random:llama-3-8b --decode-batch 64 --context 2048 --prefill-tokens 8192 --allreduce-sweep > $OUT/tp_bench_8b.log 2>&1; echo "tp_bench rc=$?" >> $OUT/tp_bench_8b.log
grep -E '^\{|rc=|Error|one-shot' $OUT/tp_bench_8b.log | tail -10; clean
# 3. the other GPU TP tests (TP=2 vs TP=1 tokens/logits with graphs and eager, cuda:1 engine, cuda-ipc)
timeout -s INT -k 10 150 $T -k "not oneshot" > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.log
grep -E "PASSED|FAILED|passed|failed|^E |rc=" $OUT/gpu_tests.log | tail -10; clean
# 4. a plain --device cuda engine (no index) generates
timeout -s INT -k 5 20 python3 -c "
from services.engine.engine import LLMEngine; from services.engine.config import EngineConfig; from services.engine.sampling_params import SamplingParams
e=LLMEngine(EngineConfig(model='random:tiny-llama', device='cuda', dtype='bfloat16', num_kv_blocks=64))
o=e.generate([[1,2,3]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)); print('SMOKE plain cuda engine: device', e.runner.device, 'graphs', e.runner.graphs is not None, 'tokens', o[0])" > $OUT/smoke.log 2>&1; echo "smoke rc=$?" >> $OUT/smoke.log
grep -E "SMOKE|rc=|Error" $OUT/smoke.log; clean
# 5. what the engine adds per decode step (tiny model: the step is host work): LLMEngine.step vs graph replay
timeout -s INT -k 10 90 $B --allreduce $AR --model random:tiny-llama --decode-batch 64 --context 64 --prefill-tokens 64 --engine-steps 30 --iters 20 > $OUT/engine_step.log 2>&1; echo "engine_step rc=$?" >> $OUT/engine_step.log
grep -E '^\{|rc=|Error' $OUT/engine_step.log | tail -8; clean
