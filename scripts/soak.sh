#!/usr/bin/env bash
# Soak benchmark (not part of the tests): minutes of mixed traffic through the engine on the
# default model (or $PERCH_MODEL / --model), printing MLX memory, RSS and the KV pool every
# minute. Arguments go to `perch soak` (e.g. --minutes 10 --concurrency 16 --kv-cache-mib 256).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p perch-cli
exec target/release/perch soak "$@"
