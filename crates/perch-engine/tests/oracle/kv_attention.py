"""mlx_lm's side of the quantized-attention test in tests/kv_quantization.rs (mlx_lm 0.32.2).

    kv_attention.py OUT.safetensors

For 8 and 4 bits (group size 64), feeds seeded random queries, keys and values of SmolLM2's
attention shape (9 query heads, 3 KV heads, head dimension 64) through a QuantizedKVCache in
three steps (7 tokens, then 5, then 1) and mlx_lm's quantized_scaled_dot_product_attention
(causal for more than one query, as mlx_lm's models call it), and writes every input and output
as `{bits}.{step}.{q|k|v|out}`.
"""

import sys

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache


def main():
    mx.random.seed(0)
    arrays = {}
    for bits in [8, 4]:
        cache = QuantizedKVCache(group_size=64, bits=bits)
        for step, length in enumerate([7, 5, 1]):
            q = mx.random.normal((1, 9, length, 64))
            k = mx.random.normal((1, 3, length, 64))
            v = mx.random.normal((1, 3, length, 64))
            keys, values = cache.update_and_fetch(k, v)
            # A copy: the function scales its queries in place (`queries *= scale`).
            out = quantized_scaled_dot_product_attention(
                q + 0, keys, values, scale=64**-0.5, mask="causal" if length > 1 else None,
                group_size=64, bits=bits)
            for name, array in [("q", q), ("k", k), ("v", v), ("out", out)]:
                arrays[f"{bits}.{step}.{name}"] = array
    mx.save_safetensors(sys.argv[1], arrays)


if __name__ == "__main__":
    main()
