#!/usr/bin/env bash
# Runs the whole CPU test suite (kernels under TRITON_INTERPRET=1, e2e clusters on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
ruff check .
python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
