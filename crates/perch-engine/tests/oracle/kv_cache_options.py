"""mlx_lm's side of tests/kv_cache_options.rs: `max_kv_size` and `kv_bits` / `quantized_kv_start`,
as mlx_lm 0.32.2's generate_step applies them.

    kv_cache_options.py OUT_DIR TOKENIZER_DIR

Writes tiny_models.py's float32 Qwen3 model to OUT_DIR/qwen3 (and its Gemma 3, with sliding layers, to
OUT_DIR/gemma3_text, for a check of Perch's batch against Perch's own one-sequence bounded cache: mlx_lm
ignores max_kv_size for Gemma) (Qwen3 has no make_cache of its own,
so mlx_lm's make_prompt_cache gives it RotatingKVCache(max_kv_size, keep=4) layers; for Llama it
would ignore max_kv_size), then prints one JSON list with, for each case of CASES: its options,
mlx_lm's greedy ids under a repetition penalty of PENALTY and each step's log-probability of the chosen token, and those ids' log-probabilities
with a plain cache (to show where the option changes something).
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

import tiny_models

PENALTY = 3.0
SHORT = tiny_models.PROMPT  # 18 tokens
LONG = tiny_models.LONG_PROMPT

# name, prompt, generate_step options, tokens generated. The rotating cases wrap during decoding,
# during one prefill chunk longer than the bound, across prefill chunks, and with chunks shorter
# than the first kept positions; the quantized ones convert during decoding, between prefill
# chunks, and after the first chunk (start 0).
CASES = [
    ("rotating-decode", SHORT, {"max_kv_size": 32}, 48),
    ("rotating-long-prompt", LONG[:120], {"max_kv_size": 48}, 24),
    ("rotating-chunked", LONG[:120], {"max_kv_size": 48, "prefill_step_size": 32}, 24),
    ("rotating-small-chunks", LONG[:60], {"max_kv_size": 24, "prefill_step_size": 3}, 40),
    ("quantized-decode", SHORT, {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 24}, 24),
    ("quantized-prefill", LONG[:100], {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 40,
                                       "prefill_step_size": 32}, 16),
    ("quantized-start-0", SHORT, {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}, 8),
]


def run(model, prompt, options, n):
    # Greedy with a repetition penalty (a random model's plain greedy ids repeat one token; a
    # sampled run flips between neighbouring ids on float32 rounding, its distribution being
    # almost flat): the cache holds varied tokens and each id has a clear margin.
    processors = make_logits_processors(repetition_penalty=PENALTY, repetition_context_size=20)
    ids, logprobs = [], []
    for (token, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors,
                                            **options), range(n)):
        ids.append(int(token))
        logprobs.append(lp[int(token)].item())
    return ids, logprobs


def main(out_dir: Path, tokenizer_dir: Path):
    tiny_models.CASES = {name: tiny_models.CASES[name] for name in ("qwen3", "gemma3_text")}
    tiny_models.main(out_dir, tokenizer_dir)
    model, _ = load(str(out_dir / "qwen3"))
    results = []
    for name, prompt, options, n in CASES:
        ids, logprobs = run(model, prompt, options, n)
        # The same ids' log-probabilities with a plain cache (one forward pass, every position).
        # (the repetition penalty applied to each position as generate_step applies it).
        logits = model(mx.array(prompt + ids[:-1])[None])[0, len(prompt) - 1:]
        unbounded = []
        for i, t in enumerate(ids):
            row = logits[i:i + 1]
            for processor in make_logits_processors(repetition_penalty=PENALTY, repetition_context_size=20):
                row = processor(mx.array(prompt + ids[:i]), row)
            unbounded.append((row - mx.logsumexp(row, axis=-1, keepdims=True))[0, t].item())
        results.append({"name": name, "prompt": prompt, "options": options, "ids": ids,
                        "logprobs": logprobs, "plain_logprobs": unbounded})
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
