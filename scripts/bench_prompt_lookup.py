"""Prompt lookup (n-gram speculative decoding in the batch) on an edit task, with mlx_lm in the same run.

The task: a chat asking the model to repeat a 30-line Python file with one function renamed, so that most of
its answer repeats the file in its prompt (the shape of a coding agent's edit). For each concurrency N, the
same prompt N times through `perch bench --concurrency N` without and with `--prompt-lookup` (greedy, end of
sequence ignored, --gen-tokens each), and mlx_lm's `stream_generate` on the same prompt ids for one stream
(mlx_lm has no prompt lookup). Prints one JSON line per measurement, then a table: generation tokens per
second (after each request's first token), Perch with prompt lookup over Perch without, the share of
proposed tokens accepted. Whether the answer really repeats the file depends on the model: the table says
what share of the answer's tokens came from accepted proposals.

    python scripts/bench_prompt_lookup.py PERCH_BINARY MODEL_DIR [--concurrency 1 2 8] [--gen-tokens 128]
        [--no-mlx-lm] [--extra-perch-args ...]

Units: tokens per second, milliseconds.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILE = '''def add(a, b):
    return a + b


def subtract(a, b):
    return a - b


def multiply(a, b):
    return a * b


def divide(a, b):
    if b == 0:
        raise ValueError("division by zero")
    return a / b


def power(base, exponent):
    result = 1
    for _ in range(exponent):
        result = multiply(result, base)
    return result


def average(values):
    total = 0
    for value in values:
        total = add(total, value)
    return divide(total, len(values))
'''

ASK = "Repeat this code exactly, with the function multiply renamed to times:\n" + FILE + "\n"


def prompt_ids(model_dir: Path) -> list:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    text = tokenizer.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def perch_run(binary: str, model_dir: Path, ids: list, n: int, gen_tokens: int, extra: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps([ids] * n))
        cmd = [binary, "bench", "--model", str(model_dir), "--concurrency", str(n), "--prompt-ids", str(path),
               "--gen-tokens", str(gen_tokens), "--json", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"perch bench failed:\n{out.stderr[-3000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def mlx_lm_run(model_dir: Path, ids: list, gen_tokens: int) -> dict:
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    model, tokenizer = load(str(model_dir))
    # A warm-up of the same shapes, then the measured run (greedy; mlx_lm stops at end of sequence only
    # when the tokenizer says so, so its count is reported).
    for _ in stream_generate(model, tokenizer, prompt=ids, max_tokens=8):
        pass
    last = None
    start = time.perf_counter()
    for last in stream_generate(model, tokenizer, prompt=mx.array(ids), max_tokens=gen_tokens):
        pass
    return {"generation_tps": last.generation_tps, "generation_tokens": last.generation_tokens,
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--extra-perch-args", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    ids = prompt_ids(args.model_dir)
    print(json.dumps({"prompt_tokens": len(ids), "gen_tokens": args.gen_tokens}), flush=True)
    rows = []
    for n in args.concurrency:
        plain = perch_run(args.binary, args.model_dir, ids, n, args.gen_tokens, args.extra_perch_args)
        looked = perch_run(args.binary, args.model_dir, ids, n, args.gen_tokens,
                           ["--prompt-lookup", *args.extra_perch_args])
        for label, report in (("perch", plain), ("perch --prompt-lookup", looked)):
            print(json.dumps({"engine": label, "concurrency": n, **report}), flush=True)
        rows.append((n, plain, looked))
    theirs = None
    if not args.no_mlx_lm:
        theirs = mlx_lm_run(args.model_dir, ids, args.gen_tokens)
        print(json.dumps({"engine": "mlx_lm", "concurrency": 1, **theirs}), flush=True)
    print("\n| concurrency | Perch tok/s | Perch with prompt lookup | ratio | accepted of proposed | "
          "answer from proposals | ITL p50 / p95 with (ms) | mlx_lm tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, plain, looked in rows:
        drafted, accepted = looked["engine_draft_tokens"], looked["engine_accepted_draft_tokens"]
        generated = n * args.gen_tokens
        mlx = f"{theirs['generation_tps']:,.1f}" if theirs and n == 1 else "—"
        print(f"| {n} | {plain['generation_tps']:,.1f} | {looked['generation_tps']:,.1f} | "
              f"**{looked['generation_tps'] / max(plain['generation_tps'], 1e-9):.2f}×** | "
              f"{accepted} / {drafted} ({100 * accepted / max(drafted, 1):.0f}%) | "
              f"{100 * accepted / max(generated, 1):.0f}% | "
              f"{looked['itl_ms_p50']:.0f} / {looked['itl_ms_p95']:.0f} | {mlx} |")


if __name__ == "__main__":
    main()
