#!/usr/bin/env bash
# Builds the web UI (ui/ -> ui/dist, which src-tauri embeds) with the locked npm packages.
# Pass --test to also run its unit tests (vitest).
set -euo pipefail
cd "$(dirname "$0")/../ui"
command -v npm >/dev/null || { echo "build-ui: Node.js and npm are needed (https://nodejs.org)" >&2; exit 1; }
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
npm run --silent build -- --logLevel warn
if [ "${1:-}" = "--test" ]; then
  npm test --silent
fi
