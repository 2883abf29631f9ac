"""One rank of mlx_lm's own sharded generation (as `mlx_lm.utils.sharded_load` divides a model), started as `mlx.launch
--backend ring` starts a rank (MLX_RANK, MLX_HOSTFILE), for `tests/distributed.rs`.

Usage: python sharded.py MODELS_DIR tensor|pipeline CASE[,CASE...]
For each case folder of MODELS_DIR (written by tiny_models.py): the model divided over the group by
mlx_lm (heads and features: `shard`; stages of layers: `pipeline`), its logits over expected.json's
prompt and 16 greedy ids from `generate_step`. Prints one JSON line: rank, and per case the largest
difference of the logits from expected.json's (mlx_lm's whole model) and the greedy ids.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, sharded_load

import mlx_lm_quirks  # noqa: F401 (MoE models run in mlx_lm 0.32.2)


def main(models: Path, mode: str, cases: list[str]):
    group = mx.distributed.init(backend="ring", strict=True)
    results = {}
    for name in cases:
        case = models / name
        expected = json.loads((case / "expected.json").read_text())
        if mode == "tensor":
            model, _ = sharded_load(str(case), tensor_group=group)
        else:
            # What sharded_load does for a pipeline, which it only takes from an indexed
            # (multi-file) checkpoint.
            model, _ = load(str(case))
            model.model.pipeline(group)
            mx.eval(model.parameters())
        prompt = mx.array(expected["prompt_ids"])
        logits = model(prompt[None])[0].astype(mx.float32).reshape(-1)
        difference = mx.abs(logits - mx.array(expected["logits"])).max().item()
        steps = generate_step(prompt, model, max_tokens=16)
        results[name] = {"difference": difference, "greedy_ids": [int(t) for t, _ in steps]}
    print(json.dumps({"rank": group.rank(), "cases": results}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","))
