"""What the vision oracles (`tiny_vision.py`, `tiny_qwen_vision.py`, `tiny_gemma4_vision.py`) share: a
tiny random mlx-vlm model of a config, and the test tokenizer with a model's image tokens added."""

import json

import mlx.core as mx
from mlx.utils import tree_map
from mlx_vlm.utils import get_model_and_args, update_module_configs


def build(config):
    """mlx-vlm's model of `config` (text and vision sub-configs) with random float32 parameters of a
    moderate size, `uniform(-0.5, 0.5)` from seed 7."""
    arch, _ = get_model_and_args(config)
    model_config = arch.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, arch, config, ["text", "vision"])
    model = arch.Model(model_config)
    mx.random.seed(7)
    params = tree_map(lambda p: mx.random.uniform(-0.5, 0.5, p.shape).astype(mx.float32), model.parameters())
    model.update(params)
    mx.eval(model.parameters())
    return model


def write_tokenizer(out, tokenizer_dir, tokens, config_updates):
    """Writes into `out` the tokenizer of `tokenizer_dir` with `tokens` (content → id, after its
    vocabulary) added as special tokens, and its tokenizer_config.json with `config_updates`."""
    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for content, token_id in tokens.items():
        tokenizer["added_tokens"].append({"id": token_id, "content": content, "single_word": False,
                                          "lstrip": False, "rstrip": False, "normalized": False,
                                          "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.update(config_updates)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
