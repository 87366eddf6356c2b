#!/usr/bin/env bash
# SGLang's real server (python -m sglang.launch_server) with HiCache and kvstrata as its L3 storage,
# on CPU (tests/engines/sglang_server). SGLang 0.5.23 pins a CUDA torch (2.14.1) and ~70 GPU
# packages, so, as in scripts/engines/sglang.sh, it is installed with --no-deps over the project's
# CPU torch; the light list here is what the server itself imports at launch (found by launching it
# until nothing was missing). sgl-kernel (CUDA objects only), torchvision (a CUDA build on PyPI),
# flashinfer and the other GPU packages are left out: the test-only shims in
# tests/engines/sglang_server/shims stand in for the little of them a CPU launch touches. The venv
# is its own (the storage-backend suite's venv stays small) and is reused:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/sglang-server-0.5.23
#
#   scripts/engines/sglang-server.sh [--install-only] [pytest arguments...]
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

SGLANG_VERSION=0.5.23
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  aiohttp blobfile einops fastapi gguf interegular ipython llguidance msgspec ninja
  nvidia-ml-py "openai==2.8.0" "openai-harmony==0.0.4" orjson packaging partial_json_parser
  pillow "prometheus-client>=0.20" psutil pybase64 pydantic python-multipart "pyzmq>=25.1.2"
  regex requests scipy "sentencepiece==0.2.1" setproctitle tiktoken "tokenizers==0.23.2" tqdm
  "transformers==5.19.0" "uvicorn>=0.51" watchfiles "xgrammar==0.2.7" zstandard triton
  safetensors huggingface_hub "compressed-tensors==0.18.0" anthropic dill jsonschema
  "soundfile==0.13.1"
  "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "numpy>=1.26" "uvloop>=0.19" "xxhash>=3.4"
)
VENV="$VENV_DIR/sglang-server-$SGLANG_VERSION"
WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "sglang==$SGLANG_VERSION --no-deps")

if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  install_over_cpu_torch "$VENV" "$TORCH" "sglang==$SGLANG_VERSION" "${LIGHT[@]}"
  venv_built "$VENV" "$WANT"
fi

run_engine_tests "$VENV" sglang_server "$@"
