"""Speculative decoding, Perch against mlx_lm in one run: a model generates with and without a draft
model, in both engines, and the script prints generation tok/s, the speed-up from the draft and the
share of tokens that came from the draft.

    target/oracle-venv/bin/python scripts/bench_speculative.py [--draft DIR] [--model DIR]
        [--prompt-tokens 128] [--gen-tokens 128] [--num-draft-tokens 3] [--runs 2]
        [--perch target/release/perch]

The default pair is issue 15's: the default model at 4 bits (`--draft`, default the test model) as
the draft for a float32 copy of itself (`--model`; without it, mlx_lm's `convert --dequantize
--dtype float32` of the draft, made in a temporary directory). The prompt is a chat-templated
request for a story (plain text for a tokenizer without a chat template; greedy; end of sequence
ignored by both). mlx_lm runs `generate_step` and
`speculative_generate_step` (its `--draft-model` path) and is timed as `stream_generate` reports:
generation tok/s over the tokens after the first. Perch runs `perch bench` with and without
`--draft-model` (the median of `--runs` runs after a warm-up).
"""

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step, speculative_generate_step

ROOT = Path(__file__).resolve().parent.parent
REQUEST = ("Write a long story about a fox who learns to read, with a beginning, a middle and an end. "
           "Describe the forest, the seasons and the other animals in detail.")


def mlx_lm_rate(model, prompt, gen_tokens, draft=None, num_draft_tokens=3):
    """Generation tok/s after the first token, and the share of tokens from the draft."""
    start = time.perf_counter()
    steps = (speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=num_draft_tokens,
                                       max_tokens=gen_tokens)
             if draft is not None else
             ((t, lp, False) for t, lp in generate_step(mx.array(prompt), model, max_tokens=gen_tokens)))
    n, from_draft, first = 0, 0, None
    for n, (_, _, drafted) in enumerate(steps, start=1):
        from_draft += bool(drafted)
        if n == 1:
            first = time.perf_counter()
    total = time.perf_counter() - first
    return (n - 1) / total, from_draft / n


def perch_rate(perch, model, prompt_file, gen_tokens, runs, draft=None, num_draft_tokens=3):
    args = [perch, "bench", "--model", str(model), "--prompt-ids", str(prompt_file), "--gen-tokens",
            str(gen_tokens), "--runs", str(runs), "--json"]
    if draft is not None:
        args += ["--draft-model", str(draft), "--num-draft-tokens", str(num_draft_tokens)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    return report["generation_tps"], report.get("acceptance_rate")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=Path, default=ROOT / "target/test-inputs/SmolLM2-135M-Instruct-Q4_1-mlx")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--perch", default=str(ROOT / "target/release/perch"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        main_dir = args.model
        if main_dir is None:
            main_dir = Path(tmp) / "main-f32"
            convert(str(args.draft), mlx_path=str(main_dir), dequantize=True, dtype="float32")
        model, tokenizer = load(str(main_dir))
        draft, _ = load(str(args.draft))
        if tokenizer.chat_template is not None:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": REQUEST}], add_generation_prompt=True)
        else:
            prompt = tokenizer.encode(REQUEST)
        prompt_file = Path(tmp) / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        k, n = args.num_draft_tokens, args.gen_tokens

        # Warm up both models once, then median of runs.
        mlx_lm_rate(model, prompt, 8)
        mlx_lm_rate(model, prompt, 8, draft, k)
        mlx_plain = statistics.median(mlx_lm_rate(model, prompt, n)[0] for _ in range(args.runs))
        spec = [mlx_lm_rate(model, prompt, n, draft, k) for _ in range(args.runs)]
        mlx_spec = statistics.median(r for r, _ in spec)
        mlx_share = spec[-1][1]
        perch_plain, _ = perch_rate(args.perch, main_dir, prompt_file, n, args.runs)
        perch_spec, acceptance = perch_rate(args.perch, main_dir, prompt_file, n, args.runs, args.draft, k)

    print(f"model {main_dir.name if args.model else 'float32 copy of ' + args.draft.name}, draft {args.draft.name}, "
          f"{len(prompt)} prompt tokens, {n} generated, {k} draft tokens per step, MLX {mx.__version__}")
    print(f"{'':>22} {'no draft':>10} {'draft':>10} {'speed-up':>9}")
    print(f"{'perch gen tok/s':>22} {perch_plain:10.1f} {perch_spec:10.1f} {perch_spec / perch_plain:8.2f}x")
    print(f"{'mlx_lm gen tok/s':>22} {mlx_plain:10.1f} {mlx_spec:10.1f} {mlx_spec / mlx_plain:8.2f}x")
    print(f"perch / mlx_lm with the draft: {perch_spec / mlx_spec:.2f}x; proposals accepted: perch "
          f"{acceptance:.0%}; tokens from the draft: mlx_lm {mlx_share:.0%}")
    print(json.dumps({"perch_tps": perch_plain, "perch_draft_tps": perch_spec, "mlx_lm_tps": mlx_plain,
                      "mlx_lm_draft_tps": mlx_spec, "perch_acceptance_rate": acceptance,
                      "mlx_lm_draft_share": mlx_share}))


if __name__ == "__main__":
    main()
