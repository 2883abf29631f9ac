"""What MLX's host spends to encode and launch one operation, by kind: chains of N operations of one kind
on decode-sized arrays (32 rows), each built, then `mx.async_eval` timed (MLX encoding the graph and
launching it; the building is Python's and not counted), then waited for. Prints µs an operation, the median
of the repeats. For the GPU runs of docs/benchmarks.md ("Where the engine thread's time goes"):

    python scripts/bench_op_launch.py [--ops 200] [--repeats 15]

MLX_MAX_OPS_PER_BUFFER applies as in Perch (set it as Perch does, 30 outside macOS, for comparable numbers).
"""
import argparse
import statistics
import time

import mlx.core as mx


def chains(n: int):
    rows, hidden = 32, 1024
    x = mx.random.normal((rows, 1, hidden)).astype(mx.bfloat16)
    c = mx.random.normal((hidden,)).astype(mx.bfloat16)
    w = mx.random.normal((hidden, hidden)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    cache = mx.zeros((rows, 4, 256, 128), dtype=mx.bfloat16)
    new = mx.random.normal((rows, 4, 1, 128)).astype(mx.bfloat16)
    at = mx.random.randint(0, 256, (rows, 1, 1, 1)).astype(mx.int32)
    at_full = mx.broadcast_to(at, new.shape)
    norm_w = mx.ones((hidden,), dtype=mx.bfloat16)
    mx.eval(x, c, wq, scales, biases, cache, new, at, at_full, norm_w)
    copy = None
    if hasattr(mx.fast, "cuda_kernel") and mx.default_device() == mx.gpu and getattr(mx, "cuda", None) and mx.cuda.is_available():
        # MLX's CUDA custom kernels take a function body over the named pointers (no sizes given).
        copy = mx.fast.cuda_kernel(
            name="copy", input_names=["a"], output_names=["b"],
            source="const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < N) b[i] = a[i];")

    def add():
        y = x
        for _ in range(n):
            y = y + c
        return y

    def rms_norm():
        y = x
        for _ in range(n):
            y = mx.fast.rms_norm(y, norm_w, 1e-6)
        return y

    def reshape_pairs():
        y = x + c
        for _ in range(n // 2):
            y = y.reshape(rows, hidden).reshape(rows, 1, hidden)
        return y + c

    def quantized_matmul():
        y = x
        for _ in range(n):
            y = mx.quantized_matmul(y, wq, scales, biases, transpose=True, group_size=64, bits=4)
        return y

    def matmul():
        # cuBLASLt on CUDA: MLX captures each call into a child graph.
        y = x
        for _ in range(n):
            y = y @ w
        return y

    def matmul_batched():
        # Attention-shaped: 32 rows × 4 KV heads of [4, 64] @ [64, 256].
        q = x.reshape(rows, 4, 4, 64)
        k = cache[:, :, :, :64].swapaxes(2, 3)
        y = q
        for _ in range(n):
            y = (y @ k)[..., :64]
        return y

    def scatter_broadcast_each():
        y = cache
        for _ in range(n):
            y = mx.put_along_axis(y, mx.broadcast_to(at, new.shape), new, axis=2)
        return y

    def scatter_full_index():
        y = cache
        for _ in range(n):
            y = mx.put_along_axis(y, at_full, new, axis=2)
        return y

    def custom_kernel():
        y = x
        for _ in range(n):
            y = copy(inputs=[y], template=[("N", rows * hidden)], grid=(rows * hidden, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[y.shape], output_dtypes=[y.dtype])[0]
        return y

    kinds = [("add", add), ("rms_norm", rms_norm), ("reshape (2 views)", reshape_pairs),
             ("quantized_matmul 4-bit", quantized_matmul), ("matmul (cuBLASLt)", matmul),
             ("matmul, batched over 128 matrices", matmul_batched), ("put_along_axis, index broadcast each time",
             scatter_broadcast_each), ("put_along_axis, full-shaped index", scatter_full_index)]
    if copy is not None:
        kinds.append(("custom kernel (copy)", custom_kernel))
    return kinds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"device {mx.default_device()}, {args.ops} operations a chain, median of {args.repeats}")
    for name, build in chains(args.ops):
        launch, wait = [], []
        for i in range(args.repeats + 2):
            y = build()
            t0 = time.perf_counter()
            mx.async_eval(y)
            t1 = time.perf_counter()
            mx.eval(y)
            t2 = time.perf_counter()
            if i >= 2:  # the first two compile and allocate
                launch.append(t1 - t0)
                wait.append(t2 - t1)
        per = statistics.median(launch) / args.ops * 1e6
        print(f"{name:45s} launch {per:7.2f} µs an operation   wait {statistics.median(wait) * 1e3:7.3f} ms a chain")


if __name__ == "__main__":
    main()
