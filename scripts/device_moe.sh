#!/usr/bin/env bash
# One device run for the MoE rows of docs/benchmarks.md ("Running them"; the GPU tool's prepare step
# makes .gpu/p1 and .gpu/p2, with `perch` built for release as .gpu/p2/perch.xz): random `qwen3_moe` and
# `gpt_oss` models (make_random_model.py, bfloat16), `bench_gpu.py` at 32 concurrent against mlx_lm for
# each, the decode graph of each at 32 rows (PERCH_DECODE_GRAPH_DIR, counted by operation), then
# `perch check-kernels experts`.
# After a run carrying .gpu/p1 (`mkdir -p /root/stash && cp .gpu/p1/part-aa /root/stash/`), a run carrying
# .gpu/p2 (timeout_s 600): `timeout 570 bash scripts/device_moe.sh > /dev/null; tail -80 $OUT/log.txt`.
# The log is written to $OUT as it goes (a run killed at its limit returns $OUT, not a pipe's tail), and
# MLX's compiled CUDA kernels come back as $OUT/ptx.tar.xz: placed in .gpu/p2, a later run on a fresh
# machine skips compiling them (minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
G=.gpu/p2; OD="bash $G/on-device.sh"; P=$G/perch; mkdir -p /tmp/models
exec > >(tee -a "${OUT:-/tmp}/log.txt") 2>&1
export MLX_PTX_CACHE_DIR=/tmp/ptxcache; mkdir -p $MLX_PTX_CACHE_DIR
[ -f $G/ptx.tar.xz ] && tar -xJf $G/ptx.tar.xz -C $MLX_PTX_CACHE_DIR
trap 'tar -cJf "${OUT:-/tmp}/ptx.tar.xz" -C $MLX_PTX_CACHE_DIR . 2>/dev/null' EXIT
xz -dc $G/perch.xz > $P; chmod +x $P
date +%T
for a in qwen3_moe:moe gpt_oss:oss; do
  [ -f /tmp/models/${a#*:}/config.json ] || $OD python3 scripts/make_random_model.py ${a%:*} /tmp/models/${a#*:} $G/tok bfloat16 | tail -1
done
for m in moe oss; do
  echo "== bench_gpu $m, 32 concurrent"
  $OD timeout 220 python3 scripts/bench_gpu.py $P $G/tok --no-floor --concurrency 32 --model-dir /tmp/models/$m 2>&1 | grep -v '^\s*$' | tail -12
  date +%T
done
for m in moe oss; do
  echo "== decode graph of $m at 32 rows"
  mkdir -p /tmp/graphs/$m
  PERCH_DECODE_GRAPH_DIR=/tmp/graphs/$m $OD timeout 60 $P bench --model /tmp/models/$m --concurrency 32 --prompt-tokens 128 --gen-tokens 24 --json > /dev/null 2>&1
  f=/tmp/graphs/$m/decode-32.txt
  [ -f $f ] && echo "$(grep -vc '^Inputs:\|^Outputs:' $f) operations" && awk '{print $1}' $f | grep -v ':$' | sort | uniq -c | sort -rn
  cp $f "${OUT:-/tmp}/decode-32-$m.txt" 2>/dev/null
done
date +%T
echo "== check-kernels experts"
$OD timeout 150 $P check-kernels experts 2>&1 | grep -v '^\s*$' | tail -40
date +%T
