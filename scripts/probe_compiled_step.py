"""Does MLX's `compile` of a whole slot-cache decode step cut the host time of a step? (GPU probe.)

The evidence behind `crates/perch-engine/src/compiled.rs` and the single-stream floor in README's "On a GPU
(CUDA)": on the model `scripts/bench_gpu.py` makes (its weights dequantized to bfloat16, Perch's weights path
on CUDA), a decode step of ROWS rows over slot caches of 512 positions, written as Perch's batched decode is
(fused q/k/v and gate/up projections, RoPE at per-row offsets, `put_along_axis` cache writes, attention with
the per-row length mask, greedy argmax), dispatched with `async_eval` before the previous step's tokens are
read. Each row count runs built op by op ("plain") and through `mx.compile` ("compiled"), twice each, and
prints one JSON line per run: milliseconds a step spent building and dispatching it, and in all (steps 20 to
200; the first steps pay MLX's first-call costs).

    python scripts/probe_compiled_step.py MODEL_DIR      # e.g. /tmp/models/llama-1b after bench_gpu.py
"""
import sys, time, json
import mlx.core as mx
from mlx_lm import load
from mlx_lm.utils import dequantize_model
model, _ = load(sys.argv[1]); model = dequantize_model(model); mx.eval(model.parameters())
m = model.model; a = model.args
L = len(m.layers); H, KV, D = a.num_attention_heads, a.num_key_value_heads, a.hidden_size // a.num_attention_heads
W = []
for l in m.layers:
    at, ml = l.self_attn, l.mlp
    W.append(dict(n1=l.input_layernorm.weight, n2=l.post_attention_layernorm.weight,
        qkv=mx.concatenate([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight], 0),
        o=at.o_proj.weight, gu=mx.concatenate([ml.gate_proj.weight, ml.up_proj.weight], 0), d=ml.down_proj.weight))
mx.eval(W)
E = m.embed_tokens.weight; NW = m.norm.weight; eps = a.rms_norm_eps; theta = a.rope_theta
I = a.intermediate_size
def step(tokens, positions, index, mask, *caches):
    rows = tokens.shape[0]
    h = E[tokens]  # [rows, 1, hidden]
    out = []
    for i, w in enumerate(W):
        x = mx.fast.rms_norm(h, w["n1"], eps)
        qkv = (x @ w["qkv"].T).reshape(rows, 1, H + 2 * KV, D)
        q = qkv[:, :, :H].transpose(0, 2, 1, 3); k = qkv[:, :, H:H + KV].transpose(0, 2, 1, 3); v = qkv[:, :, H + KV:].transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, D, traditional=False, base=theta, scale=1.0, offset=positions)
        k = mx.fast.rope(k, D, traditional=False, base=theta, scale=1.0, offset=positions)
        K, V = caches[2 * i], caches[2 * i + 1]
        idx = mx.broadcast_to(index, k.shape)
        K = mx.put_along_axis(K, idx, k, axis=2); V = mx.put_along_axis(V, idx, v, axis=2)
        out += [K, V]
        o = mx.fast.scaled_dot_product_attention(q, K, V, scale=D ** -0.5, mask=mask)
        h = h + o.transpose(0, 2, 1, 3).reshape(rows, 1, -1) @ w["o"].T
        x = mx.fast.rms_norm(h, w["n2"], eps)
        gu = x @ w["gu"].T
        g, u = gu[..., :I], gu[..., I:]
        h = h + (nn_silu(g) * u) @ w["d"].T
    h = mx.fast.rms_norm(h, NW, eps)
    logits = h @ E.T
    return [mx.argmax(logits[:, -1, :], axis=-1).astype(mx.uint32)] + out
def nn_silu(x): return x * mx.sigmoid(x)
cstep = mx.compile(step)
def run(f, rows, cap=512, n=200):
    caches = [mx.zeros((rows, KV, cap, D), dtype=mx.bfloat16) for _ in range(2 * L)]
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
        res = f(tok.reshape(rows, 1), pos, index, mask, *caches)
        tok, caches = res[0], res[1:]
        mx.async_eval(tok, *caches)
        t1 = time.perf_counter()
        if pending is not None: pending.item() if rows == 1 else pending.tolist()
        pending = tok
        times.append((t1 - t0, time.perf_counter() - t0))
    mx.eval(tok)
    t = times[20:]
    return {"build+dispatch_ms": 1e3 * sum(x[0] for x in t) / len(t), "step_ms": 1e3 * sum(x[1] for x in t) / len(t)}
for rows in (1, 8, 32):
    for name, f in (("plain", step), ("compiled", cstep), ("plain", step), ("compiled", cstep)):
        print(json.dumps({"rows": rows, "variant": name, **run(f, rows)}), flush=True)
