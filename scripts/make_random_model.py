"""Writes a random model of a given architecture at a realistic size, 4-bit, with Python mlx_lm, for
benchmarks of architectures no small real model of which is at hand here (README: Qwen3.5, Gemma 3).

    target/oracle-venv/bin/python scripts/make_random_model.py ARCH OUT_DIR TOKENIZER_DIR [float32|bfloat16]

ARCH: qwen3_5 (Qwen3.5-like: hidden 1024, 24 layers of which 18 Gated DeltaNet), gemma3_text
(Gemma-3-1B-like: hidden 1152, 26 layers, 5 of every 6 with a 512-token sliding window; gemma3_text-kv:
the same attention on hidden 256, for long prompts), qwen3_moe
(a small Qwen3-30B-A3B: hidden 1024, 16 layers of 64 experts, 8 per token) or qwen3_5_moe (the
Qwen3.5 model above with 64 experts, 8 per token, and a shared expert in every layer) or phi3 (a
small Phi-4-mini: hidden 1024, 16 layers, RoPE on 0.75 of each head with LongRoPE) or olmo2 (a small
OLMo 2: hidden 1024, 16 layers) or ministral3 (a small Ministral 3: hidden 1024, 16 layers, YaRN and Llama
4 query scaling as the published models set them) or gemma4_text (a small Gemma 4 E2B: hidden 1024, 15 layers,
every 5th global with 512-wide heads, the last 5 reading earlier layers' caches, per-layer inputs of 256) or
gemma4_text-moe (a small Gemma 4 26B-A4B: hidden 1024, 12 layers, 32 experts beside each MLP, 4 per
token, global layers' values from their keys) or gpt_oss (a small gpt-oss-20b: hidden 1024, 12 layers alternating
128-token sliding windows and global attention with sinks, 32 experts, 4 per token, in mlx-community's MXFP4-Q8 form:
mxfp4 experts, 8-bit affine elsewhere). Routers
are kept at 8 bits, as mlx_lm's convert does.
TOKENIZER_DIR's tokenizer files are copied beside the weights (its vocabulary must have 49,152 tokens, as the
default model's has). Then: scripts/bench_vs_mlx_lm.py --model OUT_DIR.
"""
import json, shutil, sys
from pathlib import Path
import mlx.core as mx, mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, gemma4_text, gpt_oss, ministral3, olmo2, phi3, qwen3_5, qwen3_5_moe, qwen3_moe

QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 3584,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "vocab_size": 49152, "max_position_embeddings": 32768, "full_attention_interval": 4,
    "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}}
MOE = {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 256, "norm_topk_prob": True}
ARCHS = {
    "qwen3_5": (qwen3_5, {"model_type": "qwen3_5", "text_config": QWEN3_5_TEXT}),
    "qwen3_5_moe": (qwen3_5_moe, {"model_type": "qwen3_5_moe", "text_config": {
        **QWEN3_5_TEXT, **MOE, "shared_expert_intermediate_size": 512}}),
    "phi3": (phi3, {
        "model_type": "phi3", "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 2816,
        "num_attention_heads": 16, "num_key_value_heads": 4, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-5,
        "vocab_size": 49152, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": True,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 4 for i in range(24)],
                         "short_factor": [1.0] * 24}}),
    "qwen3_moe": (qwen3_moe, {
        "model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6,
        "vocab_size": 49152, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], **MOE}),
    "olmo2": (olmo2, {
        "model_type": "olmo2", "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 4096,
        "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-6, "vocab_size": 49152,
        "max_position_embeddings": 4096, "rope_theta": 500000.0, "tie_word_embeddings": False}),
    "ministral3": (ministral3, {
        "model_type": "ministral3", "hidden_size": 1024, "num_hidden_layers": 16, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-5,
        "vocab_size": 49152, "max_position_embeddings": 262144, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}}),
    "gemma3_text": (gemma3_text, {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26, "intermediate_size": 6912,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6, "vocab_size": 49152, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6}),
}
GEMMA4_LAYERS = (["sliding_attention"] * 4 + ["full_attention"]) * 3
ARCHS["gemma4_text"] = (gemma4_text, {
    "model_type": "gemma4_text", "hidden_size": 1024, "num_hidden_layers": 15, "intermediate_size": 4096,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "rms_norm_eps": 1e-6, "vocab_size": 49152, "vocab_size_per_layer_input": 49152, "num_kv_shared_layers": 5,
    "hidden_size_per_layer_input": 256, "use_double_wide_mlp": True, "sliding_window": 512,
    "max_position_embeddings": 131072, "final_logit_softcapping": 30.0, "layer_types": GEMMA4_LAYERS,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                           "rope_type": "proportional"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}})
ARCHS["gemma4_text-moe"] = (gemma4_text, {
    **ARCHS["gemma4_text"][1], "num_hidden_layers": 12, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
    "intermediate_size": 1024, "num_key_value_heads": 4, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "use_double_wide_mlp": False,
    "enable_moe_block": True, "num_experts": 32, "top_k_experts": 4, "moe_intermediate_size": 256})
ARCHS["gpt_oss"] = (gpt_oss, {
    "model_type": "gpt_oss", "hidden_size": 1024, "num_hidden_layers": 12, "intermediate_size": 1024,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "experts_per_token": 4, "rms_norm_eps": 1e-5, "vocab_size": 49152,
    "sliding_window": 128, "rope_theta": 150000, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 6,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False}})
# Gemma-3-1B's attention (26 layers, one 256-wide KV head, 5 of every 6 sliding over 512 tokens) on a
# narrow model (hidden 256, one query head), so that the KV cache, not the weights or the arithmetic, is what a long
# prompt costs: the sliding-window memory benchmark at 8k tokens.
ARCHS["gemma3_text-kv"] = (gemma3_text, {**ARCHS["gemma3_text"][1], "hidden_size": 256, "num_attention_heads": 1,
                                         "intermediate_size": 1024})
arch, out, tok = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
module, config = ARCHS[arch]
mx.random.seed(0)
model = module.Model(module.ModelArgs.from_dict(json.loads(json.dumps(config))))
model.set_dtype(getattr(mx, sys.argv[4] if len(sys.argv) > 4 else "float32"))
if arch.startswith("gemma3_text"):
    # Gemma's norm weights are offsets from one: zeros (mlx_lm's init of ones would double every norm).
    from mlx.utils import tree_unflatten
    model.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(model.parameters())
                                 if k.endswith("norm.weight")]))
config["quantization"] = {"group_size": 64, "bits": 4}
chooser = getattr(model, "quant_predicate", None)


def predicate(path, module):
    if not hasattr(module, "to_quantized"):
        return False
    chosen = chooser(path, module) if chooser is not None else True
    if isinstance(chosen, dict):
        config["quantization"][path] = chosen
    return chosen


if arch == "gpt_oss":
    # mlx-community's MXFP4-Q8: the experts in mxfp4 (the default), every other layer 8-bit affine by path.
    config["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}

    def predicate(path, module):  # noqa: F811
        if not hasattr(module, "to_quantized"):
            return False
        if ".experts." in path:
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        config["quantization"][path] = {"group_size": 64, "bits": 8}
        return config["quantization"][path]

nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
mx.eval(model.parameters())
out.mkdir(parents=True, exist_ok=True)
mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
(out / "config.json").write_text(json.dumps(config, indent=2))
for name in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]:
    if (tok / name).is_file():
        shutil.copy(tok / name, out / name)
print("params", sum(v.size for _, v in tree_flatten(model.parameters())))
