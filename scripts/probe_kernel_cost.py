"""Host time MLX's CUDA backend spends per kernel of a compiled, pipelined step (GPU probe, CUDA only).

A step is a chain of N kernels on one row of 2,048 bfloat16 values (nothing a device would wait on):
MLX's `rms_norm`, a dense 2,048 x 2,048 matmul, or a custom kernel (`mx.fast.cuda_kernel`, a copy),
compiled with `mx.compile` and dispatched with `async_eval` before the previous step is waited for, as
Perch's decode steps are. Prints one JSON line per (kind, N): milliseconds a step and microseconds a kernel; then
the 100-kernel chains again with 0 to 1.5 ms of host time spent before each dispatch (a host-bound step grows
by all of it, a device-bound one absorbs it up to the device's slack).

    python scripts/probe_kernel_cost.py
"""
import json
import time

import mlx.core as mx

x0 = mx.random.normal((1, 2048)).astype(mx.bfloat16)
w = mx.ones((2048,), dtype=mx.bfloat16)
m = (mx.random.normal((2048, 2048)) * 0.02).astype(mx.bfloat16)
COPY = mx.fast.cuda_kernel(name="probe_copy", input_names=["a"], output_names=["b"], source="""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a_shape[1]) { b[i] = a[i]; }
""")


def chain(kind, n):
    def f(x):
        for _ in range(n):
            if kind == "rms_norm":
                x = mx.fast.rms_norm(x, w, 1e-5)
            elif kind == "matmul":
                x = x @ m
            else:
                x = COPY(inputs=[x], template=[], grid=(2048, 1, 1), threadgroup=(256, 1, 1),
                         output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
        return x
    return mx.compile(f)


def timed(f, steps=200, delay_ms=0.0):
    x = x0
    pending = None
    t = []
    for s in range(steps):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < delay_ms / 1e3:
            pass
        y = f(x)
        mx.async_eval(y)
        if pending is not None:
            mx.eval(pending)
        pending = y
        t.append(time.perf_counter() - t0)
    mx.eval(pending)
    t = t[20:]
    return 1e3 * sum(t) / len(t)


for rnd in range(2):
    for kind in ("rms_norm", "matmul", "custom"):
        for n in (50, 100, 200):
            ms = timed(chain(kind, n))
            print(json.dumps({"round": rnd, "kind": kind, "kernels": n, "step_ms": round(ms, 3),
                              "us_per_kernel": round(1e3 * ms / n, 2)}), flush=True)

# Host time added before each dispatch: a host-bound step grows by all of it, a device-bound one
# absorbs it up to the device's slack.
for kind in ("rms_norm", "matmul", "custom"):
    f = chain(kind, 100)
    for delay in (0.0, 0.5, 1.0, 1.5):
        ms = timed(f, delay_ms=delay)
        print(json.dumps({"kind": kind, "kernels": 100, "host_delay_ms": delay, "step_ms": round(ms, 3)}), flush=True)
