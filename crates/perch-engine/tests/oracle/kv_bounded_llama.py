"""mlx_lm's side of tests/kv_cache_options.rs's bounded Llama case: greedy ids of the test model
(SmolLM2, a Llama) with every layer's cache a `RotatingKVCache(max_size, keep=4)`, for prompts
longer than the bound, beside the same prompts' ids with plain caches.

    kv_bounded_llama.py MODEL_DIR

mlx_lm's `make_prompt_cache(model, max_kv_size)` (what `generate_step(max_kv_size=...)` and
`mlx_lm.generate --max-kv-size` use) returns the model's own `make_cache()` when it has one, and
Llama's (like Gemma 3's, gpt-oss's, Qwen3.5's) makes plain caches: mlx_lm ignores the bound for
those models. The caches are built here as make_prompt_cache builds them for a model without one.
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

MAX_KV_SIZE = 64
TOKENS = 32
TEXT = " ".join(
    f"Item {i}: the {['red', 'blue', 'green', 'small', 'large'][i % 5]} box holds {i * 7 % 13} apples."
    for i in range(30)
)


def greedy(model, prompt, cache):
    steps = generate_step(mx.array(prompt), model, max_tokens=TOKENS, prompt_cache=cache)
    return [int(token) for (token, _), _ in zip(steps, range(TOKENS))]


def main(model_dir):
    model, tokenizer = load(model_dir)
    ids = tokenizer.encode(TEXT)
    cases = []
    # Longer than the bound: decoding wraps at once (70), and the prompt's one pass masks a
    # window (130).
    for n in (70, 130):
        prompt = ids[:n]
        assert len(prompt) == n
        rotating = [RotatingKVCache(max_size=MAX_KV_SIZE, keep=4) for _ in model.layers]
        cases.append({
            "prompt": prompt,
            "max_kv_size": MAX_KV_SIZE,
            "ids": greedy(model, prompt, rotating),
            "plain_ids": greedy(model, prompt, make_prompt_cache(model)),
        })
    print(json.dumps(cases))


if __name__ == "__main__":
    main(sys.argv[1])
