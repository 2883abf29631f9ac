"""Writes a random Qwen3.5 vision-language model of Qwen3.5-0.8B's shape (the text model of
`make_random_model.py qwen3_5`, 4-bit, and a vision tower of 12 blocks of 768, 16-pixel patches merged
2 x 2), with Python mlx-vlm, for issue 42's GPU benchmark (`scripts/bench_vision_gpu.py`).

    target/oracle-venv/bin/python scripts/make_random_vlm.py OUT_DIR TOKENIZER_DIR [float32|bfloat16]

The text model's linear maps are quantized (4-bit, group 64); the tower stays in the given dtype. TOKENIZER_DIR's
tokenizer (a vocabulary of 49,152, as the default model's) gets Qwen's four vision tokens after it, a ChatML
template that writes an image part as `<|vision_start|><|image_pad|><|vision_end|>`, and
preprocessor_config.json holds mlx-vlm's Qwen3-VL defaults (56² to 14² · 4 · 1,280 pixels).
"""
import json
import sys
from pathlib import Path

# The vision oracles' tokenizer writer and Qwen's vision tokens and template (tests/oracle).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "crates/perch-engine/tests/oracle"))
from tiny_qwen_vision import TEMPLATE, VISION_TOKENS  # noqa: E402
from vision_oracle import write_tokenizer  # noqa: E402

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_vlm.utils import get_model_and_args, update_module_configs

TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "vocab_size": 49156, "max_position_embeddings": 32768, "full_attention_interval": 4,
    "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
CONFIG = {
    "model_type": "qwen3_5", "image_token_id": 49153, "video_token_id": 49154,
    "vision_start_token_id": 49152, "vision_end_token_id": 49155, "vocab_size": 49156,
    "text_config": TEXT,
    "vision_config": {"model_type": "qwen3_5", "depth": 12, "hidden_size": 768, "intermediate_size": 3072,
                      "out_hidden_size": 1024, "num_heads": 12, "patch_size": 16, "temporal_patch_size": 2,
                      "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": []},
}
def main():
    out, tok = Path(sys.argv[1]), Path(sys.argv[2])
    dtype = getattr(mx, sys.argv[3] if len(sys.argv) > 3 else "float32")
    arch, _ = get_model_and_args(CONFIG)
    model_config = arch.ModelConfig.from_dict(CONFIG)
    model_config = update_module_configs(model_config, arch, CONFIG, ["text", "vision"])
    mx.random.seed(0)
    model = arch.Model(model_config)
    model.set_dtype(dtype)
    config = json.loads(json.dumps(CONFIG))
    config["quantization"] = {"group_size": 64, "bits": 4}

    def text_linear(path, module):
        return (path.startswith("language_model") and hasattr(module, "to_quantized")
                and module.weight.shape[-1] % 64 == 0)

    nn.quantize(model, group_size=64, bits=4, class_predicate=text_linear)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, tok, VISION_TOKENS, {"chat_template": TEMPLATE})
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 56 * 56, "longest_edge": 14 * 14 * 4 * 1280}, "patch_size": 16,
        "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))


if __name__ == "__main__":
    main()
