#!/usr/bin/env bash
# Builds the pdserve image offline and runs the pods of a Kubernetes overlay (default: cpu-local) on this
# host with podman (or docker), with the manifests' images, commands, args, env, ports and probes.
#
#   deploy/local/run-pods.sh            # build + up
#   deploy/local/run-pods.sh build      # base image (if missing) + wheelhouse + `<cli> build`
#   deploy/local/run-pods.sh up         # start every pod, wait for its startup and readiness probes
#   deploy/local/run-pods.sh probe      # run every declared probe once
#   deploy/local/run-pods.sh stop POD   # delete a pod the kubelet's way: preStop, SIGTERM, grace, SIGKILL
#   deploy/local/run-pods.sh down       # stop and remove every pod and the network (--volumes: PVCs too)
#   deploy/local/run-pods.sh plan       # print the `<cli> run` command of every pod
#
# Then: curl http://10.213.64.12:8000/v1/models (the router pod's IP; `up` prints every pod's IP), or
# `up --publish pdserve-router-0:127.0.0.1:8000:8000` for a kubectl-port-forward-like host port.
# Env: PDSERVE_OVERLAY (deploy/k8s/overlays/cpu-local), PDSERVE_IMAGE (pdserve:dev: what `build` tags and
# every pod runs in place of the overlay's pdserve image),
# PDSERVE_BASE_IMAGE (pdserve-base:bookworm), PDSERVE_CONTAINER_CLI (podman|docker), and for the build
# TORCH_VERSION / TORCH_INDEX_URL (see make-wheelhouse.sh). The mapping from Kubernetes objects to
# containers is in podspec.py and docs/DEPLOY.md.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
cd "$REPO"
source "$HERE/container-cli.sh"

OVERLAY="${PDSERVE_OVERLAY:-deploy/k8s/overlays/cpu-local}"
IMAGE="${PDSERVE_IMAGE:-pdserve:dev}"
BASE="${PDSERVE_BASE_IMAGE:-pdserve-base:bookworm}"

build() {
  local t0
  t0=$(date +%s)
  PDSERVE_BASE_IMAGE="$BASE" bash scripts/make-base-image.sh
  bash "$HERE/make-wheelhouse.sh"
  local t1
  t1=$(date +%s)
  # --network=none: nothing in the build reaches a network (base image local, wheels in the context).
  local extra=()
  [ "$CLI" = podman ] && extra=(--pull=never)
  $CLI build "${extra[@]}" --network=none -f deploy/Dockerfile -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" --build-arg OFFLINE_WHEELS=1 \
    ${TORCH_VERSION:+--build-arg TORCH_VERSION="$TORCH_VERSION"} .
  # What a rebuild leaves untagged (the build stage, the image the tag pointed at before) is ~6 GB a time:
  # pruned here, only images of deploy/Dockerfile's label, only untagged ones.
  $CLI image prune -f --filter label=io.pdserve.image=1 >/dev/null
  echo "image $IMAGE built in $(( $(date +%s) - t1 )) s (with base image and wheelhouse: $(( $(date +%s) - t0 )) s)"
}

# The overlay's `pdserve` image (any tag) is replaced by the one `build` makes, like `kustomize edit set image`.
pods() { python3 "$HERE/pods.py" --cli "$CLI" -k "$OVERLAY" --set-image "pdserve=$IMAGE" "$@"; }

cmd="${1:-all}"
[ $# -gt 0 ] && shift
case "$cmd" in
  build) build ;;
  all) build; pods up "$@" ;;
  up|probe|stop|down|plan) pods "$cmd" "$@" ;;
  *) echo "usage: $0 [build|up|probe|stop POD|down [--volumes]|plan]" >&2; exit 2 ;;
esac
