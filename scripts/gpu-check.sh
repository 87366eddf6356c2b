#!/usr/bin/env bash
# GPU check of kvstrata's CUDA paths, in one command, on a machine with one NVIDIA GPU and NO
# network. Installs nothing from a registry. Every step reports and the check goes on when a
# step fails (no `set -e`); the per-step timeouts add up to 345 s, so the whole run ends
# within 6 minutes on an H200 even if every step hangs (about 2-3 minutes when none does).
#
#   scripts/gpu-check.sh [--dry-run] [OUTDIR]     logs in OUTDIR (default $OUT or ./gpu-check-out)
#
# Exit status: 0 every step passed (or was skipped in a dry run), 1 a step failed,
# 2 no usable CUDA (the steps still run and say what they skipped).
#
# --dry-run runs every step on a machine without CUDA: the probes print their plan, the GPU
# tests are collected and skipped with their reason, the benchmark runs over the host stand-in
# at a tiny size, and the carried wheels are listed, not installed. tests/test_gpu_check.py
# runs it so the script itself is tested on CPU machines; its step limits are 4x (a
# loaded shared machine is slow to start Pythons that import torch).
#
# Steps, first what CPU tests cannot show:
#   1 machine     nvidia-smi, torch/CuPy/CUDA versions, libcudart mapped by torch
#   2 kvikio      carried wheels (.whl, KVSTRATA_WHEELS) installed into /tmp with --no-index
#                 --no-deps; without them (or if kvikio will not import) the NVMe -> GPU
#                 steps run the POSIX path, and this step says so
#   3 paths       scripts/gpu_probe.py paths: the cudart (ctypes) and CuPy runtime paths, each
#                 server + client in two processes, printing the libcudart each process mapped
#   4 ipc tests   pytest -m gpu tests/test_gpu_ipc.py: release/commit racing a copy queued
#                 behind a long kernel, device by PCI bus id, kvikio with truncated and missing
#                 files, the HF lease on a GPU-tier server, a server restart while a client
#                 holds a mapping
#   5 pinning     scripts/gpu_probe.py pin: cudaHostRegister seconds per GiB (2 GiB)
#   6 tier tests  pytest -m gpu tests/test_gpu_tier.py tests/test_store_gpu.py
#   7 benchmark   scripts/gpu_check.py (small: 32 MiB x 8 chunks, 2 passes)
#   8 vllm-e2e    scripts/gpu_vllm_e2e.py, only with VLLM_MODEL (see Environment)
#
# kvikio for CUDA 13 (torch +cu130; cupy-cuda13x, cuda-pathfinder, cuda-toolkit and
# nvidia-cufile are on the H200 image), ~4 MiB, fetched on a machine with network into .whl
# (git-ignored) and carried with the working tree:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
# (CUDA 12: kvikio-cu12, libkvikio-cu12, nvidia-cufile-cu12 and cupy-cuda12x instead.)
#
# Environment: PYTHON (default python3), NVME_DIR (a folder on the NVMe disk; default TMPDIR),
# KVSTRATA_WHEELS (default .whl), BENCH_ARGS (extra gpu_check.py arguments), VLLM_MODEL (a local
# folder of a small model, e.g. Qwen3-0.6B: step 8 runs `vllm serve` with the kvstrata tier and
# compares the second request's TTFT with the first, JSON in OUTDIR/vllm-e2e.log; skipped when unset)
# and VLLM_PYTHON (a python with vllm 0.33, default PYTHON). That step adds up to 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
DRY=0
LIMIT_SCALE=1  # a dry run runs on shared CPU machines: its limits are 4x, never the budget
if [ "${1:-}" = "--dry-run" ]; then DRY=1; LIMIT_SCALE=4; shift; fi
OUTDIR=${1:-${OUT:-$ROOT/gpu-check-out}}
PY=${PYTHON:-python3}
WHEELS=${KVSTRATA_WHEELS:-.whl}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
SUMMARY=()
FAILED=0

# step NAME SECONDS COMMAND...: run with a timeout, log to OUTDIR/NAME.log, record the result
step() {
  local name=$1 limit=$(( $2 * LIMIT_SCALE )) t0 rc
  shift 2
  echo
  echo "== $name (limit ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t0 ))
  if [ "$rc" = 0 ] && [ "$DRY" = 1 ]; then
    SUMMARY+=("$name: ran (${took}s; dry run: what needs CUDA was skipped, see its log)")
  elif [ "$rc" = 0 ]; then
    SUMMARY+=("$name: passed (${took}s)")
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    SUMMARY+=("$name: TIMED OUT after ${limit}s")
    FAILED=1
  else
    SUMMARY+=("$name: FAILED (status $rc, ${took}s)")
    FAILED=1
  fi
}

machine() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,pci.bus_id,memory.total,driver_version --format=csv,noheader
  else
    echo "nvidia-smi not found"
  fi
  "$PY" - <<'EOF'
