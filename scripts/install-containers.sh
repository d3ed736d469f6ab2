#!/usr/bin/env bash
# What the container tests need (tests/deploy/test_local_pods.py, deploy/local/run-pods.sh): Debian's
# podman with runc (crun fails on some hosts; deploy/local/container-cli.sh selects runc), debootstrap,
# and the local base image (scripts/make-base-image.sh: no container registry is needed). About a minute;
# scripts/install.sh runs it when PDSERVE_CONTAINERS=1, or in CI (CI=true) unless PDSERVE_CONTAINERS=0.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/apt-missing.sh
need podman podman
need runc runc
need debootstrap debootstrap
install_missing
$SUDO bash scripts/make-base-image.sh
