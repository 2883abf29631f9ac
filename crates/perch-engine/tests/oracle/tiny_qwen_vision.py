"""Writes a tiny random Qwen3.5 vision-language model with Python mlx-vlm 0.7.6, plus what its vision
tower computes, for `tests/vision_parity.rs`.

Usage: python tiny_qwen_vision.py OUT_DIR [TOKENIZER_DIR]
OUT_DIR/qwen3_5/ holds the model directory (config.json and model.safetensors as mlx-vlm saves a
`qwen3_5` checkpoint: `language_model.*` and `vision_tower.*`, float32); beside it,
qwen3_5-image-{0,1,2}.png (random RGB images of 64 × 96, 64 × 64 and 128 × 64 pixels, height ×
width: sides that are multiples of the processor's 32-pixel factor and areas within its pixel bounds,
so its resize keeps them) and
qwen3_5-expected.safetensors: for each image i, `pixels_i` (mlx-vlm's processor's normalized values,
`[height, width, 3]` channels last), `grid_i` (`[t, h, w]` patches) and `features_i` (`[tokens, text
hidden]`: `Model.vision_tower(pixel_values, image_grid_thw)` of that image alone), and `features_all`:
the three images through the tower in one call. And qwen3_5-positions.json: for prompts holding
those images (`prompt_ids`, `images` by index), the language model's multimodal RoPE positions
(`positions` `[3][tokens]`, `get_rope_index`), the delta later positions take (`delta`), the log-softmax
of the last position's logits (`logprobs`) and 8 greedy ids (`greedy_ids`) as mlx-vlm's model computes
them (`get_input_embeddings`, then the language model with those positions over its prompt cache, then
decode steps). With TOKENIZER_DIR, the model directory gets that tokenizer with Qwen's four vision
tokens added after its vocabulary and a ChatML template that writes an image part as Qwen's does, and
beside it qwen3_5_moe/ (the mixture-of-experts variant: 4 experts, 2 a token, a shared expert; a tower
of the same shape) with qwen3_5_moe-prompts.json, its log-probabilities and greedy ids for the same prompts. Also
qwen3_5/preprocessor_config.json (mlx-vlm's defaults, written out), qwen3_5-resized-{0,1,2}.png
(50 × 70, 300 × 200 and 20 × 30 pixels) and qwen3_5-resized.safetensors: `resized_i`, mlx-vlm's
processor's values for each (bicubic resize, rescale, normalization) as `[height, width, 3]`.
"""

import json
import sys
from pathlib import Path

from PIL import Image

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

from vision_oracle import build, write_tokenizer as add_tokens

QWEN3_5 = {
    "model_type": "qwen3_5",
    "image_token_id": 49153, "video_token_id": 49154,
    "vision_start_token_id": 49152, "vision_end_token_id": 49155, "vocab_size": 49156,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "vocab_size": 49156, "max_position_embeddings": 4096, "full_attention_interval": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"type": "default", "mrope_section": [4, 2, 2], "rope_theta": 100000,
                            "partial_rotary_factor": 0.5, "mrope_interleaved": True},
    },
    # 16-pixel patches merged 2 × 2 into a token; a 4 × 4 grid of learned position embeddings,
    # interpolated to each image's patch grid.
    "vision_config": {
        "model_type": "qwen3_5", "depth": 2, "hidden_size": 64, "intermediate_size": 96,
        "out_hidden_size": 64, "num_heads": 4, "patch_size": 16, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "in_channels": 3, "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    },
}

