"""Measures the two decisions of the batch engine's design on this machine, with MLX 0.32.2 on
OpenBLAS (as Perch's build links it):

1. how attention should read the block pool: SDPA over a contiguous per-batch KV buffer, versus
   gathering each sequence's blocks from the pool on every decode step;
2. whether batched projections should run as MLX affine 4-bit `quantized_matmul` or as dense
   float32 GEMMs on the CPU.

    python3 scripts/bench_kv_read_path.py

It installs `mlx==0.32.2` + `mlx-cpu==0.32.2` into a temporary directory, points the wheel's BLAS at
Debian's OpenBLAS (as crates/mlx-sys/build.rs does), and re-runs itself there. Shapes are those of
SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, hidden 576, MLP 1536, 30 layers).
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def relaunch_with_openblas():
    target = Path(tempfile.mkdtemp(prefix="perch-mlx-openblas-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                    "mlx==0.32.2", "mlx-cpu==0.32.2"], check=True)
    blas = next((target / "mlx_cpu.libs").glob("libblas-*"))
    blas.rename(blas.with_name(blas.name + ".reference"))
    blas.symlink_to(OPENBLAS)
    env = dict(os.environ, PYTHONPATH=str(target), PERCH_BENCH_CHILD="1")
    sys.exit(subprocess.run([sys.executable, __file__], env=env).returncode)


def main():
    import mlx.core as mx

    def ms(f, n=10):
        mx.eval(f())
        mx.eval(f())
        start = time.perf_counter()
        for _ in range(n):
            mx.eval(f())
        return (time.perf_counter() - start) / n * 1e3

    print("1. projections, 576 -> 1536 (ms per call)")
    print(f"{'batch':>6}{'4-bit qmm':>12}{'f32 GEMM':>12}{'ratio':>8}")
    w = mx.random.normal((1536, 576))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    dense = mx.dequantize(wq, scales, biases, group_size=64, bits=4)
    for m in [1, 8, 32, 128]:
        x = mx.random.normal((m, 576))
        q = ms(lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True))
        d = ms(lambda: x @ dense.T)
        print(f"{m:>6}{q:>12.2f}{d:>12.2f}{q / d:>8.1f}")

    batch, heads, kv_heads, context, head_dim, block = 32, 9, 3, 1024, 64, 16
    print(f"\n2. attention of one decode step, one layer: {batch} sequences x {context} tokens, block {block} (ms)")
    q = mx.random.normal((batch, heads, 1, head_dim))
    k = mx.random.normal((batch, kv_heads, context, head_dim))
    v = mx.random.normal((batch, kv_heads, context, head_dim))
    contiguous = ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
    num_blocks = batch * context // block
    pool_k = mx.random.normal((num_blocks, kv_heads, block, head_dim))
    pool_v = mx.random.normal((num_blocks, kv_heads, block, head_dim))
    table = mx.random.permutation(num_blocks).reshape(batch, context // block)

    def view(pool):
        return pool[table].transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, context, head_dim)

    gathered = ms(lambda: mx.fast.scaled_dot_product_attention(q, view(pool_k), view(pool_v), scale=0.125))
    print(f"contiguous per-batch buffer: {contiguous:.1f}")
    print(f"gather blocks every step:    {gathered:.1f}  (x{gathered / contiguous:.1f};"
          f" +{30 * (gathered - contiguous):.0f} ms per step over 30 layers)")


if __name__ == "__main__":
    if os.environ.get("PERCH_BENCH_CHILD") != "1":
        relaunch_with_openblas()
    main()