import importlib
from kvstrata.cudart import mapped_cudart
from kvstrata.tiers.gpu_select import gpu_available
for mod in ("torch", "cupy", "kvikio", "numpy", "xxhash", "uvloop", "transformers"):
    try:
        m = importlib.import_module(mod)
        extra = f" (CUDA {m.version.cuda})" if mod == "torch" else ""
        print(f"{mod} {m.__version__}{extra}")
    except Exception as exc:
        print(f"{mod}: not importable ({type(exc).__name__}: {exc})")
print("cuda:", gpu_available(0)[1])
print("libcudart mapped after importing torch/cupy:", mapped_cudart() or "none")
EOF
}

kvikio_step() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    ls -l "$WHEELS"/*.whl
    if [ "$DRY" = 1 ]; then
      echo "dry run: the wheels above would be installed into /tmp/kvstrata-gpu-site"
    else
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvstrata-gpu-site "$WHEELS"/*.whl || echo "wheel install failed"
    fi
  else
    echo "no carried wheels in $WHEELS"
  fi
  "$PY" - <<'EOF'
from kvstrata.tiers.gpu_nvme import KvikioUnusable, import_kvikio, kvikio_mode
try:
    kvikio = import_kvikio()
    print(f"kvikio {kvikio.__version__}: mode {kvikio_mode()} "
          "(gds = GPUDirect Storage, compat = POSIX through kvikio's bounce buffers, "
          "auto-* = kvikio's global guess, a file may still fall back)")
except KvikioUnusable as exc:
    print(f"kvikio unusable ({exc}): the NVMe -> GPU steps run the POSIX path")
EOF
}

# timeout runs programs, not shell functions: the two function steps run in a child bash
export -f machine kvikio_step
export PY WHEELS DRY
# the carried kvikio is found by every later step (pytest, probes, benchmark)
[ "$DRY" = 1 ] || export PYTHONPATH="$PYTHONPATH:/tmp/kvstrata-gpu-site"

step machine 20 bash -c machine
CUDA_RC=0
"$PY" -c 'import sys; from kvstrata.tiers.gpu_select import gpu_available; sys.exit(0 if gpu_available(0)[0] else 2)' \
  || CUDA_RC=2
if [ "$CUDA_RC" != 0 ] && [ "$DRY" = 0 ]; then
  echo "gpu-check: CUDA is not usable from $PY; the GPU steps will say what they skip" >&2
fi
step kvikio 30 bash -c kvikio_step

DRYFLAG=()
BENCH=(--chunk-mib 32 --chunks 8 --repeat 2)
if [ "$DRY" = 1 ]; then DRYFLAG=(--dry-run); BENCH=(--chunk-mib 1 --chunks 2 --repeat 1); fi
PYTEST=("$PY" -m pytest -m gpu -q -rA -p no:cacheprovider)

step paths 40 "$PY" scripts/gpu_probe.py paths "${DRYFLAG[@]}"
step ipc-tests 80 "${PYTEST[@]}" tests/test_gpu_ipc.py
step pinning 20 "$PY" scripts/gpu_probe.py pin --gib 2 "${DRYFLAG[@]}"
step tier-tests 110 "${PYTEST[@]}" tests/test_gpu_tier.py tests/test_store_gpu.py
# shellcheck disable=SC2086 # BENCH_ARGS is a list of words on purpose
step benchmark 45 "$PY" scripts/gpu_check.py --bench --json "$OUTDIR/gpu-bench.json" \
  "${DRYFLAG[@]}" "${BENCH[@]}" ${NVME_DIR:+--nvme-dir "$NVME_DIR"} ${BENCH_ARGS:-}

if [ "$DRY" = 0 ] && grep -q "needs CUDA" "$OUTDIR"/ipc-tests.log "$OUTDIR"/tier-tests.log; then
  SUMMARY+=("gpu tests: SKIPPED for lack of CUDA although this is not a dry run")
  FAILED=1
fi


# optional: vllm serve with the kvstrata tier (only with VLLM_MODEL and a python that has vllm)
if [ -z "${VLLM_MODEL:-}" ]; then
  echo
  echo "== vllm-e2e not run: set VLLM_MODEL=<local folder of a small model> (and VLLM_PYTHON)"
elif [ "$DRY" = 1 ]; then
  SUMMARY+=("vllm-e2e: skipped in a dry run")
elif ! "${VLLM_PYTHON:-$PY}" -c 'import vllm' 2>/dev/null; then
  SUMMARY+=("vllm-e2e: skipped (${VLLM_PYTHON:-$PY} cannot import vllm; set VLLM_PYTHON)")
else
  step vllm-e2e 300 "$PY" scripts/gpu_vllm_e2e.py --model "$VLLM_MODEL" \
    --python "${VLLM_PYTHON:-$PY}"
fi
echo
echo "== summary ($(( $(date +%s) - started )) s$([ "$DRY" = 1 ] && echo ', dry run'))"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUTDIR/summary.txt"
if [ "$DRY" = 0 ] && [ "$CUDA_RC" != 0 ]; then exit 2; fi
[ "$FAILED" = 0 ] || exit 1
exit 0
