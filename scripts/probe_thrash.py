"""Does MLX 0.32's CUDA backend throw once a process has missed its cuDNN attention plan cache (256 entries) 512
times? Runs MLX's fused attention (head size 128, bfloat16, an additive mask: cuDNN's path) over N distinct query
lengths and prints how far it got. Run on a CUDA machine, with and without MLX_ENABLE_CACHE_THRASHING_CHECK=0:

    python scripts/probe_thrash.py 600
    MLX_ENABLE_CACHE_THRASHING_CHECK=0 python scripts/probe_thrash.py 600

2026-11-26, H200: "failed after 512 shapes: Cache thrashing is happening ..." with the check, 600 without. Perch's
binaries turn the check off (perch_engine::device::prepare_mlx_environment)."""
import os, sys
import mlx.core as mx
n = int(sys.argv[1])
done = 0
try:
    for q in range(2, 2 + n):
        qs = mx.random.normal((1, 8, q, 128)).astype(mx.bfloat16)
        ks = mx.random.normal((1, 8, 640, 128)).astype(mx.bfloat16)
        mask = mx.zeros((1, 1, q, 640), dtype=mx.bfloat16)
        out = mx.fast.scaled_dot_product_attention(qs, ks, ks, scale=0.1, mask=mask)
        mx.eval(out)
        done += 1
    print(f"check={os.environ.get('MLX_ENABLE_CACHE_THRASHING_CHECK', 'default')}: {done} shapes, no error")
except Exception as e:
    print(f"check={os.environ.get('MLX_ENABLE_CACHE_THRASHING_CHECK', 'default')}: failed after {done} shapes: {e}")