QWEN3_5_MOE = json.loads(json.dumps(QWEN3_5))
QWEN3_5_MOE["model_type"] = "qwen3_5_moe"
QWEN3_5_MOE["text_config"].update({
    "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "norm_topk_prob": True})
QWEN3_5_MOE["vision_config"]["model_type"] = "qwen3_5_moe"

SIZES = [(64, 96), (64, 64), (128, 64)]
# Sizes the processor changes: rounded to multiples of 32, scaled down to 288 × 192, scaled up to
# its least area.
RESIZED = [(50, 70), (300, 200), (20, 30)]


def main():
    out = Path(sys.argv[1]) / "qwen3_5"
    out.mkdir(parents=True, exist_ok=True)
    model = build(QWEN3_5)
    (out / "config.json").write_text(json.dumps(QWEN3_5, indent=1))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    processor = Qwen3VLImageProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    rng = np.random.default_rng(5)
    expected, all_values, all_grids = {}, [], []
    for i, (h, w) in enumerate(SIZES):
        path = out.parent / f"qwen3_5-image-{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        image = np.transpose(np.array(Image.open(path).convert("RGB")), (2, 0, 1))
        batch = processor([image])
        values, grid = mx.array(batch["pixel_values"]), mx.array(batch["image_grid_thw"])
        features, _ = model.vision_tower(values, grid)
        normalized = (image.astype(np.float32) * np.float32(1 / 255) - np.float32(0.5)) / np.float32(0.5)
        # The processor kept the size: its values are these, patch by patch.
        assert batch["image_grid_thw"].tolist() == [[1, h // 16, w // 16]]
        patches = np.repeat(normalized[None], 2, axis=0).reshape(2, 3, h // 32, 2, 16, w // 32, 2, 16)
        patches = patches.transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(-1, 3 * 2 * 16 * 16)
        assert np.array_equal(patches, batch["pixel_values"])
        expected[f"pixels_{i}"] = mx.array(np.transpose(normalized, (1, 2, 0)))
        expected[f"grid_{i}"] = grid[0].astype(mx.int32)
        expected[f"features_{i}"] = features
        all_values.append(values)
        all_grids.append(grid)
    features, _ = model.vision_tower(mx.concatenate(all_values), mx.concatenate(all_grids))
    expected["features_all"] = features
    mx.save_safetensors(str(out.parent / "qwen3_5-expected.safetensors"), expected)

    # Images the processor resizes (bicubic, sides to multiples of 32 within its pixel bounds):
    # its values un-patched to [height, width, 3].
    (out / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 56 * 56, "longest_edge": 14 * 14 * 4 * 1280}, "patch_size": 16,
        "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    resized = {}
    for i, (h, w) in enumerate(RESIZED):
        path = out.parent / f"qwen3_5-resized-{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        batch = processor([np.transpose(np.array(Image.open(path).convert("RGB")), (2, 0, 1))])
        _, gh, gw = batch["image_grid_thw"][0].tolist()
        values = batch["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]
        values = values.transpose(0, 2, 5, 1, 3, 6, 4).reshape(gh * 16, gw * 16, 3)
        resized[f"resized_{i}"] = mx.array(values)
    mx.save_safetensors(str(out.parent / "qwen3_5-resized.safetensors"), resized)

    # Multimodal RoPE positions of prompts holding the images (the language model's
    # `get_rope_index`): each image a run of `h · w / 4` image tokens between vision_start and
    # vision_end.
    start, end, pad = (QWEN3_5[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))
    tokens = [int(np.prod(g[0].tolist())) // 4 for g in all_grids]
    run = lambda i: [start] + [pad] * tokens[i] + [end]
    prompts = [([10, 11] + run(0) + [20, 21], [0]), (run(1) + [30] + run(2) + [31, 32], [1, 2]),
               ([40] + run(0), [0])]
    (out.parent / "qwen3_5-positions.json").write_text(json.dumps(
        prompt_cases(model, prompts, all_values, all_grids, positions=True)))
    if len(sys.argv) > 2:
        write_tokenizer(out, Path(sys.argv[2]))
        # The mixture-of-experts variant (Qwen3.5-MoE / Qwen3.6-A3B): a tower of the same shape
        # (its own random weights), the same prompts.
        moe_out = out.parent / "qwen3_5_moe"
        moe_out.mkdir(exist_ok=True)
        moe = build(QWEN3_5_MOE)
        (moe_out / "config.json").write_text(json.dumps(QWEN3_5_MOE, indent=1))
        mx.save_safetensors(str(moe_out / "model.safetensors"), dict(tree_flatten(moe.parameters())),
                            metadata={"format": "mlx"})
        write_tokenizer(moe_out, Path(sys.argv[2]))
        (out.parent / "qwen3_5_moe-prompts.json").write_text(json.dumps(
            prompt_cases(moe, prompts, all_values, all_grids, positions=False)))


def prompt_cases(model, prompts, all_values, all_grids, positions):
    cases = []
    for ids, images in prompts:
        grid = mx.concatenate([all_grids[i] for i in images])
        position_ids, delta = model.language_model.get_rope_index(mx.array([ids]), grid)
        case = {"prompt_ids": ids, "images": images}
        if positions:
            case["positions"] = position_ids[:, 0, :].tolist()
            case["delta"] = int(delta.reshape(-1)[0])
        # The next token's log-probabilities and 8 greedy ids, as mlx-vlm generates: the
        # prompt's embeddings and positions, then decode steps at the cache's offset plus delta.
        ids_array = mx.array([ids])
        values = mx.concatenate([all_values[i] for i in images])
        inputs = model.get_input_embeddings(ids_array, values, image_grid_thw=grid,
                                            mask=mx.ones(ids_array.shape))
        lm = model.language_model
        lm._rope_deltas, lm._position_ids = None, None
        cache = lm.make_cache()
        logits = lm(ids_array, inputs_embeds=inputs.inputs_embeds, cache=cache,
                    position_ids=inputs.position_ids, rope_deltas=inputs.rope_deltas).logits[0, -1]
        case["logprobs"] = np.array((logits - mx.logsumexp(logits)).astype(mx.float32)).tolist()
        greedy = []
        token = int(mx.argmax(logits))
        for _ in range(8):
            greedy.append(token)
            token = int(mx.argmax(lm(mx.array([[token]]), cache=cache).logits[0, -1]))
        case["greedy_ids"] = greedy
        cases.append(case)
    return cases


# The test tokenizer's vocabulary ends at 49,151: Qwen's vision tokens come after it.
VISION_TOKENS = {"<|vision_start|>": 49152, "<|image_pad|>": 49153, "<|video_pad|>": 49154,
                 "<|vision_end|>": 49155}


# ChatML as Qwen writes it, an image part as `<|vision_start|><|image_pad|><|vision_end|>`.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(out, tokenizer_dir):
    add_tokens(out, tokenizer_dir, VISION_TOKENS, {"chat_template": TEMPLATE})


if __name__ == "__main__":
    main()
