#!/usr/bin/env bash
# The cargo runner of scripts/run-tests.sh: records how cargo runs one test binary (its name,
# environment, directory and command) in a file under $PERCH_TEST_RECORD, instead of running it.
set -euo pipefail
record=$(mktemp "$PERCH_TEST_RECORD/job.XXXXXX")
{
  name=$(basename "$1")
  printf '# %s\n' "${name%-*}"
  (
    unset PERCH_TEST_RECORD
    for var in $(compgen -e | grep '^CARGO_TARGET_.*_RUNNER$'); do unset "$var"; done
    export -p
  )
  printf 'cd %q\n' "$PWD"
  printf 'exec'
  printf ' %q' "$@"
  printf '\n'
} > "$record"
