"""Runs `perch bench` and Python mlx_lm on the same model and prompt token ids, in one run, and
prints both sets of numbers with their ratios.

    target/oracle-venv/bin/python scripts/bench_vs_mlx_lm.py [--model DIR] [--prompt-tokens 256]
        [--gen-tokens 64] [--runs 3] [--perch target/release/perch]

mlx_lm is timed the way its `stream_generate` reports (prompt tok/s up to the first token, generation
tok/s after it, MLX peak memory), through `generate_step` so that EOS does not end the run early,
as `perch bench` ignores EOS too. The float32 GEMM line shows what the BLAS behind each libmlx
delivers: Perch's build links OpenBLAS, a pip-installed `mlx[cpu]` keeps the wheel's reference BLAS.
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
from mlx_lm.generate import generate_step

# mlx_lm 0.32.2's quantized expert layer passes `global_scale=None` to mx.gather_qmm, which MLX
# 0.32.2 does not take (a known quirk of that pair): drop the keyword when it is None, which leaves
# the computation as it is, so that mixture-of-experts models run.
_gather_qmm = mx.gather_qmm


def _gather_qmm_without_global_scale(*args, global_scale=None, **kwargs):
    assert global_scale is None, "a global scale would change the computation"
    return _gather_qmm(*args, **kwargs)


mx.gather_qmm = _gather_qmm_without_global_scale

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog while the farmer counts sheep in the valley. "


def mlx_lm_run(model, prompt_ids, gen_tokens):
    mx.reset_peak_memory()
    prompt = mx.array(prompt_ids)
    start = time.perf_counter()
    n = 0
    for n, _ in enumerate(generate_step(prompt, model, max_tokens=gen_tokens), start=1):
        if n == 1:
            ttft = time.perf_counter() - start
    total = time.perf_counter() - start
    return {
        "prompt_tps": len(prompt_ids) / ttft,
        "generation_tps": (n - 1) / (total - ttft),
        "ttft_ms": ttft * 1e3,
        "peak_memory_bytes": mx.get_peak_memory(),
    }


def gemm_gflops(n=1024):
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def main():
    p = argparse.ArgumentParser()
    # The default model in the mlx-community layout, as scripts/test-inputs.sh makes it.
    p.add_argument("--model", default=str(ROOT / "target/test-inputs/SmolLM2-135M-Instruct-Q4_1-mlx"))
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--perch", default=str(ROOT / "target/release/perch"))
    args = p.parse_args()

    model, tokenizer = load(args.model)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt_ids = (ids * (args.prompt_tokens // len(ids) + 1))[: args.prompt_tokens]

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt_ids, f)
    out = subprocess.run(
        [args.perch, "bench", "--model", args.model, "--prompt-ids", f.name,
         "--gen-tokens", str(args.gen_tokens), "--runs", str(args.runs), "--json"],
        check=True, capture_output=True, text=True,
    )
    perch = json.loads(out.stdout.strip().splitlines()[-1])

    mlx_lm_run(model, prompt_ids, args.gen_tokens)  # warm-up, as perch bench does
    runs = [mlx_lm_run(model, prompt_ids, args.gen_tokens) for _ in range(args.runs)]
    ref = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ref["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in runs)
    ref_gemm = gemm_gflops()

    print(f"model: {args.model}")
    print(f"prompt: {len(prompt_ids)} tokens, generation: {args.gen_tokens} tokens, median of {args.runs} runs, "
          f"backend: {perch['backend']}, MLX {perch['mlx_version']}")
    print(f"{'metric':<22}{'perch':>14}{'mlx_lm':>14}{'perch/mlx_lm':>14}")
    for key, unit, scale in [("prompt_tps", "tok/s", 1), ("generation_tps", "tok/s", 1),
                             ("ttft_ms", "ms", 1), ("peak_memory_bytes", "MB", 1e-6)]:
        a, b = perch[key] * scale, ref[key] * scale
        print(f"{key + ' (' + unit + ')':<22}{a:>14.1f}{b:>14.1f}{a / b:>14.2f}")
    print(f"{'f32 GEMM (GFLOP/s)':<22}{perch['gemm_gflops']:>14.1f}{ref_gemm:>14.1f}{perch['gemm_gflops'] / ref_gemm:>14.2f}"
          "   (perch: OpenBLAS; pip mlx[cpu]: the wheel's reference BLAS)")
    print(json.dumps({"perch": perch, "mlx_lm": {**ref, "gemm_gflops": ref_gemm}}))


if __name__ == "__main__":
    sys.exit(main())
