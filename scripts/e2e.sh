#!/usr/bin/env bash
# End-to-end test of the app in its real web view: tests/e2e/test_app.py drives the debug build
# (target/debug/perch-app, built by `cargo test` or `cargo build -p perch-app`) through
# tauri-driver and WebKitWebDriver under Xvfb, with the imported default model, and the model picker
# against a fake Hugging Face Hub on 127.0.0.1 (perch-hub's `fake-hub`, serving the same model in
# the mlx-community layout). Both come from scripts/test-inputs.sh (run by scripts/test.sh).
# Screenshots land in target/e2e. Installs what it needs (Debian packages, tauri-driver into
# target/tools).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  need=""
  for pkg in xvfb xauth xdotool webkit2gtk-driver dbus-x11 at-spi2-core fonts-dejavu-core; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need="$need $pkg"
  done
  if [ -n "$need" ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $need >/dev/null
  fi
fi
driver=target/tools/bin/tauri-driver
bash scripts/install-tauri-driver.sh
[ -x target/debug/perch-app ] || cargo build -p perch-app
cargo build --quiet -p perch-hub --features fake-hub --bin fake-hub

inputs="${PERCH_TEST_INPUTS:-$PWD/target/test-inputs}"
for model in SmolLM2-135M-Instruct-Q4_1 SmolLM2-135M-Instruct-Q4_1-mlx; do
  [ -f "$inputs/$model/config.json" ] || { echo "e2e: $inputs/$model is missing: run bash scripts/test-inputs.sh" >&2; exit 1; }
done
data=$(mktemp -d)
# WebKit may start xdg-document-portal, which mounts $HOME/.cache/doc (FUSE) and outlives the
# app: unmount it, and never let cleaning up turn a passed run into a failed one.
hub=""
cleanup() {
  # Under `set -e` a failing command here would end the script with its status: none may fail.
  [ -z "$hub" ] || kill "$hub" 2>/dev/null || true
  fusermount -u -z "$data/home/.cache/doc" 2>/dev/null || true
  rm -rf "$data" 2>/dev/null || true
}
trap cleanup EXIT
export PERCH_DATA_DIR="$data/perch"
# The launch-at-login entry goes to $HOME/.config/autostart: keep it out of the real home.
export HOME="$data/home"
mkdir -p "$HOME"
export PERCH_MODEL="${PERCH_E2E_MODEL:-$inputs/SmolLM2-135M-Instruct-Q4_1}"
# Perch's models directory holds the same model (a link), so the chat's model switcher can go
# back to it after the model picker loaded another.
mkdir -p "$data/models"
ln -s "$PERCH_MODEL" "$data/models/$(basename "$PERCH_MODEL")"
export PERCH_MODELS_DIR="$data/models"
export PERCH_E2E_OUT="$PWD/target/e2e"
# PERCH_E2E_DARK=1: the same tour under a dark GTK theme, which WebKitGTK reports to the page as
# `prefers-color-scheme: dark` (screenshots in target/e2e-dark).
if [ -n "${PERCH_E2E_DARK:-}" ]; then
  export GTK_THEME=Adwaita:dark PERCH_E2E_OUT="$PWD/target/e2e-dark"
fi
# The Hub the model picker talks to, and the cache it downloads into. The fake slows each 64 KiB
# so that the download's progress can be seen.
export HF_HUB_CACHE="$data/hf-hub"
export PERCH_E2E_HUB_REPO=mlx-community/SmolLM2-135M-Instruct-4bit
target/debug/fake-hub --repo "$PERCH_E2E_HUB_REPO=$inputs/SmolLM2-135M-Instruct-Q4_1-mlx" \
  --chunk-delay-ms 3 >"$data/fake-hub.url" &
hub=$!
for _ in $(seq 100); do [ -s "$data/fake-hub.url" ] && break; sleep 0.1; done
HF_ENDPOINT=$(head -n 1 "$data/fake-hub.url")
export HF_ENDPOINT
export LANG="${LANG:-C.UTF-8}"

xvfb-run -a -s "-screen 0 1280x900x24" bash -c '
  "$0" --port 4444 --native-port 4445 >"$PERCH_E2E_OUT.driver.log" 2>&1 &
  driver=$!
  # Up to 30 s for the driver to listen (a loaded machine starts it slowly).
  for _ in $(seq 300); do (exec 3<>/dev/tcp/127.0.0.1/4444) 2>/dev/null && break; sleep 0.1; done
  python3 tests/e2e/test_app.py
  status=$?
  kill "$driver" 2>/dev/null
  exit "$status"
' "$driver"
