#!/usr/bin/env bash
# Runs the end-to-end tour (scripts/e2e.sh) in light and in dark (a dark GTK theme, which the web
# view reports as `prefers-color-scheme: dark`) and copies its screenshots of every screen into
# docs/screenshots/{light,dark}. Needs what scripts/e2e.sh needs (the debug app, test inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/e2e.sh
PERCH_E2E_DARK=1 bash scripts/e2e.sh
for scheme in light dark; do
  from=target/e2e; [ "$scheme" = dark ] && from=target/e2e-dark
  mkdir -p "docs/screenshots/$scheme"
  rm -f "docs/screenshots/$scheme"/*.png
  for shot in first-run chat-streaming chat-stopped dashboard models-downloading models chat-switched settings chat-after-restart; do
    cp "$from/$shot.png" "docs/screenshots/$scheme/$shot.png"
  done
done
echo "screenshots: docs/screenshots/light and docs/screenshots/dark"
