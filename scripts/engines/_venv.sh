# Sourced by scripts/engines/*.sh: where an engine's virtual environment lives, when it is
# rebuilt, how an engine that pins a CUDA torch is installed over the CPU one, how its tests run.
#
# A venv lives at ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/<engine>-<version>. A marker file
# holding the requirement list is written only after a successful install, so a half-built venv
# (an interrupted install) or a changed list is rebuilt from scratch; otherwise it is reused.
# kvstrata itself is NOT installed there: the tests import the checkout these scripts live in
# through PYTHONPATH (CI runs from a clone other than the one pip may know about).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV_DIR=${KVSTRATA_VENV_DIR:-$HOME/.cache/kvstrata/venvs}

# venv_current VENV WANT: true when VENV was fully built from exactly the list WANT
venv_current() {
  [ -f "$1/.kvstrata-installed" ] && [ "$(cat "$1/.kvstrata-installed")" = "$2" ]
}

# venv_fresh VENV: an empty venv in place of whatever was there (python3-venv from apt if needed)
venv_fresh() {
  echo "scripts/engines: building $1 (several minutes, once)" >&2
  rm -rf "$1"
  mkdir -p "$(dirname "$1")"
  if ! python3 -c 'import ensurepip' 2>/dev/null; then  # Debian/Ubuntu ship venv apart
    local sudo
    sudo=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    if [ -n "$sudo" ] && ! command -v sudo >/dev/null; then
      echo "scripts/engines: please install python3-venv (apt-get install)" >&2
      exit 1
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >/dev/null
  fi
  python3 -m venv "$1"
}

# venv_built VENV WANT: record that VENV now holds WANT
venv_built() {
  printf '%s\n' "$2" >"$1/.kvstrata-installed"
}

# install_over_cpu_torch VENV TORCH ENGINE LIGHT...: the CPU torch first, the light packages held
# to it (nothing may pull a multi-GB CUDA build), then the engine itself without its dependencies
install_over_cpu_torch() {
  local venv=$1 torch=$2 engine=$3
  shift 3
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" "$torch"
  echo "$torch" >"$venv/torch-pin.txt"
  "${pip[@]}" -c "$venv/torch-pin.txt" "$@"
  "${pip[@]}" --no-deps "$engine"
}

# run_engine_tests VENV ENGINE [--install-only | pytest arguments...]
run_engine_tests() {
  local venv=$1 engine=$2
  shift 2
  if [ "${1:-}" = "--install-only" ]; then
    return 0
  fi
  cd "$ROOT"
  KVSTRATA_ENGINE_TESTS=1 PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q \
    -p no:cacheprovider "tests/engines/$engine" "$@"
}
