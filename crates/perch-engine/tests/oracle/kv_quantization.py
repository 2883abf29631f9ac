"""mlx_lm's side of tests/kv_quantization.rs, with mlx_lm 0.32.2.

    kv_quantization.py MODEL_DIR BITS GROUP_SIZE N PROMPTS_JSON

For each prompt (a JSON list of lists of token ids) prints, as one JSON list of lists, the N
greedy token ids mlx_lm's generate_step produces when every layer's cache is a QuantizedKVCache
from the first token on. (mlx_lm's generate with --kv-bits keeps the first prefill chunk in float
and quantizes afterwards; Perch quantizes from the start, which is this.)
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache


def main():
    model_dir, bits, group_size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompts = json.loads(sys.argv[5])
    model, _ = load(model_dir)
    outputs = []
    for ids in prompts:
        cache = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]
        steps = generate_step(mx.array(ids), model, prompt_cache=cache, max_tokens=n)
        outputs.append([int(token) for token, _ in steps])
    print(json.dumps(outputs))


if __name__ == "__main__":
    main()
