# sourced by each call: install the wheels the GPU host lacks into /tmp/site, record the machine, define step()
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> $OUT/machine.txt
lscpu | grep -E "Model name|^CPU\(s\)" >> $OUT/machine.txt
echo "commit $(cat .whl/rev)" >> $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=3)
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
