#!/usr/bin/env bash
# vLLM integration tests (tests/engines/vllm) in their own virtual environment: vLLM pins its own
# torch (a CUDA build, ~9 GB with its dependencies, ~6 minutes to install), which clashes with the
# project's, so it never goes into the main environment. The venv is created once and reused
# (scripts/engines/_venv.sh):
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/vllm-0.33.0
#
#   scripts/engines/vllm.sh [--install-only] [pytest arguments...]
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

VLLM_VERSION=0.33.0
REQUIREMENTS=(
  "vllm==$VLLM_VERSION"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "cryptography>=42"
  "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV="$VENV_DIR/vllm-$VLLM_VERSION"
WANT=$(printf '%s\n' "${REQUIREMENTS[@]}")

if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # vLLM pins its own torch: a machine-wide pip constraint on torch (a local CPU wheel cap) must
  # not apply inside this venv.
  PIP_CONSTRAINT="" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${REQUIREMENTS[@]}"
  venv_built "$VENV" "$WANT"
fi

run_engine_tests "$VENV" vllm "$@"
