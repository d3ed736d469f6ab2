# Call S: the served matrix on one GPU, random:llama-3-8b bf16, 1024/256: the in-process engine, colocated and 1P1D over
# cuda-ipc, C 16/64/256/512 and 1, logprobs on and off, decode engine-core processes; ceilings measured by the bench.
set -u
mkdir -p /tmp/src && rm -rf /tmp/src/* && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
echo "commit $(cat .whl/rev)" >> $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
T0=$(date +%s)
TAILN=40 step served_a 340 python3 benchmarks/h200_served.py --out $OUT/a --modes engine,colocated --shapes 1024x256 --concurrency 64,256,512,16,1 --logprobs on,off --engine-core process --budget-s 290
TAILN=30 step served_b $(( 570 - ($(date +%s) - T0) )) python3 benchmarks/h200_served.py --out $OUT/b --modes 1p1d --shapes 1024x256 --concurrency 256,512,64,16 --logprobs on,off --engine-core process --budget-s $(( 570 - ($(date +%s) - T0) - 60 ))
timeout 30 python3 benchmarks/h200_served_plot.py $OUT/a/h200_served.json $OUT/a/throughput_vs_tpot.png 2>&1 | tail -2
echo "total $(( $(date +%s) - T0 )) s"
