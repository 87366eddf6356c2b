#!/usr/bin/env bash
# Installs what the tests need and runs every check: Debian's redis-server/redis-tools (real
# redis-cli, redis-benchmark and a redis-server to compare with) and docker-compose (to validate
# docker-compose.yml), kvstrata with its test extras (CPU torch from the pinned wheel), then
# ruff, mypy, the compose file check and pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
command -v docker-compose >/dev/null || need_apt+=(docker-compose)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null; then
    echo "scripts/test.sh: please install: ${need_apt[*]} (Debian/Ubuntu: apt-get install)" >&2
    exit 1
  fi
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test,hf,s3]"
python3 -m ruff check kvstrata tests bench
python3 -m mypy
docker-compose -f docker-compose.yml config -q
python3 -m pytest -q -p no:cacheprovider "$@"
scripts/engines/sglang.sh
scripts/engines/lmcache.sh
