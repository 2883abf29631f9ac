"""Writes a tiny random Gemma 3 vision-language model with Python mlx-vlm 0.7.6, plus what mlx-vlm
computes on it, for `tests/vision_parity.rs`.

Usage: python tiny_vision.py OUT_DIR TOKENIZER_DIR
OUT_DIR/gemma3/ holds the model directory (config.json, model.safetensors as mlx-vlm saves them; the
tokenizer of TOKENIZER_DIR with Gemma 3's three image tokens added after its vocabulary, their names
in tokenizer_config.json, a Gemma-3-style chat template that writes an image part as
`<start_of_image>`, and preprocessor_config.json for 32-pixel images);
beside it, gemma3-inputs.safetensors (`pixel_values` [images, channels, height, width] float32, as the
processor hands them to the model) and gemma3-expected.safetensors (`image_features` [images, tokens,
text hidden]: the vision tower and projector's output,
`Model.multi_modal_projector(Model.vision_tower(...))`), and gemma3-prompts.json: for prompts with one and
with two images (`prompt_ids`, the images by index into `pixel_values`), the log-softmax of the last
position's logits and 8 greedy ids, as mlx-vlm's model computes them (`get_input_embeddings`, then the
language model over its prompt cache). Also gemma3-image.png (48 × 40 random RGB pixels) and
gemma3-image-pixels.safetensors: transformers' Gemma3ImageProcessor (its PIL backend) on it.
"""

import json
import sys
from pathlib import Path

from PIL import Image

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
import numpy as np

from vision_oracle import build, write_tokenizer

GEMMA3 = {
    "model_type": "gemma3",
    "hidden_size": 64,
    "image_token_index": 49153, "vocab_size": 49155,
    "mm_tokens_per_image": 16,
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49155,
        "sliding_window": 8, "sliding_window_pattern": 2, "mm_tokens_per_image": 16,
    },
    # SigLIP: 32x32 images in 4x4 patches (64 patches), pooled to 4x4 = 16 image tokens.
    "vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 2,
        "intermediate_size": 48, "num_attention_heads": 2, "patch_size": 4, "image_size": 32,
        "layer_norm_eps": 1e-6,
    },
}


# The test tokenizer's vocabulary ends at 49,151: Gemma 3's image tokens come after it.
IMAGE_TOKENS = {"<start_of_image>": 49152, "<image_soft_token>": 49153, "<end_of_image>": 49154}

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def write_processor_files(out, tokenizer_dir):
    write_tokenizer(out, tokenizer_dir, IMAGE_TOKENS,
                    {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                     "eoi_token": "<end_of_image>", "chat_template": TEMPLATE})
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "size": {"height": 32, "width": 32},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False}))


def main():
    out = Path(sys.argv[1]) / "gemma3"
    out.mkdir(parents=True, exist_ok=True)
    write_processor_files(out, Path(sys.argv[2]))
    model = build(GEMMA3)
    (out / "config.json").write_text(json.dumps(GEMMA3, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    mx.random.seed(11)
    pixel_values = mx.random.uniform(-1.0, 1.0, (2, 3, 32, 32)).astype(mx.float32)
    hidden, _, _ = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
    features = model.multi_modal_projector(hidden)
    mx.save_safetensors(str(out.parent / "gemma3-inputs.safetensors"), {"pixel_values": pixel_values})
    mx.save_safetensors(str(out.parent / "gemma3-expected.safetensors"), {"image_features": features})

    image = [GEMMA3["image_token_index"]] * GEMMA3["mm_tokens_per_image"]
    prompts = [
        ([2, 10, 11, 12] + image + [20, 21, 22], [0]),
        ([2, 30] + image + [31, 32] + image + [33, 34, 35], [1, 0]),
    ]
    cases = []
    for ids, images in prompts:
        ids_array = mx.array([ids])
        pixels = pixel_values[mx.array(images)]
        embeds = model.get_input_embeddings(ids_array, pixels, mask=mx.ones(ids_array.shape)).inputs_embeds
        cache = model.language_model.make_cache()
        logits = model.language_model(ids_array, inputs_embeds=embeds, cache=cache).logits[0, -1]
        logprobs = logits - mx.logsumexp(logits)
        greedy = []
        token = int(mx.argmax(logits))
        for _ in range(8):
            greedy.append(token)
            logits = model.language_model(mx.array([[token]]), cache=cache).logits[0, -1]
            token = int(mx.argmax(logits))
        cases.append({"prompt_ids": ids, "images": images,
                      "logprobs": np.array(logprobs.astype(mx.float32)).tolist(), "greedy_ids": greedy})
    (out.parent / "gemma3-prompts.json").write_text(json.dumps(cases))

    from transformers import Gemma3ImageProcessorPil
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(out.parent / "gemma3-image.png")
    processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=False)
    pixels = processor(images=[Image.open(out.parent / "gemma3-image.png")], return_tensors="np")["pixel_values"]
    mx.save_safetensors(str(out.parent / "gemma3-image-pixels.safetensors"), {"pixel_values": mx.array(pixels)})


if __name__ == "__main__":
    main()
