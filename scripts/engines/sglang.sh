#!/usr/bin/env bash
# SGLang integration tests (tests/engines/sglang) in their own virtual environment. SGLang 0.5.23
# pins a CUDA torch (2.14.1) and ~70 GPU packages, so it is installed with --no-deps over the
# project's CPU torch plus the few light packages its HiCache storage modules import (found by
# importing sglang.srt.mem_cache.storage and hicache_storage until nothing is missing; triton is
# imported at the top of sglang.srt.utils.common). The venv is created once and reused:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/sglang-0.5.23
#
# A marker file holding the requirement list is written only after a successful install, so a
# half-built venv or a changed list is rebuilt. kvstrata itself is NOT installed there: the tests
# import this checkout through PYTHONPATH.
#
#   scripts/engines/sglang.sh [--install-only] [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

SGLANG_VERSION=0.5.23
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  orjson psutil pybase64 requests triton pillow starlette msgspec pydantic pyzmq tqdm ipython
  aiohttp
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV_DIR=${KVSTRATA_VENV_DIR:-$HOME/.cache/kvstrata/venvs}
VENV="$VENV_DIR/sglang-$SGLANG_VERSION"
MARKER="$VENV/.kvstrata-installed"
WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "sglang==$SGLANG_VERSION --no-deps")

if [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$WANT" ]; then
  echo "scripts/engines/sglang.sh: building $VENV (SGLang $SGLANG_VERSION, CPU)" >&2
  rm -rf "$VENV"
  mkdir -p "$VENV_DIR"
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" "$TORCH"
  echo "$TORCH" >"$VENV/torch-pin.txt"
  "${PIP[@]}" -c "$VENV/torch-pin.txt" "${LIGHT[@]}"
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
  printf '%s\n' "$WANT" >"$MARKER"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
KVSTRATA_ENGINE_TESTS=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engines/sglang "$@"
