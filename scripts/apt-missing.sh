# Sourced by the install scripts (Debian): queue the packages whose command or file is missing, then
# install them in one apt-get run (sudo unless root).
#   need PKG WHAT    queue PKG unless WHAT is on PATH (a command) or exists (an absolute path)
#   install_missing [OPTIONAL...]   install the queue; if that fails, once more without the OPTIONAL ones

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
missing=()

need() {
  if [[ $2 == /* ]]; then [ -e "$2" ]; else command -v "$2" >/dev/null 2>&1; fi || missing+=("$1")
}

install_missing() {
  [ ${#missing[@]} -gt 0 ] || return 0
  # -q, not -qq: apt shows each package it fetches and sets up.
  local apt=($SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
  $SUDO apt-get update -q
  "${apt[@]}" "${missing[@]}" && return 0
  [ $# -gt 0 ] || return 1
  local required=() pkg
  for pkg in "${missing[@]}"; do
    [[ " $* " == *" $pkg "* ]] || required+=("$pkg")
  done
  [ ${#required[@]} -eq 0 ] || "${apt[@]}" "${required[@]}"
}
