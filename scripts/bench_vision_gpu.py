"""Perch against mlx-vlm on requests that each hold an image, in one run: time to first token of one
request, and generation throughput of N at once (issue 42's GPU targets: TTFT <= mlx-vlm's, 8 at once
>= 2x its throughput).

    python scripts/bench_vision_gpu.py PERCH_BINARY MODEL_DIR IMAGE [--concurrency 1 8] [--prompt-tokens 64]
        [--gen-tokens 128] [--skip-mlx-vlm]

MODEL_DIR: a Qwen3.5 vision-language model both engines load (`scripts/make_random_vlm.py`). Each request
is one user message: its own filler text (about --prompt-tokens tokens, different for every request, so
no prefix cache holds another's image), the image, then a question, written by the model's chat template
(the same message Perch's `perch bench --image` sends). mlx-vlm 0.7.6: `stream_generate` for one request
(TTFT: wall time to its first token), `batch_generate` for N (its `BatchStats`: prompt time, the time until
every request's prompt is processed, and generation tok/s over its decode steps alone); Perch: `perch bench
--image --concurrency N` (its TTFT p50 / p95, and generation tok/s from the first first token to the last
token, other requests' prefills inside that time). Throughput end to end (`wall_tps`, the ratio the table
gives): every generated token over the time from submitting the requests to the last token, for both engines.
Each engine is warmed up with the same request shapes first. One JSON line per engine and N, then a table.
"""
import argparse
import json
import subprocess
import sys
import time

FILLER = ("The quick brown fox jumps over the lazy dog while the farmer counts sheep in the valley. "
          "Rivers carry silt to the delta, where herons wait and fishermen mend their nets at dawn. ")


def texts(tokenizer, n, tokens):
    """`n` different texts of about `tokens` tokens each."""
    ids = tokenizer.encode(FILLER * (tokens // 10 + 4), add_special_tokens=False)
    return [f"Request {i}. " + tokenizer.decode(ids[3 * i:3 * i + tokens]) for i in range(n)]


def mlx_vlm_runs(model_dir, image, concurrency, prompt_tokens, gen_tokens):
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate import batch_generate, stream_generate

    model, processor = load(model_dir)
    tokenizer = processor.tokenizer

    def prompt(text):
        content = [{"type": "text", "text": text}, {"type": "image"},
                   {"type": "text", "text": "What is in the picture?"}]
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    results = []
    for n in concurrency:
        prompts = [prompt(t) for t in texts(tokenizer, n, prompt_tokens)]
        if n == 1:
            for _ in range(2):  # warm-up, then measured
                start = time.perf_counter()
                first, count = None, 0
                for response in stream_generate(model, processor, prompts[0], image=[image],
                                                max_tokens=gen_tokens):
                    first = first or time.perf_counter()
                    count += 1
                end = time.perf_counter()
            results.append({"engine": "mlx_vlm", "concurrency": 1, "ttft_ms": (first - start) * 1e3,
                            "generation_tps": (count - 1) / max(end - first, 1e-9),
                            "wall_tps": count / max(end - start, 1e-9),
                            "peak_bytes": mx.get_peak_memory()})
        else:
            batch_generate(model, processor, images=[image] * n, prompts=prompts, max_tokens=8)
            mx.reset_peak_memory()
            start = time.perf_counter()
            response = batch_generate(model, processor, images=[image] * n, prompts=prompts,
                                      max_tokens=gen_tokens)
            wall = time.perf_counter() - start
            stats = response.stats
            results.append({"engine": "mlx_vlm", "concurrency": n,
                            "ttft_ms": stats.prompt_time * 1e3, "generation_tps": stats.generation_tps,
                            "wall_tps": stats.generation_tokens / wall, "peak_bytes": mx.get_peak_memory()})
        print(json.dumps(results[-1]), flush=True)
    return results


def perch_runs(binary, model_dir, image, concurrency, prompt_tokens, gen_tokens):
    results = []
    for n in concurrency:
        cmd = [binary, "bench", "--model", model_dir, "--image", image, "--concurrency", str(n),
               "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens), "--runs", "1", "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            results.append({"engine": "perch", "concurrency": n, "error": out.stderr.strip()[-400:]})
        else:
            report = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
            results.append({"engine": "perch", "concurrency": n,
                            "ttft_ms": report["ttft_ms_p95"] if n > 1 else report["ttft_ms_p50"],
                            "ttft_ms_p50": report["ttft_ms_p50"], "generation_tps": report["generation_tps"],
                            "wall_tps": report["wall_tps"],
                            "prompt_tokens": report["prompt_tokens"], "peak_bytes": report["peak_memory_bytes"],
                            "decode_step_ms": report.get("engine_decode_step_ms"),
                            "prefill_passes": report.get("engine_prefill_passes"),
                            "prefill_ms": report.get("engine_prefill_ms")})
        print(json.dumps(results[-1]), flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("perch")
    parser.add_argument("model_dir")
    parser.add_argument("image")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--skip-mlx-vlm", action="store_true")
    args = parser.parse_args()
    ours = perch_runs(args.perch, args.model_dir, args.image, args.concurrency, args.prompt_tokens,
                      args.gen_tokens)
    theirs = [] if args.skip_mlx_vlm else mlx_vlm_runs(args.model_dir, args.image, args.concurrency,
                                                        args.prompt_tokens, args.gen_tokens)
    print("\n| concurrency | Perch TTFT ms | mlx-vlm TTFT ms | Perch gen tok/s | mlx-vlm gen tok/s "
          "| Perch tok/s end to end | mlx-vlm tok/s end to end | ratio end to end |")
    print("|---|---|---|---|---|---|---|---|")
    for p in ours:
        m = next((r for r in theirs if r["concurrency"] == p["concurrency"]), {})
        if "error" in p:
            print(f"| {p['concurrency']} | error: {p['error'][-120:]} | | | | | | |")
            continue
        ratio = p["wall_tps"] / m["wall_tps"] if m.get("wall_tps") else None
        print(f"| {p['concurrency']} | {p['ttft_ms']:.0f} | {m.get('ttft_ms', float('nan')):.0f} | "
              f"{p['generation_tps']:,.0f} | {m.get('generation_tps', float('nan')):,.0f} | "
              f"{p['wall_tps']:,.0f} | {m.get('wall_tps', float('nan')):,.0f} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} |")
    print("TTFT: one request's (N = 1); for N > 1 Perch's p95 against the time mlx-vlm took to process every "
          "prompt of the batch.")


if __name__ == "__main__":
    sys.exit(main())
