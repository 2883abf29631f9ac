"""How much of a host-bound decode step do fewer kernels a layer save? (GPU probe, CUDA only.)

The single-stream question of issue 11: a decode step of one row on MLX's CUDA backend costs the host about
10 µs per kernel it encodes, so the step time follows the number of kernels a layer launches. This probe runs
the decode step `scripts/probe_compiled_step.py` describes (the model `scripts/bench_gpu.py` makes, weights
dequantized to bfloat16, fused q/k/v and gate/up projections, slot caches of 512 positions written by
`put_along_axis`, `mx.compile`, steps dispatched with `async_eval` before the previous tokens are read), with
attention through the masked decode kernel of `crates/perch-engine/src/decode_kernel.rs` (its source read
from there; the README's numbers were taken with the kernel before it read 4 positions a warp at a time), in
four variants:

- `base`: as Perch's CUDA decode step is today (14 kernels a layer: norm, q/k/v, RoPE q, RoPE k, two cache
  writes, attention, output projection, add, norm, gate/up, SwiGLU, down, add);
- `addnorm`: each residual add fused with the RMSNorm after it (one kernel, two outputs: the sum and its norm);
- `addnorm+rope`: and RoPE of the queries and keys in one kernel reading the fused projection's output;
- `addnorm+rope+kv`: and keys and values in one cache buffer per layer (`[rows, 2 * kv_heads, positions, D]`),
  written by one `put_along_axis` of the RoPE kernel's second output.

First it checks each variant's logits against `base` after the same steps; then it alternates the variants
(rounds), printing one JSON line per run: milliseconds a step (steps 20 to N).

    python scripts/probe_fused_step.py MODEL_DIR [ROWS ...] [--host-delay | --views]

With `--views`, it compares `base` with `views`: the same kernels with fewer views (weights transposed once
outside the step, one token's heads sliced without transposes).
With `--host-delay`, it runs `base` only, with 0 to 2 ms of host time spent before each step's dispatch: a
host-bound step grows by all of it, a device-bound one absorbs it up to the device's slack.
"""
import json
import struct
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.utils import dequantize_model

model, _ = load(sys.argv[1])
model = dequantize_model(model)
mx.eval(model.parameters())
ROWS = [int(r) for r in sys.argv[2:] if r.isdigit()] or [1, 8]
m = model.model
a = model.args
H, KV, D = a.num_attention_heads, a.num_key_value_heads, a.hidden_size // a.num_attention_heads
I = a.intermediate_size
W = []
for layer in m.layers:
    at, ml = layer.self_attn, layer.mlp
    W.append(dict(
        n1=layer.input_layernorm.weight, n2=layer.post_attention_layernorm.weight,
        qkv=mx.concatenate([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight], 0),
        o=at.o_proj.weight, gu=mx.concatenate([ml.gate_proj.weight, ml.up_proj.weight], 0),
        d=ml.down_proj.weight))
mx.eval(W)
E = m.embed_tokens.weight
NW = m.norm.weight
EPS = a.rms_norm_eps
THETA = a.rope_theta
INV_FREQ = (THETA ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)).astype(mx.float32)
SCALE = D ** -0.5


def bits(x):
    return struct.unpack("<i", struct.pack("<f", x))[0]


def rust_string(source, name):
    return source.split(f'const {name}: &str = r#"')[1].split('"#;')[0]


_rust = open(Path(__file__).resolve().parent.parent / "crates/perch-engine/src/decode_kernel.rs").read()
ATTENTION = mx.fast.cuda_kernel(
    name="probe_masked_decode_attention", input_names=["q", "k", "v", "mask"], output_names=["out"],
    ensure_row_contiguous=False,
    source=rust_string(_rust, "SOURCE").replace("/*EPILOGUE*/", rust_string(_rust, "WHOLE")))
ADD_NORM = mx.fast.cuda_kernel(
    name="probe_add_rms_norm", input_names=["x", "r", "w"], output_names=["h", "normed"],
    source=open(__file__.replace("probe_fused_step.py", "probe_fused_step.cu"))
    .read().split("// ---- add_norm\n")[1].split("// ----")[0])
ROPE = mx.fast.cuda_kernel(
    name="probe_rope_qk", input_names=["qkv", "pos", "inv_freq"], output_names=["q", "k"],
    source=open(__file__.replace("probe_fused_step.py", "probe_fused_step.cu"))
    .read().split("// ---- rope\n")[1].split("// ----")[0])


def attention(q, k, v, mask):
    rows = q.shape[0]
    return ATTENTION(inputs=[q, k, v, mask],
                     template=[("T", q.dtype), ("D", D), ("SCALE_BITS", bits(SCALE)), ("WARPS", 8), ("STEP", 4)],
                     grid=(H * 8 * 32, rows, 1), threadgroup=(8 * 32, 1, 1),
                     output_shapes=[q.shape], output_dtypes=[q.dtype])[0]


