#!/usr/bin/env bash
# LMCache integration tests (tests/engines/lmcache) in their own virtual environment. LMCache
# 0.5.6 requires cupy-cuda13x, cuda-python, cufile-python, nvtx and a CUDA torch, so it is
# installed with --no-deps over the project's CPU torch plus the light packages its config,
# local CPU backend and remote connectors import (found by importing them until nothing is
# missing; numba for its CPU kernels, numpy held to LMCache's own <=2.2.6). The venv is created
# once and reused:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/lmcache-0.5.6
#
# A marker file holding the requirement list is written only after a successful install, so a
# half-built venv or a changed list is rebuilt. kvstrata itself is NOT installed there: the tests
# import this checkout through PYTHONPATH. redis-server must be on PATH (scripts/test.sh installs
# it) for the RedisConnector peer.
#
#   scripts/engines/lmcache.sh [--install-only] [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

LMCACHE_VERSION=0.5.6
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  pyyaml requests cachetools sortedcontainers numba prometheus_client py-cpuinfo psutil aiohttp
  aiofile msgspec pyzmq "transformers>=5.4" cryptography "numpy>=1.26,<=2.2.6"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "uvloop>=0.19" "xxhash>=3.4"
)
VENV_DIR=${KVSTRATA_VENV_DIR:-$HOME/.cache/kvstrata/venvs}
VENV="$VENV_DIR/lmcache-$LMCACHE_VERSION"
MARKER="$VENV/.kvstrata-installed"
WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "lmcache==$LMCACHE_VERSION --no-deps")

if [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$WANT" ]; then
  echo "scripts/engines/lmcache.sh: building $VENV (LMCache $LMCACHE_VERSION, CPU)" >&2
  rm -rf "$VENV"
  mkdir -p "$VENV_DIR"
  python3 -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" "$TORCH"
  echo "$TORCH" >"$VENV/torch-pin.txt"
  "${PIP[@]}" -c "$VENV/torch-pin.txt" "${LIGHT[@]}"
  "${PIP[@]}" --no-deps "lmcache==$LMCACHE_VERSION"
  printf '%s\n' "$WANT" >"$MARKER"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
KVSTRATA_ENGINE_TESTS=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/engines/lmcache "$@"
