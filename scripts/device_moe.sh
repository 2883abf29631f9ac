#!/usr/bin/env bash
# Device runs for the MoE rows of docs/benchmarks.md ("Running them"; the GPU tool's prepare step
# makes .gpu/p1 and .gpu/p2, with `perch` built for release as .gpu/p2/perch.xz). Its parts, each one
# device call of at most 600 s on the same warm machine:
#   `bash scripts/device_moe.sh bench`: random `qwen3_moe` and `gpt_oss` models (make_random_model.py,
#     bfloat16), then `bench_gpu.py` at 32 concurrent against mlx_lm for each (BENCH picks them as NAME:LIMIT,
#     default "moe:330 oss:200");
#   `bash scripts/device_moe.sh probe`: the engine thread sampled at 32 rows on each model
#     (scripts/probe_host.c as $G/probe_host.so), its stacks written to $OUT/probe-MODEL.txt.xz, and bench_op_launch.py;
#   `bash scripts/device_moe.sh ab [VAR]`: `check-kernels` (every kernel; CHECK=NAME only NAME's, CHECK=0 none), then Perch alone on
#     each model with VAR (default PERCH_GEMM_KERNEL) 0 and 1;
#   `bash scripts/device_moe.sh prof [MODEL]`: where the machine has Nsight Systems, the kernels of a run of 32
#     prompts of 128 tokens and 2 generated (prefill passes) on MODEL (moe or oss; default oss), summed by kernel;
#   `bash scripts/device_moe.sh hybrids`: random `qwen3_5` and `qwen3_5_moe` models, bench_gpu.py at CONC
#     (default "1 8 32") against mlx_lm for each of MODELS (ARCH:DIR pairs, default both), LIMIT seconds each (540: a fresh machine compiles its kernels in the first run; one model a call then);
#   `bash scripts/device_moe.sh llama`: bench_gpu.py's 1.07B Llama at 1/8/32/128 against mlx_lm;
#   `bash scripts/device_moe.sh agents`: the random `qwen3_5`: a chat behind a 16,000-token background prompt
#     (priority lanes), then a copy with its first 4 layers as a draft (make_draft_pair.py --scale 0) at 8 and
#     32 rows without and with the draft, alternating, ROUNDS rounds (default 2; about 520 s on a fresh machine,
#     ROUNDS=1 for a shorter call);
#   `bash scripts/device_moe.sh nccl`: issue 44's two-GPU rows (a machine of two GPUs): bench_gpu.py's 1.07B Llama
#     and the random `qwen3_5_moe` at 32 concurrent, Perch on one GPU and tensor parallel over two (NCCL,
#     `perch bench --distributed tensor --hosts 127.0.0.1,127.0.0.1 --backend nccl`), then mlx_lm.benchmark's
#     batch of 32 (batch_generate; over two GPUs its sharded_load, started as mlx.launch --backend nccl -n 2
#     starts it) on one GPU and on two; MODELS picks them (default "llama-1b q35moe");
#   `bash scripts/device_moe.sh rest`: MLX's host time an operation by kind (bench_op_launch.py), Perch alone on each model with the add-norm-and-router kernel
#     off and on, alternating (PERCH_ROUTE_ADD_NORM), the decode graph of each at 32 rows
#     (PERCH_DECODE_GRAPH_DIR, counted by operation), `perch check-kernels experts`, and where the
#     machine has Nsight Systems, the CUDA calls of a `qwen3_moe` run summed by function.
# Before them, a run carrying .gpu/p1 (`mkdir -p /root/stash && cp .gpu/p1/part-aa /root/stash/`); each
# part carries .gpu/p2 (timeout_s 600): `timeout 570 bash scripts/device_moe.sh bench > /dev/null; tail -60
# $OUT/log.txt`. The log is written to $OUT as it goes (a run killed at its limit returns $OUT, not a
# pipe's tail), and MLX's compiled CUDA kernels come back as $OUT/ptx.tar.xz: placed in .gpu/p2, a later
# run on a fresh machine skips compiling them (minutes; the first run on a fresh machine spends them, so
# its limits are long).
set -uo pipefail
cd "$(dirname "$0")/.."
G=.gpu/p2; OD="bash $G/on-device.sh"; P=$G/perch; mkdir -p /tmp/models
exec > >(tee -a "${OUT:-/tmp}/log.txt") 2>&1
export MLX_PTX_CACHE_DIR=/tmp/ptxcache; mkdir -p $MLX_PTX_CACHE_DIR
[ -f $G/ptx.tar.xz ] && tar -xJf $G/ptx.tar.xz -C $MLX_PTX_CACHE_DIR
trap 'tar -cJf "${OUT:-/tmp}/ptx.tar.xz" -C $MLX_PTX_CACHE_DIR . 2>/dev/null' EXIT
[ -x $P ] || { xz -dc $G/perch.xz > $P; chmod +x $P; }
date +%T
report='import json,sys; r=json.loads([l for l in sys.stdin if l.startswith("{")][-1]); print("tok/s %.0f  TTFT p95 %.0f ms  peak %.2f GB" % (r["generation_tps"], r["ttft_ms_p95"], r["peak_memory_bytes"] / 1e9))'
bench() { $OD timeout "$2" $P bench --model /tmp/models/$1 --concurrency 32 --prompt-tokens 128 --gen-tokens 256 --json 2>/dev/null \
  | python3 -c 'import json,sys; r=json.loads([l for l in sys.stdin if l.startswith("{")][-1]); print("tok/s %.0f  step %.2f ms (building %.2f, waiting %.2f)  TTFT p95 %.0f ms" % (r["generation_tps"], r["engine_decode_step_ms"], r["engine_decode_build_ms"], r["engine_decode_wait_ms"], r["ttft_ms_p95"]))'; }
