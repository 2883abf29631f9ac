"""Runs `perch bench --concurrency N` and Python mlx_lm's `BatchGenerator` (what `batch_generate`
drives) on the same model and the same prompt token ids, in one run, and prints both sets of
numbers with their ratios.

    target/oracle-venv/bin/python scripts/bench_batch_vs_mlx_lm.py [--model DIR] [--concurrency 32]
        [--prompt-tokens 64] [--gen-tokens 32] [--shared-prefix-tokens 0] [--perch target/release/perch]

Both ignore EOS (mlx_lm: no stop tokens) so every request generates exactly --gen-tokens tokens.
Both are timed the same way: TTFT from submitting all requests to each request's first token, ITL
between a request's consecutive tokens, generation tok/s over the tokens after each first token,
from the first first token to the last token; peak memory is MLX's peak.

With --shared-prefix-tokens S, every prompt starts with the same S tokens. Perch's warm-up request
puts that prefix in its prefix cache first (as a system prompt seen before would be), so its TTFT
shows the cache at work; mlx_lm has no cross-request prefix cache in `BatchGenerator`.

mlx_lm runs on the pip wheel's own BLAS; its time goes to `quantized_matmul`, which does not
use BLAS, so the BLAS makes little difference to it (see scripts/bench_vs_mlx_lm.py).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

# mlx_lm 0.32.2's quantized expert layers on MLX 0.32.2 (the oracle's shim: see mlx_lm_quirks.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "crates/perch-engine/tests/oracle"))
import mlx_lm_quirks  # noqa: E402,F401
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

ROOT = Path(__file__).resolve().parent.parent
TEXT = (
    "The quick brown fox jumps over the lazy dog while the farmer counts sheep in the valley. "
    "Rivers carry silt to the delta, where herons wait and fishermen mend their nets at dawn. "
)


def percentile(values, q):
    """Nearest-rank quantile, as `perch bench` computes it."""
    if not values:
        return 0.0
    values = sorted(values)
    rank = min(max(int(-(-q * len(values) // 1)), 1), len(values))
    return values[rank - 1]


def make_prompts(tokenizer, n, prompt_tokens, shared):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)

    def cycle(skip, length):
        return [ids[(skip + i) % len(ids)] for i in range(length)]

    prefix = cycle(0, shared)
    return [prefix + cycle(1 + 3 * i, prompt_tokens - shared) for i in range(n)]


def mlx_lm_run(model, prompts, gen_tokens):
    # Warm-up: one short request through the same path.
    gen = BatchGenerator(model, stop_tokens=None)
    gen.insert([prompts[0][:8]], [2])
    while gen.next_generated():
        pass
    gen.close()

    mx.clear_cache()
    mx.reset_peak_memory()
    gen = BatchGenerator(model, stop_tokens=None)
    start = time.perf_counter()
    uids = gen.insert(prompts, [gen_tokens] * len(prompts))
    times = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            times[r.uid].append(now)
    gen.close()
    peak = mx.get_peak_memory()
    firsts = [t[0] for t in times.values()]
    last = max(t[-1] for t in times.values())
    ttft = [(t[0] - start) * 1e3 for t in times.values()]
    itl = [(b - a) * 1e3 for t in times.values() for a, b in zip(t, t[1:])]
    generated = sum(len(t) for t in times.values())
    return {
        "prompt_tps": sum(map(len, prompts)) / (max(firsts) - start),
        "generation_tps": (generated - len(firsts)) / (last - min(firsts)),
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p95": percentile(ttft, 0.95),
        "itl_ms_p50": percentile(itl, 0.5),
        "itl_ms_p95": percentile(itl, 0.95),
        "peak_memory_bytes": peak,
    }


def perch_run(perch, model_dir, prompts, gen_tokens, shared):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [str(perch), "bench", "--model", str(model_dir), "--concurrency", str(len(prompts)),
           "--prompt-ids", f.name, "--gen-tokens", str(gen_tokens),
           "--shared-prefix-tokens", str(shared), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The default model in the mlx-community layout, as scripts/test-inputs.sh makes it.
    p.add_argument("--model", type=Path, default=ROOT / "target/test-inputs/SmolLM2-135M-Instruct-Q4_1-mlx")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--shared-prefix-tokens", type=int, default=0)
    p.add_argument("--perch", type=Path, default=ROOT / "target/release/perch")
    p.add_argument("--skip-mlx-lm", action="store_true", help="run only perch (e.g. to time the prefix cache)")
    args = p.parse_args()

    model, tokenizer = load(str(args.model))
    prompts = make_prompts(tokenizer, args.concurrency, args.prompt_tokens, args.shared_prefix_tokens)
    ours = perch_run(args.perch, args.model, prompts, args.gen_tokens, args.shared_prefix_tokens)
    theirs = None if args.skip_mlx_lm else mlx_lm_run(model, prompts, args.gen_tokens)

    print(f"{args.concurrency} concurrent requests, {args.prompt_tokens} prompt tokens "
          f"({args.shared_prefix_tokens} shared), {args.gen_tokens} generated each; mlx {mx.__version__}")
    print(f"{'metric':<22}{'perch':>14}{'mlx_lm':>14}{'perch/mlx_lm':>14}")
    for key in ["prompt_tps", "generation_tps", "ttft_ms_p50", "ttft_ms_p95", "itl_ms_p50", "itl_ms_p95",
                "peak_memory_bytes"]:
        a = ours[key]
        b = theirs[key] if theirs else None
        scale = 1e6 if key == "peak_memory_bytes" else 1
        unit = " MB" if scale > 1 else ""
        ratio = f"{a / b:>14.2f}" if b else f"{'-':>14}"
        other = f"{b / scale:>11.1f}{unit:>3}" if b is not None else f"{'-':>14}"
        print(f"{key:<22}{a / scale:>11.1f}{unit:>3}{other}{ratio}")
    print(f"{'prefix_cache_hit_rate':<22}{ours['prefix_cache_hit_rate']:>14.2f}")
    print(json.dumps({"perch": ours, "mlx_lm": theirs}))


if __name__ == "__main__":
    sys.exit(main())
