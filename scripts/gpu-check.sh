#!/usr/bin/env bash
# GPU check of kvstrata's gpu tier: the CUDA tests (pytest -m gpu) and the benchmark
# (scripts/gpu_check.py), on a machine with one NVIDIA GPU and NO network. Installs nothing from
# a registry; takes about 1-3 minutes on an H200 and is capped at 7.5 minutes by the timeouts
# below. Exit status: 0 all good, 1 a test failed or bytes were wrong, 2 no usable CUDA.
#
#   scripts/gpu-check.sh [OUTDIR]          results: OUTDIR/gpu-tests.log, OUTDIR/gpu-bench.json
#
# Environment: PYTHON (default python3), NVME_DIR (a folder on the NVMe disk for the NVMe
# benchmark; default TMPDIR), KVSTRATA_WHEELS (folder of carried wheels, default .whl),
# BENCH_ARGS (extra arguments for gpu_check.py, e.g. "--chunk-mib 32 --chunks 8"),
# VLLM_MODEL (a local folder of a small model, e.g. Qwen3-0.6B: runs `vllm serve` with the
# kvstrata tier and compares the second request's TTFT with the first, OUTDIR/vllm-e2e.json;
# skipped when unset) and VLLM_PYTHON (a python with vllm 0.33, default PYTHON). That step
# adds up to 5 minutes.
#
# Needs, already there on this workplace's H200 image: python3 with torch built for CUDA,
# numpy, xxhash, pytest, pytest-timeout. Optional: kvikio (its tests and the kvikio path of the
# NVMe -> GPU benchmark are skipped with a message without it). kvikio is carried as wheels
# made on a machine with network, matching the GPU machine's CUDA major version
# (python3 -c 'import torch; print(torch.version.cuda)') and Python (3.12 on the H200 image):
#
#   CUDA 13 (torch +cu130; cupy-cuda13x, cuda-pathfinder, cuda-toolkit and nvidia-cufile are
#   already on the H200 image, so three wheels, ~4 MiB):
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#       kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
#   CUDA 12: the same command with
#       kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 rapids-logger==0.3.0 \
#       nvidia-cufile-cu12==1.14.1.1 cupy-cuda12x==14.2.0 cuda-pathfinder==1.9.0
#     (plus numpy>=2 and packaging if missing; read a wheel's needs with
#      unzip -p .whl/NAME-*.whl '*/METADATA' | grep ^Requires-Dist).
#   Requirements as read from the 26.10.0 wheels: kvikio-cuXX needs cupy-cudaXXx[ctk]>=14.0.1,
#   libkvikio-cuXX==26.10.*, numpy>=2,<3, packaging; libkvikio-cuXX needs cuda-pathfinder,
#   cuda-toolkit[cufile]==XX.*, rapids-logger==0.3.* (and nvidia-cufile-cu12 for CUDA 12).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUTDIR=${1:-${OUT:-$ROOT/gpu-check-out}}
PY=${PYTHON:-python3}
WHEELS=${KVSTRATA_WHEELS:-.whl}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)

echo "== machine"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi not found"
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA build:", torch.version.cuda)' \
    || echo "torch is not importable by $PY"
  echo "gpu-check: CUDA is not usable from $PY (needs torch built for CUDA and a driver)" >&2
  exit 2
fi

if [ -d "$WHEELS" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "== installing carried wheels from $WHEELS (no index, no network)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvstrata-gpu-site "$WHEELS"/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/kvstrata-gpu-site"
fi
"$PY" - <<'EOF'
from kvstrata.tiers.gpu_nvme import kvikio_mode
mode = kvikio_mode()
if mode == "absent":
    print("kvikio: not importable; its test and the kvikio NVMe->GPU path are skipped")
else:
    import kvikio
    print(f"kvikio {kvikio.__version__}: {mode} (gds = GPUDirect Storage, compat = POSIX bounce)")
EOF

echo "== GPU tests (pytest -m gpu)"
tests_rc=0
timeout 270 "$PY" -m pytest -m gpu tests/test_gpu_tier.py tests/test_store_gpu.py -q -rs -p no:cacheprovider \
  2>&1 | tee "$OUTDIR/gpu-tests.log" || tests_rc=$?
if grep -q "needs CUDA" "$OUTDIR/gpu-tests.log"; then
  echo "gpu-check: tests were skipped for lack of CUDA although torch sees a GPU" >&2
  tests_rc=1
fi

echo "== benchmark (scripts/gpu_check.py)"
bench_rc=0
# shellcheck disable=SC2086 # BENCH_ARGS is a list of words on purpose
timeout 180 "$PY" scripts/gpu_check.py --bench --json "$OUTDIR/gpu-bench.json" \
  ${NVME_DIR:+--nvme-dir "$NVME_DIR"} ${BENCH_ARGS:-} || bench_rc=$?

echo "== vLLM end to end (scripts/gpu_vllm_e2e.py)"
vllm_rc=0
vllm_state=skipped
if [ -z "${VLLM_MODEL:-}" ]; then
  echo "skipped: set VLLM_MODEL=<local folder of a small model> (and VLLM_PYTHON=<python with vllm 0.33>)"
elif ! "${VLLM_PYTHON:-$PY}" -c 'import vllm' 2>/dev/null; then
  echo "skipped: ${VLLM_PYTHON:-$PY} cannot import vllm (set VLLM_PYTHON)"
else
  timeout 300 "$PY" scripts/gpu_vllm_e2e.py --model "$VLLM_MODEL" --python "${VLLM_PYTHON:-$PY}" \
    | tee "$OUTDIR/vllm-e2e.json" || vllm_rc=$?
  vllm_state=$([ "$vllm_rc" = 0 ] && echo passed || echo "FAILED (status $vllm_rc)")
fi

echo "== summary ($(( $(date +%s) - started )) s)"
echo "gpu tests: $([ "$tests_rc" = 0 ] && echo passed || echo "FAILED (status $tests_rc)")"
echo "benchmark: $([ "$bench_rc" = 0 ] && echo done || echo "FAILED (status $bench_rc)")"
echo "vllm e2e: $vllm_state"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$vllm_rc" = 0 ]
