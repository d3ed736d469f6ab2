#!/usr/bin/env bash
# What the container tests need (tests/deploy/test_local_pods.py, deploy/local/run-pods.sh): Debian's
# podman with runc (crun fails on some hosts; deploy/local/container-cli.sh selects runc), debootstrap,
# and the local base image (scripts/make-base-image.sh: no container registry is needed). About a minute;
# scripts/install.sh runs it when PDSERVE_CONTAINERS=1, or in CI (CI=true) unless PDSERVE_CONTAINERS=0.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
pkgs=()
command -v podman >/dev/null 2>&1 || pkgs+=(podman)
command -v runc >/dev/null 2>&1 || pkgs+=(runc)
command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
if [ ${#pkgs[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi
$SUDO bash scripts/make-base-image.sh
