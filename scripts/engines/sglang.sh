#!/usr/bin/env bash
# SGLang integration tests (tests/engines/sglang) in their own virtual environment. SGLang 0.5.23
# pins a CUDA torch (2.14.1) and ~70 GPU packages, so it is installed with --no-deps over the
# project's CPU torch plus the few light packages its HiCache storage modules import (found by
# importing sglang.srt.mem_cache.storage and hicache_storage until nothing is missing; triton is
# imported at the top of sglang.srt.utils.common). The venv is created once and reused:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/sglang-0.5.23
#
# The venv is built and reused as scripts/engines/_venv.sh says.
#
#   scripts/engines/sglang.sh [--install-only] [pytest arguments...]
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

SGLANG_VERSION=0.5.23
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  orjson psutil pybase64 requests triton pillow starlette msgspec pydantic pyzmq tqdm ipython
  aiohttp
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV="$VENV_DIR/sglang-$SGLANG_VERSION"
WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "sglang==$SGLANG_VERSION --no-deps")

if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  install_over_cpu_torch "$VENV" "$TORCH" "sglang==$SGLANG_VERSION" "${LIGHT[@]}"
  venv_built "$VENV" "$WANT"
fi

run_engine_tests "$VENV" sglang "$@"