mkmodel() { [ -f /tmp/models/${1#*:}/config.json ] || $OD python3 scripts/make_random_model.py ${1%:*} /tmp/models/${1#*:} $G/tok bfloat16 | tail -1; }
case "${1:-bench}" in hybrids|llama|agents|nccl) ;; *) mkmodel qwen3_moe:moe; mkmodel gpt_oss:oss ;; esac
case "${1:-bench}" in
hybrids)
  # The Qwen3.5 shapes of issue 39's table (dense and MoE), bench_gpu.py at CONC (default 1 8 32) against
  # mlx_lm; MODELS picks them as ARCH:DIR (default "qwen3_5:q35 qwen3_5_moe:q35moe").
  for a in ${MODELS:-qwen3_5:q35 qwen3_5_moe:q35moe}; do
    mkmodel $a; m=${a#*:}
    # Without its model bench_gpu.py would make a Llama there: stop instead.
    [ -f /tmp/models/$m/config.json ] || { echo "== no model made for $a"; continue; }
    echo "== bench_gpu $m, ${CONC:-1 8 32} concurrent"
    $OD timeout ${LIMIT:-540} python3 scripts/bench_gpu.py $P $G/tok --no-floor --concurrency ${CONC:-1 8 32} \
      --model-dir /tmp/models/$m 2>&1 | grep -v '^\s*$' | grep '^|' | grep -v '^|--'
    date +%T
  done
  ;;
probe)
  # Where the engine thread's time goes at 32 rows (scripts/probe_host.c, built here and carried as
  # $G/probe_host.so; read the stacks with scripts/probe_host_report.py and the same perch binary).
  for m in moe oss; do
    echo "== $m, warming up"; bench $m 200
    echo "== $m, sampled"
    PROBE_THREAD=perch-engine PROBE_EVERY_US=250 PROBE_OUT=/tmp/probe-$m.txt \
      LD_PRELOAD=$PWD/$G/probe_host.so $OD timeout 240 $P bench --model /tmp/models/$m --concurrency 32 --prompt-tokens 128 \
      --gen-tokens 256 --runs 16 --json 2>&1 | grep -v '^{' | tail -3
    xz -9 -T0 -c /tmp/probe-$m.txt > "${OUT:-/tmp}/probe-$m.txt.xz"
    date +%T
  done
  echo "== MLX's host time an operation, by kind (scripts/bench_op_launch.py)"
  MLX_MAX_OPS_PER_BUFFER=30 $OD timeout 150 python3 scripts/bench_op_launch.py 2>&1 | tail -12
  ;;
