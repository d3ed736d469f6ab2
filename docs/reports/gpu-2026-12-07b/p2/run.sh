# Call P2: a GPU prefill's step loop in an engine-core process (its front opens the core's CUDA pool by IPC handle):
# tokens of a 1P1D cluster over cuda-ipc and grpc against the in-process engine, then 1P1D 1024/256 at C256/C512,
# logprobs off/on, with the prefill's loop in a core process and on a thread (same run).
source .whl/pre.sh
LIMIT=${LIMIT:-570}
TAILN=8 step check_ipc 90 python3 benchmarks/gpu_cluster_check.py --kv-transport cuda-ipc --prefill-engine-core process
TAILN=8 step check_grpc 80 python3 benchmarks/gpu_cluster_check.py --kv-transport grpc --prefill-engine-core process
TAILN=24 step pd_process 220 python3 benchmarks/h200_served.py --out $OUT/p --modes 1p1d --shapes 1024x256 --concurrency 256,512 --logprobs off,on --engine-core process --prefill-engine-core process --budget-s 180
TAILN=24 step pd_thread $(left $LIMIT) python3 benchmarks/h200_served.py --out $OUT/t --modes 1p1d --shapes 1024x256 --concurrency 256,512 --logprobs off,on --engine-core process --prefill-engine-core thread --budget-s $(( $(left $LIMIT) - 40 ))
echo "total $(( $(date +%s) - T0 )) s"
