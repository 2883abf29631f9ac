# Prompt-chunk attention over a slot cache on MLX's CUDA backend: the fused call with an array mask (cuDNN)
# against the explicit form (matmul, where, precise softmax, matmul): the first call of each shape in a process
# (cuDNN builds a plan per shape), the steady time, and the largest difference. Run where python3 has MLX CUDA.
import time
import mlx.core as mx
H, KV, D = 32, 8, 64
def fused(q, k, v, m): return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
def explicit(q, k, v, m):
    B, _, T, _ = q.shape; R = H // KV; C = k.shape[2]
    qs = (q * mx.array(0.125, q.dtype)).reshape(B, KV, R * T, D)
    s = (qs @ k.transpose(0, 1, 3, 2)).reshape(B, KV, R, T, C)
    s = mx.where(m.reshape(B, 1, 1, T, C), s, mx.array(-3.0e38, s.dtype)).reshape(B, KV, R * T, C)
    w = mx.softmax(s, axis=-1, precise=True)
    return (w @ v).reshape(B, H, T, D)
def t(f):
    t0 = time.perf_counter(); mx.eval(f()); mx.synchronize(); return (time.perf_counter() - t0) * 1e3
for B, T, C in [(8, 128, 256), (1, 128, 256), (3, 112, 256), (8, 512, 1024), (8, 256, 2048), (2, 1024, 1280), (8, 1024, 4096), (1, 2048, 8192)]:
    q = mx.random.normal((B, H, T, D)).astype(mx.bfloat16); k = mx.random.normal((B, KV, C, D)).astype(mx.bfloat16); v = mx.random.normal((B, KV, C, D)).astype(mx.bfloat16)
    m = mx.arange(C).reshape(1, 1, 1, C) <= (mx.arange(T).reshape(1, 1, T, 1) + 17 + mx.arange(B).reshape(B, 1, 1, 1)); mx.eval(q, k, v, m)
    out = [f"B{B} T{T} C{C}:"]
    for name, f in [("fused", fused), ("explicit", explicit)]:
        first = t(lambda: f(q, k, v, m))
        for _ in range(3): t(lambda: f(q, k, v, m))
        t0 = time.perf_counter()
        for _ in range(20): mx.eval(f(q, k, v, m))
        mx.synchronize(); steady = (time.perf_counter() - t0) / 20 * 1e3
        out.append(f"{name} first {first:.1f} ms steady {steady:.3f} ms")
    a = fused(q, k, v, m).astype(mx.float32); b = explicit(q, k, v, m).astype(mx.float32)
    out.append(f"max|diff| {mx.abs(a - b).max().item():.4f}")
    print(" | ".join(out), flush=True)
