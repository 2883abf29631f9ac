"""Writes tiny random models of each supported architecture with Python mlx_lm, plus what mlx_lm
computes on them, for `tests/architecture_parity.rs`.

Usage: python tiny_models.py OUT_DIR TOKENIZER_DIR [CASE,CASE,...]
For each case (every one, or those listed), OUT_DIR/<case>/ holds an mlx-community model directory (config.json,
model.safetensors, the tokenizer files of TOKENIZER_DIR) and expected.json with
`prompt_ids`, `logits` (all positions, [seq, vocab] flattened) and `greedy_ids` from
`mlx_lm.generate.generate_step`; models with sliding-window layers add `long_prompt_ids` and
`long_greedy_ids` (a prompt far longer than the window).
"""

import copy
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import (gemma3, gemma3_text, gemma4, gemma4_text, gpt_oss, llama, ministral3, mistral3, olmo2, phi3,
                           qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, smollm3)

import mlx_lm_quirks  # noqa: F401 (MoE models run in mlx_lm 0.32.2)

# The first 4,096 ids of the test model's (SmolLM2) tokenizer, whose files the model directories
# carry: the output layer, most of a tiny model's work, stays small. (speculative.py widens its Llama
# to the whole vocabulary, to draft for SmolLM2.)
VOCAB = 4096

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

# Sliding window 8 on layers 1 and 3 (of 4), shorter than the 18-token prompt; hidden 96 so that the
# bfloat16-rounded embedding scale (9.8125) differs from sqrt(96); query_pre_attn_scalar apart from
# head_dim; linear RoPE scaling on the global layers only.
GEMMA3_TEXT = {
    **BASE,
    "model_type": "gemma3_text",
    "hidden_size": 96,
    "num_hidden_layers": 4,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 48,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "rope_scaling": {"factor": 4.0, "rope_type": "linear"},
}

# Gemma 4 as E2B / E4B are shaped: 6 layers (full attention at 2 and 5, the others sliding over
# 8 positions), global heads twice as wide (32) as sliding ones with proportional RoPE over a
# quarter of their features, the last 2 layers reading the caches of layers 3 (sliding) and 2
# (global) with MLPs twice as wide, per-layer inputs of 32 features, logits soft-capped at 5 (so
# that the cap bends them).
GEMMA4_TEXT = {
    **BASE,
    "model_type": "gemma4_text",
    "num_hidden_layers": 6,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 32,
    "vocab_size_per_layer_input": VOCAB,
    "use_double_wide_mlp": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                    "sliding_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 5.0,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
}

# Gemma 4 as 26B-A4B is shaped: experts beside every layer's MLP (4 experts, 2 per token), global
# layers whose values are their keys' projection with one KV head, no shared caches or per-layer
# inputs.
GEMMA4_MOE_TEXT = {
    **GEMMA4_TEXT,
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}

# gpt-oss: sliding (8) and global layers alternating, attention sinks, biases on every attention
# projection and expert, YaRN over 16 original positions, 4 experts with 2 per token (18 prompt
# tokens x 2 = 36 pairs: unsorted; the 400-token prompt sorts them).
GPT_OSS = {
    **BASE,
    "model_type": "gpt_oss",
    "num_hidden_layers": 4,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "sliding_window": 8,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 16, "truncate": False},
}

# Layer 0 dense (mlp_only_layers), layers 1-3 sparse: 8 experts, 4 per token in float32 (18 prompt
# tokens x 4 = 72 pairs, so mlx_lm sorts them by expert; saved in Hugging Face's per-expert
# layout, below), 2 at 4 bits without renormalising (mlx-community's stacked switch_mlp layout).
QWEN3_MOE = {
    **BASE,
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "num_experts": 8,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}

# Qwen3.5's hybrid layers with a sparse block and a gated shared expert in every layer.
QWEN3_5_MOE_TEXT = {
    **QWEN3_5_TEXT,
    "num_experts": 8,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 96,
}

