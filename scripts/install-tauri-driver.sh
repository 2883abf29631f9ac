#!/usr/bin/env bash
# Installs tauri-driver (the WebDriver proxy scripts/e2e.sh drives the app through) into
# target/tools/bin unless it is there. 2.x: crates.io's newest tauri-driver may be a 3.0
# pre-release for Tauri 3. Unoptimized is fast enough for a proxy, and builds sooner.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x target/tools/bin/tauri-driver ] ||
  cargo install tauri-driver@2.1.0 --locked --debug --root target/tools --quiet
