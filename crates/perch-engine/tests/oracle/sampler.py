"""mlx_lm's side of tests/sampling_parity.rs (mlx_lm 0.32.2).

    sampler.py CASES.json MODEL_DIR

For each case of CASES.json ({"logits": [[...]], "params": make_sampler's keyword arguments,
"seed": int, "draws": int}), seeds MLX's global generator with `mx.random.seed(seed)` (as
`mlx_lm.generate --seed` does), builds `make_sampler(**params)` and draws `draws` tokens from
the log-softmax of `logits`, each step's sampler call in turn. Prints one JSON object:
{"tokens": [[...] per case], "xtc_special_tokens": what mlx_lm's generate passes for MODEL_DIR's
tokenizer (its encoding of "\\n" and its EOS ids)}.
"""

import json
import sys

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer


def main():
    cases_file, model_dir = sys.argv[1:3]
    cases = json.load(open(cases_file))
    tokens = []
    for case in cases:
        logits = mx.array(case["logits"], dtype=mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.random.seed(case["seed"])
        sampler = make_sampler(**case["params"])
        drawn = []
        for _ in range(case["draws"]):
            drawn.append(sampler(logprobs).item())
        tokens.append(drawn)
    from pathlib import Path

    tokenizer = load_tokenizer(Path(model_dir))
    special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    print(json.dumps({"tokens": tokens, "xtc_special_tokens": special}))


if __name__ == "__main__":
    main()
