# Call A: tile sweeps of the attention kernels and the fused MoE prefill, then the MoE engine at H200 sizes.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-240; }
TAILN=30 step attn_sweep 240 python3 -m benchmarks.attention_sweep --out $OUT/attention_sweep.json
TAILN=12 step moe_sweep 200 python3 -m benchmarks.moe_bench --skip-ref --skip-engine --sweep --sweep-phase prefill --out $OUT/moe_sweep.json
grep -E "^sweep|prefill" $OUT/moe_sweep.log | cut -c1-240
