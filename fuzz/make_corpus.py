#!/usr/bin/env python3
"""Writes the seed corpus (fuzz/corpus/<target>/): small GGUF, safetensors and prompt-cache files
built here byte by byte, configs and chat templates of the architectures Perch loads, the test
model's own config and template (when scripts/test-inputs.sh has made it), and inputs that
reproduce the bugs the fuzzing found. `python3 fuzz/make_corpus.py` rewrites the same bytes every
time; inputs saved as libFuzzer wrote them (`*-found`) sit beside them and are left alone.
"""

import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    path = os.path.join(ROOT, target, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(path, "wb") as f:
        f.write(data)


def noise(seed, n):
    """Deterministic bytes (a 64-bit LCG), as crates/perch-gguf's import tests use."""
    state = (seed * 6364136223846793005 + 1442695040888963407) % 2**64
    out = bytearray()
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(state >> 56)
    return bytes(out)


# --- GGUF (ggml/docs/gguf.md): little-endian, typed key/values, tensor infos, aligned data.

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 1, 2, 3, 8


def gguf_str(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_value(kind, value):
    if kind == STRING:
        return gguf_str(value)
    if kind == ARRAY:
        item_kind, items = value
        return struct.pack("<IQ", item_kind, len(items)) + b"".join(
            gguf_value(item_kind, v) for v in items)
    return struct.pack(SCALAR[kind], value)


def gguf(kvs, tensors, version=3, alignment=32):
    """kvs: [(key, kind, value)]; tensors: [(name, dims innermost-first, ggml type, bytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs))
    for key, kind, value in kvs:
        out += gguf_str(key) + struct.pack("<I", kind) + gguf_value(kind, value)
    offset, offsets = 0, []
    for name, dims, ggml_type, data in tensors:
        out += gguf_str(name) + struct.pack("<I", len(dims))
        out += b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
        offsets.append(offset)
        offset = -(-(offset + len(data)) // alignment) * alignment
    start = -(-len(out) // alignment) * alignment
    out = out.ljust(start, b"\0")
    for (_, _, _, data), at in zip(tensors, offsets):
        out = out.ljust(start + at, b"\0") + data
    return out


def f16(x):
    return struct.pack("<e", x)


def q8_0(rows, cols, seed):
    codes = noise(seed, rows * cols)
    return b"".join(f16(0.01) + codes[i:i + 32] for i in range(0, rows * cols, 32))


def q4_0(rows, cols, seed):
    codes = noise(seed, rows * cols // 2)
    return b"".join(f16(0.02) + codes[i:i + 16] for i in range(0, rows * cols // 2, 16))


def q4_1(rows, cols, seed):
    codes = noise(seed, rows * cols // 2)
    return b"".join(f16(0.02) + f16(-0.25) + codes[i:i + 16]
                    for i in range(0, rows * cols // 2, 16))


def f16_matrix(rows, cols):
    return b"".join(f16((r % 7) / 64) for r in range(rows) for _ in range(cols))


def ones_f32(n):
    return struct.pack("<%df" % n, *([1.0] * n))


def tiny_llama_gguf(**overrides):
    """A one-layer llama (hidden 32, one head, vocabulary of 4) that `perch import` converts;
    `overrides` replace (or add) metadata values: {"llama.block_count": (U32, 2)}."""
    h, inter, vocab = 32, 32, 4
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.name", STRING, "fuzz seed"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U32, 128),
        ("llama.embedding_length", U32, h),
        ("llama.feed_forward_length", U32, inter),
        ("llama.attention.head_count", U32, 1),
        ("llama.attention.head_count_kv", U32, 1),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "gpt2"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<|endoftext|>", "a", "b", "ab"])),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [3, 1, 1, 1])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"])),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 0),
        ("tokenizer.chat_template", STRING,
         "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"),
    ]
    tensors = [
        ("token_embd.weight", [h, vocab], GGML_Q8_0, q8_0(vocab, h, 1)),
        ("output_norm.weight", [h], GGML_F32, ones_f32(h)),
        ("blk.0.attn_norm.weight", [h], GGML_F32, ones_f32(h)),
        ("blk.0.ffn_norm.weight", [h], GGML_F32, ones_f32(h)),
        ("blk.0.attn_q.weight", [h, h], GGML_Q4_0, q4_0(h, h, 2)),
        ("blk.0.attn_k.weight", [h, h], GGML_F16, f16_matrix(h, h)),
        ("blk.0.attn_v.weight", [h, h], GGML_Q4_1, q4_1(h, h, 3)),
        ("blk.0.attn_output.weight", [h, h], GGML_Q4_0, q4_0(h, h, 4)),
        ("blk.0.ffn_gate.weight", [h, inter], GGML_Q4_0, q4_0(inter, h, 5)),
        ("blk.0.ffn_up.weight", [h, inter], GGML_Q4_0, q4_0(inter, h, 6)),
        ("blk.0.ffn_down.weight", [inter, h], GGML_Q4_0, q4_0(h, inter, 7)),
    ]
    kvs = [(k, kind, v) for k, kind, v in kvs if k not in overrides]
    kvs += [(k, kind, v) for k, (kind, v) in overrides.items()]
    return gguf(kvs, tensors)


def gguf_seeds():
    put("gguf", "tiny-llama.gguf", tiny_llama_gguf())
    # Bugs fixed in crates/perch-gguf/src/llama.rs. Found by the fuzzer: every required tensor name
    # of 2^32 - 1 layers built before the first lookup (out of memory).
    put("gguf", "oom-block-count.gguf", tiny_llama_gguf(**{"llama.block_count": (U32, 2**32 - 1)}))
    # heads x head_dim overflowing u64 (a panic where overflow checks are on).
    put("gguf", "overflow-heads.gguf", tiny_llama_gguf(**{
        "llama.attention.head_count": (U64, 2**33), "llama.attention.head_count_kv": (U64, 2**33),
        "llama.attention.key_length": (U64, 2**33)}))
    # Every value type, nested arrays, and one tensor of each size class.
    kvs = [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U64, 64),
        ("k.u8", U8, 7), ("k.i8", I8, -7), ("k.u16", U16, 700), ("k.i16", I16, -700),
        ("k.i32", I32, -70000), ("k.f64", F64, 0.5), ("k.i64", I64, -1), ("k.bool", BOOL, True),
        ("k.nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["x"])])),
    ]
    tensors = [
        ("w", [4], GGML_F32, ones_f32(4)),
        ("q", [32, 2], GGML_Q4_1, q4_1(2, 32, 9)),
        ("odd", [3], 200, b"\0" * 12),
    ]
    put("gguf", "all-value-types.gguf", gguf(kvs, tensors, alignment=64))
    put("gguf", "header-only-v2.gguf", gguf([("general.architecture", STRING, "llama")], [],
                                            version=2))


# --- safetensors: u64 header length, JSON header, tensor bytes in offset order.

def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)]."""
    header, offset = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def safetensors_seeds():
    put("safetensors_header", "empty.safetensors", safetensors([]))
    put("safetensors_header", "one-f32.safetensors",
        safetensors([("model.norm.weight", "F32", [2, 2], ones_f32(4))], {"format": "mlx"}))
    put("safetensors_header", "dtypes.safetensors", safetensors([
        ("a", "F16", [3], f16(1.0) * 3),
        ("b", "BF16", [2, 1], b"\x80\x3f" * 2),
        ("c", "I64", [], struct.pack("<q", 5)),
        ("d", "U8", [0], b""),
        ("e", "BOOL", [2], b"\x01\x00"),
        ("f", "U32", [1, 2], struct.pack("<II", 1, 2)),
    ]))
    # What the safetensors format allows and MLX does not hold: no elements but dimensions past
    # MLX's int32 shapes, dtypes MLX lacks.
    put("safetensors_header", "edge-cases.safetensors", safetensors([
        ("empty_but_huge", "F32", [0, 3000000000, 2**40], b""),
        ("f8", "F8_E4M3", [2], b"\x01\x02"),
        ("u64", "U64", [1], struct.pack("<Q", 2**64 - 1)),
        ("c64", "C64", [1], struct.pack("<ff", 1.0, -1.0)),
    ]))


# --- Prompt caches (mlx_lm's layout; see crates/perch-engine/src/prompt_cache.rs) for the fuzz
# target's model: two layers, one KV head of dimension 4, vocabulary 16, context 64.

def prompt_cache(positions, offset, dtype="F32", tokens=None, model_id="model-a", rotating=None):
    """rotating: (keep, max_size, _idx) for mlx_lm's RotatingKVCache layers, else KVCache."""
    tensors, metadata, scalars = [], {"2.0": ""}, 0
    for layer in range(2):
        for part in (0, 1):
            values = [b / 256 for b in noise(10 * layer + part, positions * 4)]
            data = struct.pack("<%d%s" % (len(values), "f" if dtype == "F32" else "e"), *values)
            tensors.append(("%d.%d" % (layer, part), dtype, [1, 1, positions, 4], data))
        metadata["1.%d" % layer] = "RotatingKVCache" if rotating else "KVCache"
        ints = [offset] + list(rotating or [])
        for k, value in enumerate(ints):
            tensors.append(("%d.%d" % (layer, k + 2), "I32", [], struct.pack("<i", value)))
            scalars += 1
            metadata["2.%d.0" % scalars] = "%d.%d" % (layer, k + 2)
            metadata["2.%d.1" % scalars] = "scalar"
    if tokens is not None:
        metadata.update({"0.perch_model_id": model_id, "0.perch_tokens": json.dumps(tokens),
                         "0.perch_block_size": "16", "0.perch_dtype": dtype.lower()})
    tensors.sort(key=lambda t: t[0])
    return safetensors(tensors, metadata)


def arrays_cache_layer(tensors, metadata, scalars, layer):
    """A linear-attention layer as mlx_lm writes its ArraysCache: conv and ssm states, and two
    None entries (an empty tensor listed as "none"). Returns the scalar count."""
    for part, shape in (("0.0", [1, 3, 12]), ("0.1", [1, 1, 4, 4])):
        count = shape[1] * shape[2] * (shape[3] if len(shape) > 3 else 1)
        values = [b / 256 for b in noise(7 + len(part), count)]
        tensors.append(("%d.%s" % (layer, part), "F32", shape, struct.pack("<%df" % count, *values)))
    for part in (1, 2):
        tensors.append(("%d.%d" % (layer, part), "F32", [0], b""))
        scalars += 1
        metadata["2.%d.0" % scalars] = "%d.%d" % (layer, part)
        metadata["2.%d.1" % scalars] = "none"
    metadata["1.%d" % layer] = "ArraysCache"
    return scalars


def hybrid_prompt_cache():
    """Layer 0 a KVCache of 3 positions, layer 1 an ArraysCache (the fuzz model's layer 1 is
    attention, so this is refused after parsing; mutations reach the ArraysCache branch)."""
    tensors, metadata = [], {"2.0": "", "1.0": "KVCache", "2.1.0": "0.2", "2.1.1": "scalar"}
    for part in (0, 1):
        values = [b / 256 for b in noise(part, 12)]
        tensors.append(("0.%d" % part, "F32", [1, 1, 3, 4], struct.pack("<12f", *values)))
    tensors.append(("0.2", "I32", [], struct.pack("<i", 3)))
    arrays_cache_layer(tensors, metadata, 1, 1)
    tensors.sort(key=lambda t: t[0])
    return safetensors(tensors, metadata)


def prompt_cache_seeds():
    put("prompt_cache", "perch.safetensors", prompt_cache(3, 2, tokens=[1, 2]))
    put("prompt_cache", "mlx-lm.safetensors", prompt_cache(4, 4, dtype="F16"))
    put("prompt_cache", "empty.safetensors", prompt_cache(0, 0, tokens=[]))
    # mlx_lm's RotatingKVCache: nothing dropped (in order), and a wrapped ring keeping 2.
    put("prompt_cache", "rotating.safetensors", prompt_cache(6, 5, rotating=(0, 8, 5)))
    put("prompt_cache", "rotating-wrapped.safetensors", prompt_cache(4, 9, rotating=(2, 4, 3)))
    # mlx_lm's ArraysCache (hybrid models' linear-attention layers).
    put("prompt_cache", "arrays.safetensors", hybrid_prompt_cache())


# --- config.json of each architecture (as published on the Hub, trimmed).

CONFIGS = {
    "qwen2.json": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "vocab_size": 151936, "quantization": {"group_size": 64, "bits": 4}},
    "qwen3.json": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 128,
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "tie_word_embeddings": True, "vocab_size": 151936,
        "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                         "model.embed_tokens": {"group_size": 32, "bits": 8}, "lm_head": False}},
    "llama3.json": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256},
    "mistral.json": {
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "attention_bias": False,
        "tie_word_embeddings": False, "vocab_size": 32768,
        "quantization_config": {"group_size": 128, "bits": 8}},
    # Hybrid Gated DeltaNet / gated attention, the text model nested as multimodal checkpoints do.
    "qwen3_5.json": {
        "model_type": "qwen3_5", "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 1024, "num_hidden_layers": 24,
            "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 256, "rms_norm_eps": 1e-06, "vocab_size": 248320,
            "max_position_embeddings": 262144, "full_attention_interval": 4,
            "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}},
        "quantization": {"group_size": 64, "bits": 4}},
    # Sliding-window / global layers; the multimodal layout with most fields left to defaults.
    "gemma3_text.json": {
        "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "head_dim": 256, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
        "vocab_size": 262144, "quantization": {"group_size": 64, "bits": 4}},
    "gemma3.json": {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
        "quantization": {"group_size": 64, "bits": 4}},
    # Fused projections, partial LongRoPE (per-pair factors).
    "phi3.json": {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "partial_rotary_factor": 0.75,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "vocab_size": 200064, "tie_word_embeddings": True,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 8 for i in range(48)],
                         "short_factor": [1.0] * 48},
        "quantization": {"group_size": 64, "bits": 4}},
    # Qwen3.5's hybrid layers with experts and a shared expert.
    "qwen3_5_moe.json": {
        "model_type": "qwen3_5_moe",
        "text_config": {"hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                        "rms_norm_eps": 1e-06, "vocab_size": 248320, "max_position_embeddings": 262144,
                        "linear_num_value_heads": 32, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                            "partial_rotary_factor": 0.25}},
        "quantization": {"group_size": 64, "bits": 4,
                         "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}},
    # Mixture of experts: expert counts, top-k, which layers are sparse.
    "qwen3_moe.json": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "num_attention_heads": 32, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "vocab_size": 151936,
        "quantization": {"group_size": 64, "bits": 4,
                         "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}},
    # Output norms, query / key norms across heads.
    "olmo2.json": {
        "model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_theta": 500000,
        "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": False,
        "vocab_size": 100352, "quantization": {"group_size": 64, "bits": 4}},
    # YaRN and Llama 4 query scaling in rope_parameters; sliding layers listed by type.
    "ministral3.json": {
        "model_type": "ministral3", "hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 4,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-05,
        "vocab_size": 131072, "max_position_embeddings": 262144, "sliding_window": 4096,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
    # The multimodal layout with a Llama text model (Mistral Small 3.1).
    "mistral3.json": {
        "model_type": "mistral3",
        "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "rms_norm_eps": 1e-05, "vocab_size": 131072, "rope_theta": 1e9,
                        "max_position_embeddings": 131072},
        "vision_config": {"model_type": "pixtral"},
        "quantization": {"group_size": 64, "bits": 4}},
    # Gemma 4 E2B's text model (KV-shared layers, per-layer inputs, proportional RoPE), nested.
    "gemma4.json": {
        "model_type": "gemma4",
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
            "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256, "vocab_size": 262144,
            "vocab_size_per_layer_input": 262144, "sliding_window": 512, "use_double_wide_mlp": True,
            "final_logit_softcapping": 30.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
            "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
            "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                   "rope_type": "proportional"},
                                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}},
        "vision_config": {"model_type": "gemma4_vision"},
        "quantization": {"group_size": 64, "bits": 4}},
    # gpt-oss-20b as mlx-community converts it (MXFP4-Q8: mxfp4 experts, 8-bit affine by path).
    "gpt_oss.json": {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "experts_per_token": 4, "vocab_size": 201088, "sliding_window": 128,
        "rope_theta": 150000, "max_position_embeddings": 131072, "swiglu_limit": 7.0,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4",
                         "model.embed_tokens": {"group_size": 64, "bits": 8},
                         "model.layers.0.mlp.router": {"group_size": 64, "bits": 8}}},
    # Gemma 4 26B-A4B's text model: experts beside the MLP, values from the key projection.
    "gemma4_text.json": {
        "model_type": "gemma4_text", "hidden_size": 2816, "num_hidden_layers": 30, "intermediate_size": 2112,
        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
        "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True, "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "sliding_window": 1024, "max_position_embeddings": 262144,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
        "quantization": {"group_size": 64, "bits": 4,
                         "model.layers.0.router.proj": {"group_size": 64, "bits": 8}}},
}

