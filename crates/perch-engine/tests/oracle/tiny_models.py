"""Writes tiny random models of each supported architecture with Python mlx_lm, plus what mlx_lm
computes on them, for `tests/architecture_parity.rs`.

Usage: python tiny_models.py OUT_DIR TOKENIZER_DIR
For each case, OUT_DIR/<case>/ holds an mlx-community model directory (config.json,
model.safetensors, the tokenizer files of TOKENIZER_DIR) and expected.json with
`prompt_ids`, `logits` (all positions, [seq, vocab] flattened) and `greedy_ids` from
`mlx_lm.generate.generate_step`.
"""

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2, qwen3, qwen3_5

VOCAB = 49152  # the test model's (SmolLM2) tokenizer vocabulary, so the models are complete directories

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
}

QWEN3_5_TEXT = {
    **BASE,
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 4,
    "head_dim": 32,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]},
}

CASES = {
    "llama3-rope": (llama, {
        **BASE,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }, None),
    "qwen2": (qwen2, {**BASE, "model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": True}, None),
    "qwen2-4bit": (qwen2, {**BASE, "model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": True},
                   {"group_size": 32, "bits": 4}),
    # Stored in bfloat16; Perch computes in float32 on CPU, so the oracle does too (below).
    "qwen2-bf16": (qwen2, {**BASE, "model_type": "qwen2", "rope_theta": 1000000.0, "tie_word_embeddings": False}, "bf16"),
    "qwen3": (qwen3, {**BASE, "model_type": "qwen3", "head_dim": 32, "rope_theta": 1000000.0,
                      "tie_word_embeddings": True}, None),
    "qwen3-8bit-mixed": (qwen3, {**BASE, "model_type": "qwen3", "head_dim": 32, "rope_theta": 1000000.0,
                                 "tie_word_embeddings": False}, {"group_size": 64, "bits": 8}),
    # Hybrid Gated DeltaNet / gated attention (layers 2 and 4 full attention), nested in
    # text_config as mlx-community's Qwen3.5 configs are; 4 linear value heads over 2 key heads.
    "qwen3_5": (qwen3_5, {"model_type": "qwen3_5", "text_config": QWEN3_5_TEXT}, None),
    "qwen3_5-4bit": (qwen3_5, {"model_type": "qwen3_5", "text_config": {**QWEN3_5_TEXT, "tie_word_embeddings": True}},
                     {"group_size": 32, "bits": 4}),
}

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


def main(out_dir: Path, tokenizer_dir: Path):
    for name, (module, config, quant) in CASES.items():
        mx.random.seed(len(name))
        model = module.Model(module.ModelArgs.from_dict(config))
        if name.startswith("qwen3_5"):
            # Norm weights and the time-step bias start at ones: make them random, so that a norm
            # applied to the wrong tensor (or not at all) shows in the logits.
            from mlx.utils import tree_unflatten
            perturbed = [
                (k, mx.random.uniform(0.5, 1.5, v.shape))
                for k, v in tree_flatten(model.parameters())
                if k.endswith("norm.weight") or k.endswith("dt_bias")
            ]
            model.update(tree_unflatten(perturbed))
        if quant == "bf16":
            model.set_dtype(mx.bfloat16)
            config["torch_dtype"] = "bfloat16"
        elif quant is not None:
            if name.endswith("mixed"):
                # Per-layer override: the first layer's MLP down projection stays at 4 bits.
                def predicate(path, module_):
                    if not hasattr(module_, "to_quantized"):
                        return False
                    if path == "model.layers.0.mlp.down_proj":
                        return {"group_size": 32, "bits": 4}
                    return True
                nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], class_predicate=predicate)
                config["quantization"] = {**quant, "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4}}
            else:
                nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"])
                config["quantization"] = dict(quant)
        mx.eval(model.parameters())

        case_dir = out_dir / name
        case_dir.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(case_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
        (case_dir / "config.json").write_text(json.dumps(config, indent=2))
        for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
            shutil.copy(tokenizer_dir / f, case_dir / f)

        if quant == "bf16":
            model.set_dtype(mx.float32)
        prompt = mx.array(PROMPT)
        logits = model(prompt[None])[0]
        greedy = [int(tok) for tok, _ in zip((t for t, _ in generate_step(prompt, model, max_tokens=16)), range(16))]
        expected = {
            "prompt_ids": PROMPT,
            "logits_shape": list(logits.shape),
            "logits": logits.astype(mx.float32).reshape(-1).tolist(),
            "greedy_ids": greedy,
        }
        (case_dir / "expected.json").write_text(json.dumps(expected))
        print(name, "ok", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