# Fused qkv_proj and gate_up_proj; head size 16 with RoPE on 12 of its features (Phi-4-mini's
# partial_rotary_factor 0.75) and LongRoPE: per-pair long factors, attention factor sqrt(1.5)
# from max / original positions 512 / 64.
PHI3 = {
    **BASE,
    "model_type": "phi3",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 64,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0, 1.5, 2.25, 3.0, 5.5, 8.0],
                     "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.4]},
    "tie_word_embeddings": False,
}

# Head size 32 with YaRN over RoPE base 10 and 8 original positions (pairs 0-2 blend between
# extrapolated and interpolated periods, attention factor 1 + 0.1 ln 4), and Llama 4's query scale
# crossing its 8-position steps four times in the 18-token prompt and 16 generated tokens; layers
# 1 and 3 slide over 8 positions.
MINISTRAL3 = {
    **BASE,
    "model_type": "ministral3",
    "num_hidden_layers": 4,
    "head_dim": 32,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10.0, "factor": 4.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                        "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.5},
    "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 8,
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
    "phi3": (phi3, PHI3, None),
    "phi3-4bit": (phi3, {**PHI3, "rope_scaling": None, "partial_rotary_factor": 1.0, "tie_word_embeddings": True},
                  {"group_size": 32, "bits": 4}),
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
    # Three runs of the linear / full attention pair: pipeline stages of unequal size (tests/distributed.rs).
    "qwen3_5-6": (qwen3_5, {"model_type": "qwen3_5", "text_config": {**QWEN3_5_TEXT, "num_hidden_layers": 6}}, None),
    "qwen3_5-4bit": (qwen3_5, {"model_type": "qwen3_5", "text_config": {**QWEN3_5_TEXT, "tie_word_embeddings": True}},
                     {"group_size": 32, "bits": 4}),
    "gemma3_text": (gemma3_text, GEMMA3_TEXT, None),
    # Three runs of the sliding / global pair: pipeline stages of unequal size (tests/distributed.rs).
    "gemma3_text-6": (gemma3_text, {**GEMMA3_TEXT, "num_hidden_layers": 6}, None),
    "qwen3_moe": (qwen3_moe, QWEN3_MOE, None),
    "qwen3_moe-4bit": (qwen3_moe, {**QWEN3_MOE, "num_experts_per_tok": 2, "norm_topk_prob": False,
                                   "tie_word_embeddings": True}, {"group_size": 32, "bits": 4}),
    # Nested in text_config, float32; then the text model's fields at the top level (mlx_lm reads
    # them there too), 4-bit with the router and shared-expert gates at 8 bits as mlx_lm converts it.
    "qwen3_5_moe": (qwen3_5_moe, {"model_type": "qwen3_5_moe", "text_config": QWEN3_5_MOE_TEXT}, None),
    "qwen3_5_moe-4bit": (qwen3_5_moe, {**QWEN3_5_MOE_TEXT, "model_type": "qwen3_5_moe", "num_experts_per_tok": 2,
                                       "norm_topk_prob": False, "tie_word_embeddings": True},
                         {"group_size": 32, "bits": 4}),
    # Llama with NoPE layers: every 4th by default (layer 3 of 4), or as listed (layers 1 and 3).
    "smollm3": (smollm3, {**BASE, "model_type": "smollm3", "num_hidden_layers": 4, "rope_theta": 5000000.0,
                          "tie_word_embeddings": True}, None),
    "smollm3-4bit": (smollm3, {**BASE, "model_type": "smollm3", "num_hidden_layers": 4, "rope_theta": 5000000.0,
                               "tie_word_embeddings": False, "no_rope_layers": [1, 0, 1, 0]},
                     {"group_size": 32, "bits": 4}),
    # Output norms only and query / key norms over all heads; attention biases.
    "olmo2": (olmo2, {**BASE, "model_type": "olmo2", "rope_theta": 500000.0, "attention_bias": True,
                      "tie_word_embeddings": False}, None),
    "olmo2-4bit": (olmo2, {**BASE, "model_type": "olmo2", "rope_theta": 500000.0}, {"group_size": 32, "bits": 4}),
    "ministral3": (ministral3, MINISTRAL3, None),
    # Mistral 3's multimodal layouts: a Ministral 3 text model (untied by mistral3's default), and
    # Mistral Small's Llama text model, each under language_model. beside a vision tower to ignore.
    "mistral3-4bit": (mistral3, {"model_type": "mistral3", "text_config": {**MINISTRAL3, "layer_types": None}},
                      {"group_size": 32, "bits": 4}),
    "mistral3-llama": (mistral3, {"model_type": "mistral3", "text_config": {
        **BASE, "model_type": "mistral", "head_dim": 32, "rope_theta": 1000000000.0}}, None),
    # The multimodal layout: text_config (its vocab_size replaced by the top level's, as mlx_lm
    # does), language_model. weights, a vision tower and projector to ignore, no lm_head (tied).
    "gemma3-4bit": (gemma3, {"model_type": "gemma3", "vocab_size": VOCAB,
                             "text_config": {**GEMMA3_TEXT, "vocab_size": 1000}},
                    {"group_size": 32, "bits": 4}),
    "gemma4_text": (gemma4_text, GEMMA4_TEXT, None),
    # The multimodal layout, 4-bit; it also holds the projections of the KV-shared layers that
    # mlx-community's conversions kept (below), which nothing reads.
    "gemma4-4bit": (gemma4, {"model_type": "gemma4", "vocab_size": VOCAB,
                             "text_config": {**GEMMA4_TEXT, "vocab_size": 1000}},
                    {"group_size": 32, "bits": 4}),
    # 4-bit with the routers at 8 bits, as mlx_lm converts it.
    "gemma4_text-moe-4bit": (gemma4_text, GEMMA4_MOE_TEXT, {"group_size": 32, "bits": 4}),
    "gpt_oss": (gpt_oss, GPT_OSS, None),
    "gpt_oss-4bit": (gpt_oss, {**GPT_OSS, "layer_types": ["full_attention", "sliding_attention"] * 2},
                     {"group_size": 32, "bits": 4}),
    # mlx-community's MXFP4-Q8 layout: experts in mxfp4 (the config's default), every other
    # layer 8-bit affine, listed by path without a mode.
    "gpt_oss-mxfp4": (gpt_oss, GPT_OSS, "mxfp4"),
}

