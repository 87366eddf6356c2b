#!/usr/bin/env bash
# vLLM integration tests (tests/engines/vllm) in their own virtual environment: vLLM pins its own
# torch (a CUDA build, ~9 GB with its dependencies, ~6 minutes to install), which clashes with the
# project's, so it never goes into the main environment. The venv is created once and reused:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/vllm-0.33.0
#
# A marker file holding the requirement list is written only after a successful install, so a
# half-built venv (interrupted install) or a changed requirement list is rebuilt from scratch.
# kvstrata itself is NOT installed there: the tests import the checkout this script lives in
# through PYTHONPATH (CI runs from a clone other than the one pip may know about).
#
#   scripts/engines/vllm.sh [--install-only] [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

VLLM_VERSION=0.33.0
REQUIREMENTS=(
  "vllm==$VLLM_VERSION"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "cryptography>=42"
  "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV_DIR=${KVSTRATA_VENV_DIR:-$HOME/.cache/kvstrata/venvs}
VENV="$VENV_DIR/vllm-$VLLM_VERSION"
MARKER="$VENV/.kvstrata-installed"
WANT=$(printf '%s\n' "${REQUIREMENTS[@]}")

if [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$WANT" ]; then
  echo "scripts/engines/vllm.sh: building $VENV (vLLM $VLLM_VERSION, several minutes)" >&2
  rm -rf "$VENV"
  mkdir -p "$VENV_DIR"
  if ! python3 -c 'import ensurepip' 2>/dev/null; then  # Debian/Ubuntu ship venv apart
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
      echo "scripts/engines/vllm.sh: please install python3-venv (apt-get install)" >&2
      exit 1
    fi
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
  fi
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # vLLM pins its own torch: a machine-wide pip constraint on torch (a local CPU wheel cap) must
  # not apply inside this venv.
  PIP_CONSTRAINT="" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${REQUIREMENTS[@]}"
  printf '%s\n' "$WANT" >"$MARKER"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
KVSTRATA_ENGINE_TESTS=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engines/vllm "$@"