def add_norm(x, r, w):
    rows = x.shape[0] * x.shape[1]
    return ADD_NORM(inputs=[x, r, w], template=[("T", x.dtype), ("EPS_BITS", bits(EPS))],
                    grid=(rows * 256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])


def rope_qk(qkv, pos, pack_values):
    rows = qkv.shape[0]
    second = 2 * KV if pack_values else KV
    threads = rows * (H + second) * (D // 2)
    return ROPE(inputs=[qkv, pos, INV_FREQ],
                template=[("T", qkv.dtype), ("H", H), ("KV", KV), ("D", D), ("PACK", int(pack_values))],
                grid=((threads + 255) // 256 * 256, 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[(rows, H, 1, D), (rows, second, 1, D)], output_dtypes=[qkv.dtype, qkv.dtype])


def silu(x):
    return x * mx.sigmoid(x)


def evaluated_t(a):
    """`a.T` evaluated: a leaf array with transposed strides (no transpose in a traced step)."""
    t = a.T
    mx.eval(t)
    return t


WT = [{k: evaluated_t(w[k]) for k in ("qkv", "o", "gu", "d")} for w in W]
ET = evaluated_t(E)


def make_step(variant, return_logits=False):
    if variant == "views":
        return make_views_step(return_logits)
    fused_norm = variant != "base"
    fused_rope = "rope" in variant
    packed = variant.endswith("+kv")

    def step(tokens, positions, index, mask, *caches):
        rows = tokens.shape[0]
        h = E[tokens]
        out = []
        pending = None  # a residual not yet added (fused with the next norm)
        for i, w in enumerate(W):
            if pending is None:
                x = mx.fast.rms_norm(h, w["n1"], EPS)
            else:
                h, x = add_norm(h, pending, w["n1"])
            qkv = x @ w["qkv"].T
            if fused_rope:
                q, k = rope_qk(qkv, positions, packed)
            else:
                qkv4 = qkv.reshape(rows, 1, H + 2 * KV, D)
                q = qkv4[:, :, :H].transpose(0, 2, 1, 3)
                k = qkv4[:, :, H:H + KV].transpose(0, 2, 1, 3)
                q = mx.fast.rope(q, D, traditional=False, base=THETA, scale=1.0, offset=positions)
                k = mx.fast.rope(k, D, traditional=False, base=THETA, scale=1.0, offset=positions)
            if packed:
                buf = mx.put_along_axis(caches[i], mx.broadcast_to(index, k.shape), k, axis=2)
                out.append(buf)
                K, V = buf[:, :KV], buf[:, KV:]
            else:
                if fused_rope:
                    v = qkv.reshape(rows, 1, H + 2 * KV, D)[:, :, H + KV:].transpose(0, 2, 1, 3)
                else:
                    v = qkv4[:, :, H + KV:].transpose(0, 2, 1, 3)
                idx = mx.broadcast_to(index, k.shape)
                K = mx.put_along_axis(caches[2 * i], idx, k, axis=2)
                V = mx.put_along_axis(caches[2 * i + 1], idx, v, axis=2)
                out += [K, V]
            o = attention(q, K, V, mask)
            o = o.reshape(rows, 1, -1) @ w["o"].T
            if fused_norm:
                h, x = add_norm(h, o, w["n2"])
            else:
                h = h + o
                x = mx.fast.rms_norm(h, w["n2"], EPS)
            gu = x @ w["gu"].T
            y = (silu(gu[..., :I]) * gu[..., I:]) @ w["d"].T
            if fused_norm:
                pending = y
            else:
                h = h + y
        if pending is None:
            h = mx.fast.rms_norm(h, NW, EPS)
        else:
            _, h = add_norm(h, pending, NW)
        logits = h @ E.T
        first = logits[:, -1, :] if return_logits else mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)
        return [first] + out

    return step


def make_views_step(return_logits=False):
    """`base` with fewer views: weights transposed once outside the step (evaluated views, so
    the same matmul kernels), one token's heads sliced from `[rows, heads, 1, D]` directly (no
    transposes), the attention's output and the last position reshaped instead of transposed
    and sliced."""

    def step(tokens, positions, index, mask, *caches):
        rows = tokens.shape[0]
        h = E[tokens]
        out = []
        for i, (w, wt) in enumerate(zip(W, WT)):
            x = mx.fast.rms_norm(h, w["n1"], EPS)
            qkv = (x @ wt["qkv"]).reshape(rows, H + 2 * KV, 1, D)
            q = mx.fast.rope(qkv[:, :H], D, traditional=False, base=THETA, scale=1.0, offset=positions)
            k = mx.fast.rope(qkv[:, H:H + KV], D, traditional=False, base=THETA, scale=1.0, offset=positions)
            v = qkv[:, H + KV:]
            idx = mx.broadcast_to(index, k.shape)
            K = mx.put_along_axis(caches[2 * i], idx, k, axis=2)
            V = mx.put_along_axis(caches[2 * i + 1], idx, v, axis=2)
            out += [K, V]
            o = attention(q, K, V, mask)
            h = h + o.reshape(rows, 1, -1) @ wt["o"]
            x = mx.fast.rms_norm(h, w["n2"], EPS)
            gu = x @ wt["gu"]
            h = h + (silu(gu[..., :I]) * gu[..., I:]) @ wt["d"]
        h = mx.fast.rms_norm(h, NW, EPS)
        logits = (h @ ET).reshape(rows, -1)
        first = logits if return_logits else mx.argmax(logits, axis=-1).astype(mx.uint32)
        return [first] + out

    return step


VARIANTS = ["base", "addnorm", "addnorm+rope", "addnorm+rope+kv"]
if "--views" in sys.argv:
    VARIANTS = ["base", "views"]


def caches_for(variant, rows, cap):
    """Random bfloat16 caches: one `[rows, 2 KV, cap, D]` buffer a layer for `+kv`, else keys and values
    `[rows, KV, cap, D]` apart."""
    packed = variant.endswith("+kv")
    count, heads = (len(W), 2 * KV) if packed else (2 * len(W), KV)
    keys = mx.random.split(mx.random.key(7), count)
    return [mx.random.normal((rows, heads, cap, D), key=keys[i]).astype(mx.bfloat16) for i in range(count)]


def check(rows=3, cap=512):
    """Logits of each variant against `base`, from the same cache contents, over 3 steps."""
    base_caches = caches_for("base", rows, cap)
    packed_caches = [mx.concatenate([base_caches[2 * i], base_caches[2 * i + 1]], axis=1) for i in range(len(W))]
    mx.eval(base_caches, packed_caches)
    results = {}
    for variant in VARIANTS:
        f = mx.compile(make_step(variant, return_logits=True))
        caches = packed_caches if variant.endswith("+kv") else base_caches
        tok = mx.array([[5], [17], [99]][:rows], dtype=mx.uint32)
        keys = mx.arange(cap)
        all_logits = []
        for s in range(3):
            pos = mx.array([100 + 37 * r + s for r in range(rows)], dtype=mx.int32)
            index = pos.reshape(-1, 1, 1, 1)
            mask = keys.reshape(1, 1, 1, -1) <= index
            res = f(tok, pos, index, mask, *caches)
            caches = res[1:]
            all_logits.append(res[0].astype(mx.float32))
            tok = mx.array([[11 + s], [23 + s], [7 + s]][:rows], dtype=mx.uint32)
        results[variant] = mx.stack(all_logits)
        mx.eval(results[variant])
    ref = results["base"]
    for variant in VARIANTS[1:]:
        diff = mx.abs(results[variant] - ref)
        print(json.dumps({"check": variant, "max_abs_logit_diff": diff.max().item(),
                          "mean_abs_logit_diff": diff.mean().item(), "max_abs_logit": mx.abs(ref).max().item(),
                          "argmax_equal": mx.array_equal(mx.argmax(results[variant], -1), mx.argmax(ref, -1)).item()}),
              flush=True)


def run(f, variant, rows, cap=512, n=300, delay_ms=0.0):
    caches = caches_for(variant, rows, cap)
    mx.eval(caches)
    tok = mx.zeros((rows,), dtype=mx.uint32)
    keys = mx.arange(cap)
    times = []
    pending = None
    for s in range(n):
        pos = mx.array([100 + s % 300] * rows, dtype=mx.int32)
        index = pos.reshape(-1, 1, 1, 1)
        mask = keys.reshape(1, 1, 1, -1) <= index
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < delay_ms / 1e3:
            pass
        res = f(tok.reshape(rows, 1), pos, index, mask, *caches)
        tok, caches = res[0], res[1:]
        mx.async_eval(tok, *caches)
        t1 = time.perf_counter()
        if pending is not None:
            pending.tolist()
        pending = tok
        times.append((t1 - t0, time.perf_counter() - t0))
    mx.eval(tok)
    t = times[20:]
    return {"dispatch_ms": 1e3 * sum(x[0] for x in t) / len(t), "step_ms": 1e3 * sum(x[1] for x in t) / len(t)}


if "--host-delay" in sys.argv:
    # Host time added before each step's dispatch: a host-bound step grows by all of it, a
    # device-bound one absorbs it up to the device's slack.
    ROWS = [r for r in ROWS if r > 0]
    f = mx.compile(make_step("base"))
    for rows in ROWS:
        for rnd in range(2):
            for delay in (0.0, 0.5, 1.0, 1.5, 2.0):
                print(json.dumps({"rows": rows, "round": rnd, "host_delay_ms": delay,
                                  **run(f, "base", rows, delay_ms=delay)}), flush=True)
    sys.exit(0)
check()
compiled = {v: mx.compile(make_step(v)) for v in VARIANTS}
for rows in ROWS:
    for rnd in range(4):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for v in order:
            print(json.dumps({"rows": rows, "round": rnd, "variant": v, **run(compiled[v], v, rows)}), flush=True)