# Tensors of a multimodal checkpoint that are not the text model's.
VISION_EXTRAS = {
    "vision_tower.vision_model.embeddings.patch_embedding.weight": mx.zeros((8, 3, 2, 2)),
    "multi_modal_projector.mm_input_projection_weight": mx.zeros((8, 96)),
}

PROMPT = [1, 1690, 198, 2683, 359, 253, 1356, 1646, 3173, 3365, 3511, 308, 2519, 28, 3018, 411, 407, 3712]

# Models with sliding-window layers also run a prompt long enough (400 tokens, within the tiny
# models' 512-position context) that Perch's caches drop positions out of the window (they do when
# their buffers grow, every 256 positions), as mlx_lm's RotatingKVCache overwrites them.
LONG_PROMPT = [(7919 * i + 13) % 4000 + 2 for i in range(400)]


def main(out_dir: Path, tokenizer_dir: Path, only: list[str] | None = None):
    unknown = set(only or []) - set(CASES)
    assert not unknown, f"no such cases: {sorted(unknown)}"
    for name, (module, config, quant) in CASES.items():
        if only is not None and name not in only:
            continue
        mx.random.seed(len(name))
        # A copy: mlx_lm's gemma3 args rewrite text_config in place, and config.json must stay as written.
        model = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config)))
        if name.startswith(("qwen3_5", "gemma3", "gemma4", "olmo2", "ministral3", "mistral3", "gpt_oss")):
            # Norm weights, the time-step bias and Gemma 4's scales start at constants: make them
            # random, so that a norm or scale applied to the wrong tensor (or not at all) shows in
            # the logits. (Gemma 3's norms are offsets from one.)
            from mlx.utils import tree_unflatten
            low, high = (-0.5, 0.5) if name.startswith("gemma3") else (0.5, 1.5)
            perturbed = [
                (k, mx.random.uniform(low, high, v.shape))
                for k, v in tree_flatten(model.parameters())
                if k.endswith(("norm.weight", "dt_bias", "layer_scalar", "router.scale", "per_expert_scale"))
            ]
            if name.startswith("gpt_oss"):
                # Attention sinks and biases start at zero: random too (biases small, or they
                # swamp the tiny model's activations into one repeated token).
                perturbed += [(k, mx.random.uniform(-0.1, 0.1, v.shape) if k.endswith(".bias")
                               else mx.random.uniform(-1.0, 1.0, v.shape))
                              for k, v in tree_flatten(model.parameters()) if k.endswith(("sinks", ".bias"))]
            model.update(tree_unflatten(perturbed))
        if name == "gemma3-4bit":
            # What mlx_lm's sanitize does for a checkpoint without lm_head.weight.
            model.language_model.tie_word_embeddings = True
            model.language_model.pop("lm_head")
        if quant == "bf16":
            model.set_dtype(mx.bfloat16)
            config["torch_dtype"] = "bfloat16"
        elif quant == "mxfp4":
            affine = {}

            def predicate(path, module_):
                if not hasattr(module_, "to_quantized"):
                    return False
                if ".experts." in path:
                    return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
                affine[path] = {"group_size": 64, "bits": 8}
                return affine[path]
            nn.quantize(model, class_predicate=predicate)
            config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4", **affine}
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
            elif getattr(model, "quant_predicate", None) is not None:
                # mlx_lm convert's way: the model's predicate picks per-layer overrides, which the
                # config lists by path.
                overrides = {}

                def predicate(path, module_):
                    if not hasattr(module_, "to_quantized"):
                        return False
                    chosen = model.quant_predicate(path, module_)
                    if isinstance(chosen, dict):
                        overrides[path] = chosen
                    return chosen

                nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], class_predicate=predicate)
                assert overrides or "moe" not in name, "the model's predicate chose no overrides"
                config["quantization"] = {**quant, **overrides}
            else:
                nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"])
                config["quantization"] = dict(quant)
        mx.eval(model.parameters())

        case_dir = out_dir / name
        case_dir.mkdir(parents=True, exist_ok=True)
        tensors = dict(tree_flatten(model.parameters()))
        if config.get("model_type") in ("gemma3", "gemma4", "mistral3"):
            tensors.update(VISION_EXTRAS)
        if name == "gemma4-4bit":
            # mlx-community's E2B / E4B conversions keep keys and values for the KV-shared layers.
            prefix = "language_model.model.layers.5.self_attn"
            for part, shape in [("k_proj.weight", (64, 8)), ("k_proj.scales", (64, 2)),
                                ("k_proj.biases", (64, 2)), ("k_norm.weight", (32,))]:
                tensors[f"{prefix}.{part}"] = mx.zeros(shape)
        if name == "qwen3_moe":
            # Hugging Face's layout: one tensor per expert (`mlp.experts.{e}.gate_proj.weight`),
            # which loaders stack into mlx-community's `switch_mlp` (mlx_lm's sanitize does).
            for key in [k for k in tensors if ".switch_mlp." in k]:
                stacked = tensors.pop(key)
                prefix, proj = key.split(".switch_mlp.")
                for e in range(stacked.shape[0]):
                    tensors[f"{prefix}.experts.{e}.{proj}"] = stacked[e]
        mx.save_safetensors(str(case_dir / "model.safetensors"), tensors)
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
        if config.get("sliding_window") or config.get("text_config", {}).get("sliding_window"):
            long_prompt = mx.array(LONG_PROMPT)
            expected["long_prompt_ids"] = LONG_PROMPT
            expected["long_greedy_ids"] = [
                int(tok) for tok, _ in zip((t for t, _ in generate_step(long_prompt, model, max_tokens=16)), range(16))
            ]
        (case_dir / "expected.json").write_text(json.dumps(expected))
        print(name, "ok", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",") if len(sys.argv) > 3 else None)
