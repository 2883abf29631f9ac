"""The draft of tests/speculative.rs: tiny_models.py's random Llama over the test model's whole
vocabulary (so that it can draft for it), written by mlx_lm.

    speculative.py OUT_DIR MODEL_DIR

Writes OUT_DIR/llama3-rope with MODEL_DIR's tokenizer files. mlx_lm's own speculative runs on
the test model are a committed fixture (tests/fixtures/smollm2-speculative.json, made by
scripts/make_references.py speculative).
"""

import sys
from pathlib import Path

import tiny_models


def main(out_dir: Path, model_dir: str):
    module, config, quant = tiny_models.CASES["llama3-rope"]
    tiny_models.CASES = {"llama3-rope": (module, {**config, "vocab_size": 49152}, quant)}
    tiny_models.main(out_dir, Path(model_dir))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
