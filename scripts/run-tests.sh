#!/usr/bin/env bash
# Runs Rust tests as `cargo test` does (test.sh: `--workspace`), with the test binaries
# PERCH_TEST_JOBS at a time (default: the CPUs) instead of one after another: many tests spend
# most of their time on one thread (the oracle's Python, a tiny model's forward passes), and a
# second binary keeps the other core busy. Cargo still decides what runs, where and with which
# environment: a runner (`CARGO_TARGET_<host>_RUNNER`, scripts/record-test.sh) records each test
# binary's directory, environment and command instead of running it (doctests run in that pass,
# as usual); then the records run, the slowest known first, and each one's output is printed
# whole when it ends, closed by a line with its name and wall time (`== name: N s`). Arguments go to `cargo test`. Exit status: 0 when every binary passed.
set -uo pipefail
cd "$(dirname "$0")/.."
records=$(mktemp -d)
trap 'rm -rf "$records"' EXIT
host=$(rustc -vV | sed -n 's/^host: //p' | tr 'a-z.-' 'A-Z__')
PERCH_TEST_RECORD="$records" env "CARGO_TARGET_${host}_RUNNER=$PWD/scripts/record-test.sh" \
  cargo test "$@" || exit $?

# Longest first, so that no long binary starts last (their usual order on 2 CPU cores).
slow="sdk_clients batch_parity architecture_parity pool_memory cli speculative commands
  batch_scheduling reference_parity kv_quantization next_token_logprobs batched_attention engine grammar"
rank() {
  local name i=0
  name=$(sed -n '1s/^# //p' "$1")
  for s in $slow; do
    [ "$name" = "$s" ] && { echo "$i $1"; return; }
    i=$((i + 1))
  done
  echo "$i $1"
}
for f in "$records"/job.*; do rank "$f"; done | sort -n -s -k1,1 | cut -d' ' -f2- > "$records/order"
export records
xargs -a "$records/order" -d '\n' -P "${PERCH_TEST_JOBS:-$(nproc)}" -I{} bash -c '
  start=$SECONDS
  bash "$1" > "$1.out" 2>&1; echo $? > "$1.rc"
  printf "== %s: %d s\n" "$(sed -n "1s/^# //p" "$1")" $((SECONDS - start)) >> "$1.out"
  flock "$records/order" cat "$1.out"' _ {}
status=0
for rc in "$records"/job.*.rc; do
  [ "$(cat "$rc")" = 0 ] || { status=1; echo "FAILED: $(sed -n '1s/^# //p' "${rc%.rc}")" >&2; }
done
exit "$status"
