#!/usr/bin/env bash
# Builds the web UI (ui/ -> ui/dist, which src-tauri embeds) with the locked npm packages.
# Pass --test to also run its unit tests (vitest).
set -euo pipefail
cd "$(dirname "$0")/../ui"
command -v npm >/dev/null || { echo "build-ui: Node.js and npm are needed (https://nodejs.org)" >&2; exit 1; }
# `npm install`, not `npm ci`: the npm registry these machines reach lacks some of the
# platform packages that rollup and esbuild list as optional, so the lock file cannot name them
# all and `npm ci` refuses it ("Missing: @rollup/rollup-android-arm64 from lock file"). With a
# lock file that satisfies package.json, `npm install` installs exactly its versions; the check
# below makes sure it did not have to change it.
if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  before=$(mktemp)
  cp package-lock.json "$before"
  npm install --no-audit --no-fund --loglevel=error
  if ! cmp -s package-lock.json "$before"; then
    # The registry decides which optional platform packages (rollup's and esbuild's builds for
    # other systems) it offers, and npm writes what it found into the lock. Differences in those
    # entries alone are the registry's, not a disagreement with package.json: keep the committed lock.
    if node ../scripts/lock-diff.mjs "$before" package-lock.json; then
      cp "$before" package-lock.json
      touch node_modules/.package-lock.json
    else
      rm -f "$before"
      echo "build-ui: npm install changed package-lock.json (package.json and the lock disagree); commit the new lock file" >&2
      exit 1
    fi
  fi
  rm -f "$before"
fi
npm run --silent build -- --logLevel warn
if [ "${1:-}" = "--test" ]; then
  npm test --silent
fi
