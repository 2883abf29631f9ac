"""A draft model for a model, for measuring speculative decoding where no real family pair is at hand
(the benchmark machines reach no model hub): the draft is the model's first `--draft-layers` layers with
its embeddings, final norm and head, so it costs about `draft_layers / layers` of a model step, and how often
it agrees with the model is set by `--scale`: the model's later layers' writes to the residual stream (the
attention output and MLP down projections) are multiplied by it, in place (0: the later layers add nothing
and the pair agrees on every token, up to rounding; 1: the model unchanged, and a random model's later layers
decide most tokens). Prints the draft's path.

    python scripts/make_draft_pair.py MODEL_DIR DRAFT_DIR [--draft-layers 2] [--scale 0.0]

MODEL_DIR is an mlx-community Llama-style or Qwen3.5-style (hybrid; draft layers a multiple of its
`full_attention_interval` keep its pattern) directory (one `model.safetensors`, as `bench_gpu.py` and
`make_random_model.py` write them), quantized (affine: a weight is `scales * q + biases`, so scaling both
scales the weight) or not. The pair shares the tokenizer files. A measurement tool only: the ratios it gives
are the mechanism's at that agreement, not a real pair's.
"""

import argparse
import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

# A layer's writes to the residual stream: attention's (or a linear-attention layer's) output projection and
# the MLP's down projection (a mixture of experts': its experts' and its shared expert's).
WRITES = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn\.o_proj|linear_attn\.out_proj|mlp\..*down_proj)"
                    r"\.(weight|scales|biases|bias)$")
LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)\.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("draft_dir", type=Path)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--scale", type=float, default=0.0)
    args = parser.parse_args()

    config = json.loads((args.model_dir / "config.json").read_text())
    # Qwen3.5's layers are counted in its text model's configuration.
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    if not 0 < args.draft_layers < layers:
        raise SystemExit(f"--draft-layers must be 1 to {layers - 1}")
    weights_file = args.model_dir / "model.safetensors"
    weights = mx.load(str(weights_file))
    quantized = "quantization" in config

    scaled = {}
    for name, value in weights.items():
        m = WRITES.match(name)
        if m and int(m.group(1)) >= args.draft_layers and args.scale != 1.0:
            # A quantized weight's integers stay; its scales and biases carry the factor.
            if not (quantized and m.group(3) == "weight"):
                value = (value * args.scale).astype(value.dtype)
        scaled[name] = value
    # The loaded arrays read the file lazily: computed first, written beside it, then moved over it.
    mx.eval(scaled)
    written = args.model_dir / "model.partial.safetensors"
    mx.save_safetensors(str(written), scaled)
    written.replace(weights_file)

    args.draft_dir.mkdir(parents=True, exist_ok=True)
    draft = {}
    for name, value in scaled.items():
        m = LAYER.match(name)
        if m is None or int(m.group(1)) < args.draft_layers:
            draft[name] = value
    mx.save_safetensors(str(args.draft_dir / "model.safetensors"), draft)
    text["num_hidden_layers"] = args.draft_layers
    (args.draft_dir / "config.json").write_text(json.dumps(config))
    for f in args.model_dir.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, args.draft_dir / f.name)
    print(args.draft_dir)


if __name__ == "__main__":
    main()
