#!/usr/bin/env bash
# Makes a local stand-in for python:3.11-slim without any container registry: a Debian bookworm root
# filesystem from debootstrap (python3.11 + venv/ensurepip, CA certificates and the shared libraries the
# Mooncake wheels load), imported into podman (or docker) as $PDSERVE_BASE_IMAGE.
# deploy/Dockerfile builds on it with --build-arg BASE_IMAGE=pdserve-base:bookworm.
#
#   scripts/make-base-image.sh            # no-op when the image exists
#   PDSERVE_BASE_FORCE=1 scripts/make-base-image.sh
#
# Env: PDSERVE_BASE_IMAGE (pdserve-base:bookworm), PDSERVE_DEBIAN_MIRROR (http://deb.debian.org/debian),
# PDSERVE_CONTAINER_CLI (podman, else docker). Needs root (debootstrap) and network access to the mirror.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${PDSERVE_BASE_IMAGE:-pdserve-base:bookworm}"
MIRROR="${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# python3-venv brings ensurepip (pip + setuptools wheels); libibverbs1/libnuma1/libcurl4 are what the
# runtime stage of deploy/Dockerfile would otherwise apt-get, so the image builds without apt.
PACKAGES=python3,python3-venv,ca-certificates,libibverbs1,libnuma1,libcurl4

source deploy/local/container-cli.sh   # sets CLI (podman or docker) and exports CONTAINERS_CONF

if [ "${PDSERVE_BASE_FORCE:-0}" != 1 ] && $CLI image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists (PDSERVE_BASE_FORCE=1 to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

ROOTFS="$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)"
LOG="$ROOTFS.log"
trap 'rm -rf "$ROOTFS" "$LOG"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$LOG" 2>&1 \
  || { tail -30 "$LOG" >&2; exit 1; }
# The python:3.11-slim contract deploy/Dockerfile relies on: `python` on PATH, `python -m venv` works.
ln -sf /usr/bin/python3 "$ROOTFS/usr/local/bin/python"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log
tar --numeric-owner -C "$ROOTFS" -c . | $CLI import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$IMAGE" >"$LOG" 2>&1 || { cat "$LOG" >&2; exit 1; }
echo "base image $IMAGE made in $(( $(date +%s) - start )) s ($($CLI image inspect --format '{{.Size}}' "$IMAGE") bytes)"
