#!/usr/bin/env bash
# One device run (docs/benchmarks.md, "Running them"; the GPU tool's prepare step makes .gpu/p1 and
# .gpu/p2, with `perch` built for release as .gpu/p2/perch.xz) measuring the experts' products grouped by
# expert (PERCH_EXPERT_GROUPED, nn::expert_kernel) against a block a pair: `perch check-kernels experts`;
# `gpt_oss` at 32 concurrent per pair, grouped (1) and grouped with the down product (2), Perch alone; the
# grouped `gpt_oss` against mlx_lm (`bench_gpu.py`); `qwen3_moe` the three ways. Also the NCCL refusal of a
# rank that sees no GPU.
# After a run carrying .gpu/p1 (`mkdir -p /root/stash && cp .gpu/p1/part-aa /root/stash/`), a run carrying
# .gpu/p2 (timeout_s 600): `timeout 560 bash scripts/device_grouped_experts.sh > /dev/null; tail -70
# $OUT/log.txt`. The log is written to $OUT as it goes (a run killed at its limit returns $OUT, not a
# pipe's tail), and MLX's compiled CUDA kernels come back as $OUT/ptx.tar: placed at .gpu/p2/ptx.tar, a
# later run on a fresh machine skips compiling them (minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
G=.gpu/p2; OD="bash $G/on-device.sh"; P=$G/perch; mkdir -p /tmp/models
exec > >(tee -a "${OUT:-/tmp}/log.txt") 2>&1
export MLX_PTX_CACHE_DIR=/tmp/ptxcache; mkdir -p $MLX_PTX_CACHE_DIR
[ -f $G/ptx.tar ] && tar -xf $G/ptx.tar -C $MLX_PTX_CACHE_DIR
trap 'tar -cf "${OUT:-/tmp}/ptx.tar" -C $MLX_PTX_CACHE_DIR . 2>/dev/null' EXIT
xz -dc $G/perch.xz > $P; chmod +x $P
date +%T
for a in qwen3_moe:moe gpt_oss:oss; do
  [ -f /tmp/models/${a#*:}/config.json ] || $OD python3 scripts/make_random_model.py ${a%:*} /tmp/models/${a#*:} $G/tok bfloat16 | tail -1
done
date +%T
echo "== NCCL: a rank that sees no GPU"
CUDA_VISIBLE_DEVICES= MLX_RANK=1 MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=40999 $OD timeout 60 $P generate --model /tmp/models/moe --distributed tensor --backend nccl --raw Hello --max-tokens 4 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}"
echo "== check-kernels experts"
$OD timeout 150 $P check-kernels experts 2>&1 | tail -60
date +%T
b() { local label=$1 model=$2; shift 2
  env "$@" bash $G/on-device.sh timeout 120 $P bench --model /tmp/models/$model --concurrency 32 --prompt-tokens 128 --gen-tokens 256 --json 2>&1 \
    | python3 -c "import json,sys
for l in sys.stdin:
  l=l.strip()
  if not l.startswith('{'): continue
  d=json.loads(l); print('$label', {k:round(d[k],2) for k in d if k in ('generation_tps','engine_decode_step_ms','engine_decode_build_ms','engine_decode_wait_ms','ttft_ms_p95')})"
}
b oss-pair oss X=1; b oss-grouped oss PERCH_EXPERT_GROUPED=1; b oss-grouped2 oss PERCH_EXPERT_GROUPED=2
date +%T
echo "== bench_gpu 32 gpt_oss"
PERCH_EXPERT_GROUPED=1 $OD timeout 300 python3 scripts/bench_gpu.py $P $G/tok --no-floor --concurrency 32 --model-dir /tmp/models/oss 2>&1 | grep -v '^\s*$' | grep -v '^{' | tail -8
date +%T
b moe-grouped moe PERCH_EXPERT_GROUPED=1; b moe-grouped2 moe PERCH_EXPERT_GROUPED=2; b moe-pair moe X=1
date +%T
