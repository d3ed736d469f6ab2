# Call I: fp8-e4m3 index keys on CUDA after the 16-byte row padding: the in-process diag (PTX of the score kernel as
# launched), the V3.2 GPU engine tests, and the V3.2 1P1D over cuda-ipc with both index codecs.
set -u
mkdir -p /tmp/src && tar -xf .whl/src.tar -C /tmp/src && cp -r .whl /tmp/src/ && cd /tmp/src
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH="$PYTHONPATH:/tmp/site"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/machine.txt
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"; tail -n ${TAILN:-8} "$OUT/$name.log" | cut -c1-260; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -rs --durations=5)
TAILN=40 CUDA_LAUNCH_BLOCKING=1 step fp8_diag 120 python3 .whl/fp8_diag.py
TAILN=8 step v32_engine 150 "${PYTEST[@]}" tests/engine/test_deepseek_v32_gpu.py tests/engine/test_index_region.py
TAILN=8 step v32_e2e 200 "${PYTEST[@]}" -m gpu tests/e2e/test_mla_cluster.py
