"""mlx_lm's side of tests/speculative.rs: speculative decoding with mlx_lm 0.32.2's
`speculative_generate_step`.

    speculative.py OUT_DIR MODEL_DIR RUNS_JSON

Writes tiny_models.py's random Llama (the test model's tokenizer, so it can draft for it) to
OUT_DIR/llama3-rope, then for each run of RUNS_JSON ({"prompt": ids, "draft": "self" | "tiny",
"temp": float, "seed": int, "num_draft_tokens": int, "max_tokens": int}) seeds MLX's generator
(`mx.random.seed`, as `mlx_lm.generate --seed`), samples with `make_sampler(temp)` (greedy at 0) and
prints one JSON list: per run, the ids and `from_draft` flags mlx_lm yields.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import speculative_generate_step
from mlx_lm.sample_utils import make_sampler

import tiny_models


def main(out_dir: Path, model_dir: str, runs):
    # The whole vocabulary of the test model, which the draft must propose from.
    module, config, quant = tiny_models.CASES["llama3-rope"]
    tiny_models.CASES = {"llama3-rope": (module, {**config, "vocab_size": 49152}, quant)}
    tiny_models.main(out_dir, Path(model_dir))
    model, _ = load(model_dir)
    drafts = {"self": load(model_dir)[0], "tiny": load(str(out_dir / "llama3-rope"))[0]}
    results = []
    for run in runs:
        mx.random.seed(run["seed"])
        ids, flags = [], []
        for token, _, from_draft in speculative_generate_step(
                mx.array(run["prompt"]), model, drafts[run["draft"]], num_draft_tokens=run["num_draft_tokens"],
                max_tokens=run["max_tokens"], sampler=make_sampler(temp=run["temp"]), prefill_step_size=2048):
            ids.append(int(token))
            flags.append(bool(from_draft))
        results.append({"ids": ids, "from_draft": flags})
    print(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
