#!/usr/bin/env bash
# Installs kvstrata with its test extras (CPU torch from the pinned wheel) and runs the checks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[test,hf,s3]"
python3 -m ruff check kvstrata tests bench
python3 -m mypy
if command -v docker-compose >/dev/null; then docker-compose -f docker-compose.yml config -q; fi
python3 -m pytest -q -p no:cacheprovider "$@"
