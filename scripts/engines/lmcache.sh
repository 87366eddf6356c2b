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
# The venv is built and reused as scripts/engines/_venv.sh says. redis-server must be on PATH (scripts/test.sh installs
# it) for the RedisConnector peer.
#
#   scripts/engines/lmcache.sh [--install-only] [pytest arguments...]
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

LMCACHE_VERSION=0.5.6
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  pyyaml requests cachetools sortedcontainers numba prometheus_client py-cpuinfo psutil aiohttp
  aiofile msgspec pyzmq "transformers>=5.4" cryptography "numpy>=1.26,<=2.2.6"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "uvloop>=0.19" "xxhash>=3.4"
)
VENV="$VENV_DIR/lmcache-$LMCACHE_VERSION"
WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "lmcache==$LMCACHE_VERSION --no-deps")

if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  install_over_cpu_torch "$VENV" "$TORCH" "lmcache==$LMCACHE_VERSION" "${LIGHT[@]}"
  venv_built "$VENV" "$WANT"
fi

run_engine_tests "$VENV" lmcache "$@"
