"""Writes a tiny random Gemma 4 vision-language model with Python mlx-vlm 0.7.6, plus what mlx-vlm
computes on it, for `tests/vision_parity.rs`.

Usage: python tiny_gemma4_vision.py OUT_DIR TOKENIZER_DIR
OUT_DIR/gemma4/ holds the model directory (config.json and model.safetensors as mlx-vlm saves a
`gemma4` checkpoint: `language_model.*`, `vision_tower.*` and `embed_vision.*`, float32; per-layer
inputs and KV-shared layers in the text model; the tokenizer of TOKENIZER_DIR with Gemma 4's three
image tokens added after its vocabulary, their names in tokenizer_config.json, a Gemma-4-style chat
template that writes an image part as the image token, and processor_config.json: 16-pixel patches
pooled 3 × 3, at most 6 soft tokens an image). Beside it: gemma4-image-{0,1}.png (random RGB images
of 144 × 96 and 48 × 288 pixels, height × width: 54 patches each, the most 6 soft tokens allow, which the processor keeps), gemma4-resized-{0,1}.png
(70 × 50 and 30 × 200 pixels, which it resizes), gemma4-expected.safetensors (`pixels_i` for each
image: the processor's values `[height, width, 3]`; `features_i`: `Model.encode_image` of that image
alone, `[soft tokens, text hidden]`; `resized_i`: the processor's values of each resized image) and
gemma4-prompts.json: for prompts with one and with two images (`prompt_ids`, `images` by index), the
log-softmax of the last position's logits and 8 greedy ids as mlx-vlm's model computes them
(`get_input_embeddings`, then the language model over its prompt cache, then decode steps). And
OUT_DIR/gemma4_both_ways/: the same model whose image tokens attend to each other both ways
(`text_config.use_bidirectional_attention: "vision"`, as the 26B-A4B and 31B have it), with
gemma4_both_ways-prompts.json for the same prompts (the language model given `mm_token_type_ids`,
as mlx-vlm's generation passes them).
"""

import json
import sys
from pathlib import Path

from PIL import Image

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

import vision_oracle
from vision_oracle import write_tokenizer

# The test tokenizer's vocabulary ends at 49,151: Gemma 4's image tokens come after it.
IMAGE_TOKENS = {"<|image>": 49152, "<|image|>": 49153, "<image|>": 49154}
VOCAB = 49155

GEMMA4 = {
    "model_type": "gemma4",
    "image_token_id": 49153, "boi_token_id": 49152, "eoi_token_id": 49154,
    "audio_token_id": 49150, "vocab_size": VOCAB, "vision_soft_tokens_per_image": 6,
    "text_config": {
        "model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
        "rms_norm_eps": 1e-6, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
        "vocab_size": VOCAB, "vocab_size_per_layer_input": VOCAB, "use_double_wide_mlp": True,
        "sliding_window": 8, "final_logit_softcapping": 5.0, "max_position_embeddings": 512,
        # Six layers, the last two reading the caches of earlier ones: the full layers' outputs
        # at image tokens reach the prompt's end through the caches of the layers after them.
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    },
    # 16-pixel patches, a 2-D RoPE over each head's halves, pooled 3 × 3 into a soft token; two
    # query heads sharing a KV head; linear maps clipping their inputs and outputs (E2B / E4B's).
    "vision_config": {
        "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "use_clipped_linears": True,
        "patch_size": 16, "position_embedding_size": 64, "pooling_kernel_size": 3,
        "default_output_length": 6, "rms_norm_eps": 1e-6, "standardize": True,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    },
}

SIZES = [(144, 96), (48, 288)]
RESIZED = [(70, 50), (30, 200)]
MAX_SOFT_TOKENS = 6

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<turn|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)


def build(config):
    model = vision_oracle.build(config)
    # Clipping bounds that bind: inputs to [-1, 1], outputs to [-1.5, 1.5].
    bounds = {"input_min": -1.0, "input_max": 1.0, "output_min": -1.5, "output_max": 1.5}
    for name, module in model.vision_tower.named_modules():
        if hasattr(module, "input_min"):
            for key, value in bounds.items():
                setattr(module, key, mx.array(value))
    mx.eval(model.parameters())
    return model


