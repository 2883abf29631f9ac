"""mlx_lm's side of tests/kv_quantization.rs, with mlx_lm 0.32.2.

    kv_quantization.py MODEL_DIR BITS GROUP_SIZE N PROMPTS_JSON

For each prompt (a JSON list of lists of token ids) prints, in one JSON list, an object with
- `ids`: the N greedy token ids mlx_lm's generate_step produces when every layer's cache is a
  QuantizedKVCache from the first token on (mlx_lm's generate with --kv-bits keeps the first
  prefill chunk in float and quantizes afterwards; Perch quantizes from the start, which is this);
- `top`: teacher-forced, one forward pass over the prompt and those ids through a fresh
  QuantizedKVCache: at each generated position, the 2 most likely ids and their log-probabilities.
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

    def cache():
        return [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]

    outputs = []
    for prompt in prompts:
        ids = [int(token) for token, _ in generate_step(mx.array(prompt), model, prompt_cache=cache(),
                                                         max_tokens=n)]
        logits = model(mx.array(prompt + ids[:-1])[None], cache=cache())[0, len(prompt) - 1:]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        best = mx.argsort(-logprobs, axis=-1)[:, :2]
        top = [[[t, row[t].item()] for t in row_best.tolist()] for row, row_best in zip(logprobs, best)]
        outputs.append({"ids": ids, "top": top})
    print(json.dumps(outputs))


if __name__ == "__main__":
    main()
