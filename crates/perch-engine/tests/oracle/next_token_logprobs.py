"""mlx_lm's side of tests/next_token_logprobs.rs (mlx_lm 0.32.2).

    next_token_logprobs.py MODEL_DIR PROMPTS.json OUT.safetensors

For each prompt (a list of token ids) of PROMPTS.json, runs the model over the whole prompt and
writes `log_softmax` of its last logits in float32 as `logprobs.{i}` (`[vocab]`).
"""

import json
import sys

import mlx.core as mx
from mlx_lm import load


def main():
    model_dir, prompts_file, out = sys.argv[1:4]
    model, _ = load(model_dir)
    prompts = json.load(open(prompts_file))
    arrays = {}
    for i, ids in enumerate(prompts):
        logits = model(mx.array(ids)[None])[0, -1].astype(mx.float32)
        arrays[f"logprobs.{i}"] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.save_safetensors(out, arrays)


if __name__ == "__main__":
    main()