def write_processor_files(out, tokenizer_dir):
    write_tokenizer(out, tokenizer_dir, IMAGE_TOKENS,
                    {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
                     "chat_template": TEMPLATE})
    (out / "processor_config.json").write_text(json.dumps({
        "image_seq_length": MAX_SOFT_TOKENS,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "do_resize": True,
                            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
                            "patch_size": 16, "pooling_kernel_size": 3,
                            "max_soft_tokens": MAX_SOFT_TOKENS, "resample": 3}}))


def main():
    out = Path(sys.argv[1]) / "gemma4"
    out.mkdir(parents=True, exist_ok=True)
    write_processor_files(out, Path(sys.argv[2]))
    model = build(GEMMA4)
    (out / "config.json").write_text(json.dumps(GEMMA4, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    processor = Gemma4ImageProcessor(patch_size=16, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=3)
    rng = np.random.default_rng(5)
    expected, pixel_values, soft_tokens = {}, [], []
    for i, (h, w) in enumerate(SIZES):
        path = out.parent / f"gemma4-image-{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        data, tokens = processor([Image.open(path).convert("RGB")])
        values = np.asarray(data["pixel_values"], dtype=np.float32)  # [1, 3, h, w], sizes kept
        assert values.shape == (1, 3, h, w), values.shape
        pixel_values.append(mx.array(values))
        soft_tokens.append(tokens[0])
        expected[f"pixels_{i}"] = mx.array(values[0].transpose(1, 2, 0))
        expected[f"features_{i}"] = model.encode_image(mx.array(values))[0]
        assert expected[f"features_{i}"].shape[0] == tokens[0]
    for i, (h, w) in enumerate(RESIZED):
        path = out.parent / f"gemma4-resized-{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        data, _ = processor([Image.open(path).convert("RGB")])
        expected[f"resized_{i}"] = mx.array(np.asarray(data["pixel_values"], dtype=np.float32)[0].transpose(1, 2, 0))
    mx.save_safetensors(str(out.parent / "gemma4-expected.safetensors"), expected)

    boi, image, eoi = IMAGE_TOKENS.values()
    run = lambda i: [boi] + [image] * soft_tokens[i] + [eoi]
    prompts = [([2, 10, 11] + run(0) + [20, 21, 22], [0]),
               ([2, 30] + run(1) + [31, 32] + run(0) + [33, 34, 35], [1, 0])]
    (out.parent / "gemma4-prompts.json").write_text(json.dumps(prompt_cases(model, prompts, pixel_values)))

    # The same weights, image tokens attending both ways.
    both = json.loads(json.dumps(GEMMA4))
    both["text_config"]["use_bidirectional_attention"] = "vision"
    both_out = out.parent / "gemma4_both_ways"
    both_out.mkdir(exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (both_out / name).write_bytes((out / name).read_bytes())
    (both_out / "config.json").write_text(json.dumps(both, indent=1))
    both_model = build(both)
    (out.parent / "gemma4_both_ways-prompts.json").write_text(
        json.dumps(prompt_cases(both_model, prompts, pixel_values, types=True)))


def prompt_cases(model, prompts, pixel_values, types=False):
    cases = []
    for ids, images in prompts:
        ids_array = mx.array([ids])
        pixels = [pixel_values[i][0] for i in images]
        inputs = model.get_input_embeddings(ids_array, pixels)
        lm = model.language_model
        cache = lm.make_cache()
        extra = {"mm_token_type_ids": (ids_array == IMAGE_TOKENS["<|image|>"]).astype(mx.int32)} if types else {}
        logits = lm(ids_array, inputs_embeds=inputs.inputs_embeds, per_layer_inputs=inputs.per_layer_inputs,
                    cache=cache, **extra).logits[0, -1]
        logprobs = logits - mx.logsumexp(logits)
        greedy = []
        token = int(mx.argmax(logits))
        for _ in range(8):
            greedy.append(token)
            token = int(mx.argmax(lm(mx.array([[token]]), cache=cache).logits[0, -1]))
        cases.append({"prompt_ids": ids, "images": images,
                      "logprobs": np.array(logprobs.astype(mx.float32)).tolist(), "greedy_ids": greedy})
    return cases


if __name__ == "__main__":
    main()
