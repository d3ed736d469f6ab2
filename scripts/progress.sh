# Sourced by the install scripts: numbered steps, each announced and timed, so a long install can be
# watched (which step, which package set, how long it took).
#   STEPS=N             how many steps the script runs (for "step 2/N")
#   step WHAT CMD...    run CMD under the heading WHAT; its elapsed time after it (or its failure)

step_n=0
install_t0=$SECONDS

step() {
  local what=$1 t0=$SECONDS rc=0
  shift
  step_n=$((step_n + 1))
  echo "==> [${step_n}/${STEPS:-?}] ${what}" >&2
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "==> [${step_n}/${STEPS:-?}] ${what}: FAILED (exit ${rc}) after $((SECONDS - t0)) s" >&2
    return "$rc"
  fi
  echo "==> [${step_n}/${STEPS:-?}] ${what}: done in $((SECONDS - t0)) s (total $((SECONDS - install_t0)) s)" >&2
}