# --- Chat templates: the source, a NUL byte, then the messages as JSON.

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
]

TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- "# Tools\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool_response>') %}
        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson(indent=2) if tool_call.arguments is mapping else tool_call.arguments }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content | indent(2) + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content|trim + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: " + date_string + "\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) and message['role'] != 'tool' %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

MACRO_TEMPLATE = """{% macro render(m, depth=0) %}[{{ m.role | upper }}{{ '+' * depth }}]{{ m.content | replace('\\n', ' ') | truncate(40) }}{% endmacro %}
{% for batch in messages | batch(2) %}{% for m in batch %}{{ render(m, loop.index) }}{{ loop.cycle(',', ';') }}{% endfor %}{% endfor %}
{{ messages | map(attribute='role') | join('|') }} {{ messages | selectattr('role', 'equalto', 'user') | list | length }}
{{ "{:>8}|{}".format('x', 3) }} {{ (messages | first).content[:5] }} {{ range(3) | list | tojson }} {{ {'a': [1, 2.5, none, true]} | tojson }}
{% filter upper %}{{ eos_token }}{% endfilter %}{% if add_generation_prompt %}<bot>{% endif %}"""


def chat_template_seeds(smollm2_template):
    convo = json.dumps(CONVERSATION).encode()
    simple = json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                         {"role": "user", "content": "Why is the sky blue?"}]).encode()
    put("chat_template", "smollm2", smollm2_template.encode() + b"\0" + simple)
    put("chat_template", "tools", TOOLS_TEMPLATE.encode() + b"\0" + convo)
    put("chat_template", "llama3", LLAMA3_TEMPLATE.encode() + b"\0" + simple)
    put("chat_template", "macros", MACRO_TEMPLATE.encode() + b"\0" + simple)
    # Crashes fixed in crates/perch-engine/src/chat_template.rs: room for 10^12 lists or items
    # (an allocation failure: an abort), padding to a width of 10^11, a precision over 65535 (a
    # panic in minijinja).
    for name, source in [
        ("abort-slice", "{{ messages | slice(10**12) }}"),
        ("abort-batch", "{{ messages | batch(10**12, 0) }}"),
        ("oom-format-width", "{{ '{:>99999999999}|%s'.format(1) }}{{ '%099999999999d' | format(1) }}"),
        ("panic-format-precision", "{{ '{:.70000f}'.format(1.5) }}{{ '%.70000f' | format(1.5) }}"),
        # A non-ASCII character in a key (minijinja panics; panic-format-key-found is the
        # fuzzer's input).
        ("panic-format-key", "{{ '{0[\u00e9]}'.format({'\u00e9': 1}) }}{{ '%(\u00e9)s' | format({'\u00e9': 1}) }}"),
    ]:
        put("chat_template", name, source)
    # The hostile templates chat_template.rs's tests check are errors.
    for i, source in enumerate([
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ strftime_now('%') }}{{ messages | tojson(indent=10**12) }}",
        "{{ 'a\\nb' | indent(width=10**12) }}",
    ]):
        put("chat_template", "hostile-%d" % i, source)


def main():
    gguf_seeds()
    safetensors_seeds()
    prompt_cache_seeds()
    for name, config in CONFIGS.items():
        put("config", name, json.dumps(config, indent=2) + "\n")
    # The test model's own config and template (scripts/test-inputs.sh makes it), when present.
    model = os.path.join(os.path.dirname(ROOT), "..", "target", "test-inputs",
                         "SmolLM2-135M-Instruct-Q4_1-mlx")
    if os.path.isdir(model):
        with open(os.path.join(model, "config.json"), "rb") as f:
            put("config", "smollm2.json", f.read())
        with open(os.path.join(model, "chat_template.jinja")) as f:
            chat_template_seeds(f.read())
    else:
        chat_template_seeds("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


if __name__ == "__main__":
    main()
