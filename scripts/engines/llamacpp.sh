#!/usr/bin/env bash
# llama.cpp integration tests (tests/engines/llamacpp) through llama-cpp-python 0.3.36 in their
# own virtual environment. llama-cpp-python is source-only on PyPI: its sdist is downloaded and
# compiled once (CPU only, -DGGML_NATIVE=OFF so the wheel runs on any x86-64 CI machine; ~6 min
# on an idle 2-core machine, ~23 min on a loaded one) into a wheel cache that is then reused:
#
#   ${KVSTRATA_WHEEL_DIR:-~/.cache/kvstrata/wheels}/llama_cpp_python-0.3.36-*.whl
#
# The sdist's converter (vendor/llama.cpp/convert_hf_to_gguf.py with its gguf-py) turns the
# tests' tiny random Llama into GGUF at test time, so the venv also holds the CPU torch,
# transformers, safetensors and sentencepiece (the tokenizer is a SentencePiece model trained
# locally: no download). The sdist is unpacked (converter only) beside the wheel cache. The venv
# is built and reused as scripts/engines/_venv.sh says:
#
#   ${KVSTRATA_VENV_DIR:-~/.cache/kvstrata/venvs}/llamacpp-0.3.36
#
#   scripts/engines/llamacpp.sh [--install-only] [pytest arguments...]
set -euo pipefail
# shellcheck source=scripts/engines/_venv.sh
source "$(dirname "$0")/_venv.sh"

LLAMACPP_VERSION=0.3.36
WHEEL_DIR=${KVSTRATA_WHEEL_DIR:-$HOME/.cache/kvstrata/wheels}
SDIST="$WHEEL_DIR/llama_cpp_python-$LLAMACPP_VERSION.tar.gz"
SRC="$WHEEL_DIR/llama_cpp_python-$LLAMACPP_VERSION-src"
TORCH="torch==2.13.0"  # the CPU wheel scripts/test.sh installs; installed first, then held
LIGHT=(
  "transformers>=5.4" safetensors "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21" pyyaml tqdm
  requests "numpy>=1.26" "pytest>=8" "pytest-timeout>=2.3" "redis>=5.0" "uvloop>=0.19"
  "xxhash>=3.4"
)
VENV="$VENV_DIR/llamacpp-$LLAMACPP_VERSION"
pip=(python3 -m pip --disable-pip-version-check)

mkdir -p "$WHEEL_DIR"
if [ ! -f "$SDIST" ]; then
  "${pip[@]}" download -q --no-deps --no-binary :all: -d "$WHEEL_DIR" \
    "llama-cpp-python==$LLAMACPP_VERSION"
fi
wheel=$(ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMACPP_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  echo "scripts/engines/llamacpp.sh: compiling llama-cpp-python $LLAMACPP_VERSION (once)" >&2
  CMAKE_ARGS="-DGGML_NATIVE=OFF" "${pip[@]}" wheel -q --no-deps -w "$WHEEL_DIR" "$SDIST"
  wheel=$(ls "$WHEEL_DIR"/llama_cpp_python-"$LLAMACPP_VERSION"-*.whl | head -n1)
fi
if [ ! -f "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
  rm -rf "$SRC" "$SRC.tmp"
  mkdir -p "$SRC.tmp"
  top="llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp"
  tar -xzf "$SDIST" -C "$SRC.tmp" --strip-components=1 \
    "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py"
  mv "$SRC.tmp" "$SRC"
fi

WANT=$(printf '%s\n' "$TORCH" "${LIGHT[@]}" "$(basename "$wheel")")
if ! venv_current "$VENV" "$WANT"; then
  venv_fresh "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH"
  echo "$TORCH" >"$VENV/torch-pin.txt"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$VENV/torch-pin.txt" \
    "${LIGHT[@]}" "$wheel"
  venv_built "$VENV" "$WANT"
fi

export KVSTRATA_LLAMACPP_CONVERTER="$SRC/vendor/llama.cpp/convert_hf_to_gguf.py"
run_engine_tests "$VENV" llamacpp "$@"
