# Sourced by deploy/local/run-pods.sh and scripts/make-base-image.sh: picks the container CLI.
#   CLI=podman (preferred) or docker; PDSERVE_CONTAINER_CLI=docker|podman forces one.
# For podman it writes a private containers.conf and exports CONTAINERS_CONF (podman then reads only that
# file; nothing global is changed):
#   - runtime runc when installed (PDSERVE_OCI_RUNTIME overrides): podman's default crun fails here;
#   - default ulimits nofile = this shell's hard limit and nproc = min(hard limit, 32768): podman's
#     defaults (1048576 files, 4194304 processes as root) are refused where the hard limits are lower
#     (no CAP_SYS_RESOURCE), and podman itself caps its own nproc at 32768, which its children inherit.
# shellcheck shell=bash

pdserve_pick_cli() {
  local want="${PDSERVE_CONTAINER_CLI:-}"
  if [ -n "$want" ]; then
    command -v "$want" >/dev/null 2>&1 || { echo "PDSERVE_CONTAINER_CLI=$want: not installed" >&2; return 1; }
    CLI="$want"
  elif command -v podman >/dev/null 2>&1; then
    CLI=podman
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    CLI=docker
  else
    echo "neither podman nor a running docker daemon is available" >&2
    return 1
  fi
  if [ "$CLI" = podman ] && [ -z "${PDSERVE_KEEP_CONTAINERS_CONF:-}" ]; then
    local runtime="${PDSERVE_OCI_RUNTIME:-}"
    if [ -z "$runtime" ] && command -v runc >/dev/null 2>&1; then runtime=runc; fi
    local nofile nproc
    nofile="$(ulimit -Hn)"
    nproc="$(ulimit -Hu)"
    [ "$nofile" = unlimited ] && nofile=1048576
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    local conf="${TMPDIR:-/tmp}/pdserve-containers-$(id -u).conf"
    {
      echo "[containers]"
      echo "default_ulimits = [\"nofile=${nofile}:${nofile}\", \"nproc=${nproc}:${nproc}\"]"
      echo "[engine]"
      [ -n "$runtime" ] && echo "runtime = \"${runtime}\""
    } >"$conf"
    export CONTAINERS_CONF="$conf"
  fi
  export CLI
}

pdserve_pick_cli
