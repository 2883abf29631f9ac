"""Perch's engine against mlx_lm on one GPU, in one run: the table of README's "On a GPU (CUDA)".

Runs where MLX has a GPU backend (the `mlx-cuda-13` wheel on an NVIDIA machine; `mlx` on a Mac): makes a
random-weight Llama with mlx_lm (default 1.07B: hidden 2048, 16 layers, 32/8 heads, 4-bit g64, bfloat16; the
tokenizer from TOKENIZER_DIR, any Llama-style tokenizer.json), then for each concurrency N measures mlx_lm
(`stream_generate` for N = 1, `batch_generate` with `completion_batch_size=N` and `prefill_batch_size=min(N, 8)`
above, driven as batch_generate does with every token timestamped) and `perch bench --concurrency N` (the
single-stream bench for N = 1) on the same prompt length and generation length, and prints one JSON line per
measurement and tables of the ratios: wall-clock rates and TTFT with the same definitions for both engines, then
each engine's own counters of time in forward passes, and the floor: MLX's bare batched decode step on the
same model with its weights dequantized to dense bfloat16 (Perch's weights path on CUDA), mlx_lm's KV cache,
greedy argmax, pipelined with async_eval, no scheduler (`--no-floor` skips it). `--single-through-engine` also runs
the single stream through the batch engine (`perch bench --concurrency 1`, as the app and the local API run one
request), printed as the row "1 (engine)" beside `generate`'s.

    python scripts/bench_gpu.py PERCH_BINARY TOKENIZER_DIR [--concurrency 1 8 32 128] [--prompt-tokens 128]
        [--gen-tokens 256] [--model-dir /tmp/models/llama-1b] [--perch-only] [--single-through-engine]
        [--extra-perch-args ...]

Perch runs as a child process so both engines start cold; mlx_lm runs in this process, after a warm-up of each
shape. Units: tokens per second, milliseconds, bytes (MLX's peak memory, as each engine reports it).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# mlx_lm 0.32.2's quantized expert layers on MLX 0.32.2 (the oracle's shim: see mlx_lm_quirks.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "crates/perch-engine/tests/oracle"))
import mlx_lm_quirks  # noqa: E402,F401


def make_model(path: Path, tokenizer_dir: Path, hidden: int, layers: int, heads: int, kv_heads: int,
               intermediate: int) -> Path:
    if (path / "config.json").exists():
        return path
    from mlx_lm.models import llama
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
        "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "head_dim": hidden // heads, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    }
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, 64, 4)
    mx.eval(model.parameters())
    config["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


def mlx_lm_run(model, tokenizer, n: int, prompt_tokens: int, gen_tokens: int, temp: float = 0.0) -> dict:
    from mlx_lm import batch_generate, generate
    from mlx_lm.generate import BatchGenerator, stream_generate
    from mlx_lm.sample_utils import make_sampler
    # One sampler for every row, as mlx_lm batches a shared sampler (one draw, one key, for all rows).
    sampler = make_sampler(temp=temp)
    base = tokenizer.encode("The history of science is long and full of surprises. " * 64)
    # ~770 tokens: repeated so that every prompt has `prompt_tokens` (before, longer prompts were cut
    # to the text's length, and mlx_lm's "8,192-token" runs read ~770-token prompts).
    while len(base) < prompt_tokens + 7:
        base = base + base
    if n == 1:
        prompt = base[:prompt_tokens]
        generate(model, tokenizer, prompt, max_tokens=8, sampler=sampler)
        mx.reset_peak_memory()
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=gen_tokens, sampler=sampler):
            pass
        return {"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
                "peak_bytes": int(last.peak_memory * 1e9)}
    prompts = [base[i % 7: i % 7 + prompt_tokens] for i in range(n)]
    assert all(len(p) == prompt_tokens for p in prompts), "a prompt shorter than --prompt-tokens"
    batch_generate(model, tokenizer, prompts[: min(n, 8)], max_tokens=8, sampler=sampler)
    mx.reset_peak_memory()
    # batch_generate's loop, with every token timestamped as `perch bench` does (no stop tokens: Perch ignores EOS).
    gen = BatchGenerator(model, stop_tokens=None, completion_batch_size=n, prefill_batch_size=min(n, 8),
                         sampler=sampler)
    start = time.perf_counter()
    uids = gen.insert(prompts, [gen_tokens] * n)
    times = {uid: [] for uid in uids}
    with gen.stats() as stats:
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                times[r.uid].append(now)
    gen.close()
    return {**wall_clock(start, list(times.values()), n * prompt_tokens),
            "own_prompt_tps": stats.prompt_tps, "own_generation_tps": stats.generation_tps,
            "peak_bytes": int(stats.peak_memory * 1e9)}


def floor_run(model, n: int, prompt_tokens: int, gen_tokens: int) -> dict:
    """Milliseconds per decode step of `model` over `n` rows at the context a benchmark run passes through
    (`prompt_tokens`, then `gen_tokens` steps): one forward over `[n, 1]` with mlx_lm's KV cache and an argmax,
    each step dispatched (async_eval) before the previous one's tokens are read, as mlx_lm's generate_step does.
    """
    from mlx_lm.models.cache import make_prompt_cache
    prompts = mx.array([[(7 * i + j) % 1000 + 10 for j in range(prompt_tokens)] for i in range(n)])
    cache = make_prompt_cache(model)
    step = lambda y: mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
    y = mx.argmax(model(prompts, cache=cache)[:, -1], axis=-1)
    for _ in range(4):
        y = step(y)
        mx.eval(y)
    y = step(y)
    mx.async_eval(y)
    start = time.perf_counter()
    steps = max(gen_tokens - 6, 1)
    for _ in range(steps):
        following = step(y)
        mx.async_eval(following)
        y.tolist()
        y = following
    mx.eval(y)
    return {"floor_step_ms": (time.perf_counter() - start) * 1e3 / steps}


def percentile(values: list, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else 0.0


def wall_clock(start: float, timelines: list, prompt_tokens: int) -> dict:
    """`perch bench --concurrency`'s definitions: prompt tok/s = all prompt tokens over the time until every
    request had its first token; generation tok/s = tokens after each first one over the time from the first
    first token to the last token; TTFT from submission."""
    firsts = [t[0] for t in timelines if t]
    last = max(t[-1] for t in timelines if t)
    generated = sum(len(t) for t in timelines) - len(firsts)
    itl = [b - a for t in timelines for a, b in zip(t, t[1:])]
    ttft = [f - start for f in firsts]
    return {"prompt_tps": prompt_tokens / (max(firsts) - start), "generation_tps": generated / (last - min(firsts)),
            "ttft_ms_p50": percentile(ttft, 0.5) * 1e3, "ttft_ms_p95": percentile(ttft, 0.95) * 1e3,
            "itl_ms_p50": percentile(itl, 0.5) * 1e3}


def perch_run(binary: str, model_dir: Path, n: int, prompt_tokens: int, gen_tokens: int, extra: list) -> dict:
    cmd = [binary, "bench", "--model", str(model_dir), "--prompt-tokens", str(prompt_tokens),
           "--gen-tokens", str(gen_tokens), "--json", *extra]
    if n > 1 or "--temp" in extra:  # (the single-stream bench samples greedily: a sampled lone row goes through the engine)
        cmd += ["--concurrency", str(n)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    report = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    return {
        "prompt_tps": report["prompt_tps"], "generation_tps": report["generation_tps"],
        "peak_bytes": report["peak_memory_bytes"], "ttft_ms_p95": report.get("ttft_ms_p95", report.get("ttft_ms")),
        "itl_ms_p50": report.get("itl_ms_p50"), "own_prompt_tps": report.get("engine_prefill_tps"),
        "decode_step_ms": report.get("engine_decode_step_ms"), "other_share": report.get("engine_other_share"),
        "decode_wait_ms": report.get("engine_decode_wait_ms"), "token_ms": report.get("engine_token_ms"),
        "decode_build_ms": report.get("engine_decode_build_ms"),
        "schedule_ms": report.get("engine_schedule_ms"), "publish_ms": report.get("engine_publish_step_ms"),
    }


def ratio_of(a, b):
    return a / b if a and b else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("perch")
    parser.add_argument("tokenizer_dir", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/models/llama-1b"))
    parser.add_argument("--shape", type=int, nargs=5, default=[2048, 16, 32, 8, 8192],
                        metavar=("HIDDEN", "LAYERS", "HEADS", "KV_HEADS", "INTERMEDIATE"))
    parser.add_argument("--perch-only", action="store_true")
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--single-through-engine", action="store_true",
                        help="for N = 1 also run `perch bench --concurrency 1` (the batch engine, as the app and the "
                             "local API run one request) and print it as the row '1 (engine)'")
    parser.add_argument("--temp", type=float, default=0.0,
                        help="sampling temperature of both engines' requests (Perch's request i seeded 1 + i; mlx_lm's "
                             "rows share one sampler)")
    parser.add_argument("--extra-perch-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    if args.temp:
        args.extra_perch_args = ["--temp", str(args.temp), "--seed", "1", *args.extra_perch_args]
    import mlx_lm
    print(json.dumps({"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
                      "date": time.strftime("%Y-%m-%d")}), flush=True)
    model_dir = make_model(args.model_dir, args.tokenizer_dir, *args.shape)
    model = tokenizer = None
    if not args.perch_only:
        model, tokenizer = mlx_lm.load(str(model_dir))
    rows = []
    for n in args.concurrency:
        ours = perch_run(args.perch, model_dir, n, args.prompt_tokens, args.gen_tokens, args.extra_perch_args)
        print(json.dumps({"engine": "perch", "concurrency": n, **ours}), flush=True)
        theirs = {}
        if model is not None:
            theirs = mlx_lm_run(model, tokenizer, n, args.prompt_tokens, args.gen_tokens, args.temp)
            print(json.dumps({"engine": "mlx_lm", "concurrency": n, **theirs}), flush=True)
        rows.append((n, ours, theirs))
        if n == 1 and args.single_through_engine:
            engine = perch_run(args.perch, model_dir, n, args.prompt_tokens, args.gen_tokens,
                               ["--concurrency", "1", *args.extra_perch_args])
            print(json.dumps({"engine": "perch (batch engine)", "concurrency": n, **engine}), flush=True)
            rows.append(("1 (engine)", engine, theirs))
    if not args.perch_only and not args.no_floor:
        # Last, so that the dense copy's memory is in no engine's peak.
        from mlx_lm.utils import dequantize_model
        del model
        mx.clear_cache()
        dense = dequantize_model(mlx_lm.load(str(model_dir))[0])
        mx.eval(dense.parameters())
        for n, _, theirs in rows:
            if isinstance(n, int) and "floor_step_ms" not in theirs:
                theirs.update(floor_run(dense, n, args.prompt_tokens, args.gen_tokens))
                print(json.dumps({"engine": "mlx floor (dense bf16)", "concurrency": n,
                                  "floor_step_ms": theirs["floor_step_ms"]}), flush=True)
    print("\nWall clock, the same definitions for both (see wall_clock; single stream: each engine's own report):")
    print("\n| concurrency | perch gen tok/s | mlx_lm gen tok/s | ratio | perch prompt tok/s | mlx_lm prompt tok/s "
          "| ratio | perch TTFT p95 ms | mlx_lm TTFT p95 ms | perch peak GB | mlx_lm peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, spec: "—" if v is None else format(v, spec)
    for n, ours, theirs in rows:
        ratio = lambda key: (ours.get(key) / theirs[key]) if ours.get(key) and theirs.get(key) else None
        gb = lambda d: d.get("peak_bytes") / 1e9 if d.get("peak_bytes") else None
        print(f"| {n} | {fmt(ours.get('generation_tps'), ',.0f')} | {fmt(theirs.get('generation_tps'), ',.0f')} "
              f"| {fmt(ratio('generation_tps'), '.2f')} | {fmt(ours.get('prompt_tps'), ',.0f')} "
              f"| {fmt(theirs.get('prompt_tps'), ',.0f')} | {fmt(ratio('prompt_tps'), '.2f')} "
              f"| {fmt(ours.get('ttft_ms_p95'), ',.0f')} | {fmt(theirs.get('ttft_ms_p95'), ',.0f')} "
              f"| {fmt(gb(ours), '.2f')} | {fmt(gb(theirs), '.2f')} |")
    print("\nEach engine's own counters (forward passes only; mlx_lm's BatchGenerator stats, Perch's step times):")
    print("\n| concurrency | perch prefill tok/s | mlx_lm prompt_tps | mlx_lm generation_tps | perch decode step ms "
          "| of which building the graph | of which waiting for the device | tokens to requests ms | perch ITL p50 ms | floor step ms | perch ITL / floor "
          "| perch time outside forward passes | of a step: planning and admitting ms | publishing blocks ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, ours, theirs in rows:
        if n != 1:
            print(f"| {n} | {fmt(ours.get('own_prompt_tps'), ',.0f')} | {fmt(theirs.get('own_prompt_tps'), ',.0f')} "
                  f"| {fmt(theirs.get('own_generation_tps'), ',.0f')} | {fmt(ours.get('decode_step_ms'), '.2f')} "
                  f"| {fmt(ours.get('decode_build_ms'), '.2f')} | {fmt(ours.get('decode_wait_ms'), '.2f')} "
                  f"| {fmt(ours.get('token_ms'), '.2f')} "
                  f"| {fmt(ours.get('itl_ms_p50'), '.2f')} | {fmt(theirs.get('floor_step_ms'), '.2f')} "
                  f"| {fmt(ratio_of(ours.get('itl_ms_p50'), theirs.get('floor_step_ms')), '.2f')} "
                  f"| {fmt(ours.get('other_share'), '.0%')} | {fmt(ours.get('schedule_ms'), '.2f')} "
                  f"| {fmt(ours.get('publish_ms'), '.2f')} |")


if __name__ == "__main__":
    sys.exit(main())