bench)
  for m in ${BENCH:-moe:330 oss:200}; do
    echo "== bench_gpu ${m%:*}, 32 concurrent"
    $OD timeout ${m#*:} python3 scripts/bench_gpu.py $P $G/tok --no-floor --concurrency 32 --model-dir /tmp/models/${m%:*} 2>&1 | grep -v '^\s*$' | tail -12
    date +%T
  done
  ;;
ab)
  # One switch (default PERCH_GEMM_KERNEL) off and on, Perch alone on each model, after every kernel's checks.
  var=${2:-PERCH_GEMM_KERNEL}
  check=${CHECK:-1}
  if [ "$check" != 0 ]; then
    [ "$check" = 1 ] && check=
    echo "== check-kernels $check"
    $OD timeout 150 $P check-kernels $check 2>&1 | grep -v '^\s*$' | tail -40
  fi
  for m in moe oss; do
    for on in 0 1; do echo "== $m, $var=$on"; export "$var=$on"; bench $m 120; done; unset "$var"
    date +%T
  done
  ;;
agents)
  # Issue 43's GPU rows: priority lanes on the hybrid, and a draft model in its batch.
  mkmodel qwen3_5:q35
  echo "== priority lanes, qwen3_5, a 16,000-token background prompt"
  $OD timeout 150 $P bench --model /tmp/models/q35 --background-prompt-tokens 16000 --prompt-tokens 128 \
    --gen-tokens 8 --runs 5 2>&1 | grep -v '^\s*$' | tail -3
  date +%T
  # make_draft_pair.py scales the model's later layers in place: on a copy.
  [ -f /tmp/models/q35d/config.json ] || { rm -rf /tmp/models/q35s; cp -r /tmp/models/q35 /tmp/models/q35s
    $OD python3 scripts/make_draft_pair.py /tmp/models/q35s /tmp/models/q35d --draft-layers 4 --scale 0 | tail -1; }
  for n in 8 32; do
    for round in $(seq ${ROUNDS:-2}); do
      for d in "" /tmp/models/q35d; do
        echo "== qwen3_5 at $n rows, $([ -n "$d" ] && echo with || echo without) the draft (round $round)"
        $OD timeout 60 $P bench --model /tmp/models/q35s --concurrency $n --prompt-tokens 128 --gen-tokens 256 \
          --json ${d:+--draft-model $d} 2>/tmp/agents-err.txt | python3 -c 'import json,sys; r=json.loads([l for l in sys.stdin if l.startswith("{")][-1]); print("tok/s %.0f  step %.2f ms  proposals accepted %s of %s" % (r["generation_tps"], r["engine_decode_step_ms"], r.get("engine_accepted_draft_tokens"), r.get("engine_draft_tokens")))' \
          || tail -3 /tmp/agents-err.txt
      done
    done
    date +%T
  done
  ;;
