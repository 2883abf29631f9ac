#!/usr/bin/env bash
# Fuzzes the readers of the files Perch gets from elsewhere (fuzz/fuzz_targets: GGUF files, weight
# files' safetensors headers, config.json, prompt caches, chat templates) with cargo-fuzz and
# libFuzzer: builds every target once (release, AddressSanitizer), then runs each for SECONDS
# (default 30) on a copy of its seed corpus (fuzz/corpus/<target>, left as committed), with
# libFuzzer's random seed SEED (default: a new one each run). `PERCH_TEST_FUZZ=1 scripts/test.sh`
# passes a fixed SEED, so that a run on the same code and toolchain tries the same inputs in the
# same order (as many as fit in SECONDS), and exploring is for runs without one. (CI replays the
# corpora and fixed mutations in the ordinary test build instead: tests/fuzz_corpus.rs.) Prints the
# inputs each target ran, and exits 1 if any target crashed or panicked, ran out of memory
# (2 GiB RSS, or one allocation that large), or took over 10 s on one input. Targets run as many at
# a time as there are cores. What it found is in
# target/fuzz/<target>/ (crash-*, oom-*, timeout-*, slow-unit-*), with the target's log; replay
# one with `cargo +nightly fuzz run <target> <file>`, and keep it in fuzz/corpus/<target>/ once
# fixed. Needs what scripts/test.sh sets up (libclang, Python with pip for the MLX wheel); installs
# the nightly toolchain (cargo-fuzz needs it) and cargo-fuzz into target/tools when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-30}
seed=${2:-0}
for n in "$seconds" "$seed"; do
  case "$n" in '' | *[!0-9]*) echo "usage: $0 [SECONDS per target] [SEED]" >&2; exit 2 ;; esac
done

rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
export PATH="$PWD/target/tools/bin:$PATH"
if ! cargo fuzz --version 2>/dev/null | grep -q '0\.13\.2'; then
  # A command-line tool: an unoptimized build is as good and builds in about half the time.
  cargo install cargo-fuzz@0.13.2 --locked --debug --root target/tools --quiet
fi

# Builds into fuzz/target (the fuzz crate is a workspace of its own).
cargo +nightly fuzz build -O

work=target/fuzz
rm -rf "$work"
mkdir -p "$work/tmp"
# The targets write their inputs to scratch files under $TMPDIR; libFuzzer exits without
# cleaning up, so they go where this script can remove them.
export TMPDIR="$PWD/$work/tmp"

# Runs one target for SECONDS (libFuzzer is single-threaded); its exit status lands in its folder.
fuzz_target() {
  local target=$1 dir="$work/$1"
  mkdir -p "$dir/corpus"
  cp -R "fuzz/corpus/$target/." "$dir/corpus/"
  # -seed=0 is libFuzzer's "pick one".
  local args=(-max_total_time="$seconds" -seed="$seed" -rss_limit_mb=2048 -timeout=10
    -print_final_stats=1 -artifact_prefix="$dir/")
  [ -f "fuzz/$target.dict" ] && args+=(-dict="fuzz/$target.dict")
  echo "== $target: ${seconds}s"
  set +e
  cargo +nightly fuzz run -O "$target" "$dir/corpus" -- "${args[@]}" >"$dir/log" 2>&1
  echo $? >"$dir/status"
  set -e
}

# The targets run as many at a time as there are cores (PERCH_FUZZ_JOBS overrides).
targets=$(cargo +nightly fuzz list)
jobs=${PERCH_FUZZ_JOBS:-$(nproc)}
for target in $targets; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_target "$target" &
done
wait

failed=()
summary=()
for target in $targets; do
  dir="$work/$target"
  status=$(cat "$dir/status" 2>/dev/null || echo 1)
  runs=$(awk '/stat::number_of_executed_units:/ { n = $2 } END { print n + 0 }' "$dir/log")
  if [ "$status" = 0 ]; then
    summary+=("$(printf '%-20s %10s runs  ok' "$target" "$runs")")
  else
    failed+=("$target")
    summary+=("$(printf '%-20s %10s runs  FAILED (exit %s; %s)' "$target" "$runs" "$status" "$dir/log")")
    grep -E '^==[0-9]+==|^(ERROR|SUMMARY)|panicked at|out-of-memory|Test unit written' "$dir/log" | head -20 || true
  fi
done
rm -rf "$work/tmp"

echo
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzzing found problems in: ${failed[*]} (inputs and logs in $work/)" >&2
  exit 1
fi