nccl)
  # Issue 44: one model on two GPUs against one, Perch and mlx_lm, the same workload (32 prompts of 128
  # tokens, 256 generated).
  # BACKEND=ring runs the same two ranks over TCP, both on one GPU: a check of the part on a machine of one.
  b=${BACKEND:-nccl}
  gpus=$(nvidia-smi -L | grep -c '^GPU ')
  [ "$gpus" -ge 2 ] || [ "$b" = ring ] || { echo "== $gpus GPU here: these rows need two"; exit 0; }
  $OD python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_gpu import make_model; \
    make_model(Path('/tmp/models/llama-1b'), Path('$G/tok'), 2048, 16, 32, 8, 8192)"
  mkmodel qwen3_5_moe:q35moe
  launch_mlx="from mlx._distributed_utils.launch import main; main()"
  for m in ${MODELS:-llama-1b q35moe}; do
    [ -f /tmp/models/$m/config.json ] || { echo "== no model $m"; continue; }
    args="--model /tmp/models/$m --concurrency 32 --prompt-tokens 128 --gen-tokens 256 --json"
    echo "== $m, Perch on one GPU"
    CUDA_VISIBLE_DEVICES=0 $OD timeout 150 $P bench $args 2>/tmp/nccl-err.txt | python3 -c "$report" || tail -3 /tmp/nccl-err.txt
    echo "== $m, Perch tensor parallel over two ranks ($b)"
    $OD timeout 200 $P bench $args --distributed tensor --hosts 127.0.0.1,127.0.0.1 --backend $b 2>/tmp/nccl-err.txt \
      | python3 -c "$report" || tail -5 /tmp/nccl-err.txt
    date +%T
    mlx_args="-m mlx_lm.benchmark --model /tmp/models/$m -b 32 -p 128 -g 256 -n 2"
    echo "== $m, mlx_lm.benchmark on one GPU"
    CUDA_VISIBLE_DEVICES=0 $OD timeout 150 python3 $mlx_args 2>&1 | grep -i 'averages\|error' | tail -3
    echo "== $m, mlx_lm.benchmark sharded over two ranks ($b)"
    $OD timeout 200 python3 -c "$launch_mlx" --backend $b -n 2 -- python3 $mlx_args 2>&1 | grep -i 'averages\|error' | tail -3
    date +%T
  done
  ;;
llama)
  # The dense rows of docs/benchmarks.md (the 5% rule of the MoE changes): the 1.07B Llama at 1/8/32/128.
  echo "== bench_gpu llama-1b"
  $OD timeout 560 python3 scripts/bench_gpu.py $P $G/tok --no-floor 2>&1 | grep -v '^\s*$' | tail -30
  date +%T
  ;;
prof)
  # The device's kernels of a prefill-heavy run (32 prompts, 2 tokens each), by kernel (Nsight Systems).
  nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  [ -n "$nsys" ] || { echo "== no Nsight Systems on this machine"; exit 0; }
  for m in ${2:-oss}; do
    echo "== kernels of $m's prefill passes at 32 ($nsys)"
    $OD timeout 200 $nsys profile -t cuda -o /tmp/prof-$m -f true $P bench --model /tmp/models/$m --concurrency 32 \
      --prompt-tokens 128 --gen-tokens 2 --runs 2 --json > /dev/null 2>&1
    timeout 90 $nsys stats -r cuda_gpu_kern_sum /tmp/prof-$m.nsys-rep 2>&1 | cut -c1-220 | head -40
    date +%T
  done
  ;;
rest)
  echo "== MLX's host time an operation, by kind (scripts/bench_op_launch.py)"
  MLX_MAX_OPS_PER_BUFFER=30 $OD timeout 150 python3 scripts/bench_op_launch.py 2>&1 | tail -12
  # A fresh machine compiles MLX's kernels in its first runs: one unmeasured run of each first.
  for m in moe oss; do echo "== $m, warming up"; bench $m 300; done
  date +%T
  for m in moe oss; do
    for round in 1 2; do
      for on in 0 1; do echo "== $m, add-norm router $on (round $round)"; PERCH_ROUTE_ADD_NORM=$on bench $m 60; done
    done
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
  nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$nsys" ]; then
    echo "== CUDA calls of a qwen3_moe run at 32 ($nsys)"
    $OD timeout 120 $nsys profile -t cuda -o /tmp/moe-prof -f true $P bench --model /tmp/models/moe --concurrency 32 --prompt-tokens 128 --gen-tokens 256 --json > /dev/null 2>&1
    timeout 60 $nsys stats -r cuda_api_sum /tmp/moe-prof.nsys-rep 2>&1 | head -30
  else
    echo "== no Nsight Systems on this machine"
  fi
  date +%T
  ;;
esac
