"""Peak memory and time of one mx.fast.scaled_dot_product_attention call on this backend, per mask form (none, "causal",
boolean [B,1,L,S], additive [B,1,L,S] in the compute dtype): queries [B, Hq, L, D], keys/values [B, Hkv, S, D], bfloat16.
Run where python3 has MLX (the CUDA wheel on the device: see scripts/bench_gpu.py). Numbers: slot_cache.rs, decoder.rs (SlotRead)."""
import time
import mlx.core as mx

B, HQ, HKV, L, S = 4, 4, 1, 2048, 8192
for D in (64, 128, 256):
    q = mx.random.normal((B, HQ, L, D)).astype(mx.bfloat16)
    k = mx.random.normal((B, HKV, S, D)).astype(mx.bfloat16)
    v = mx.random.normal((B, HKV, S, D)).astype(mx.bfloat16)
    causal = mx.arange(S)[None, :] <= (mx.arange(L)[:, None] + (S - L))
    boolmask = mx.broadcast_to(causal[None, None], (B, 1, L, S))
    addmask = mx.where(boolmask, mx.array(0, mx.bfloat16), mx.array(-1e9, mx.bfloat16))
    mx.eval(q, k, v, boolmask, addmask)
    for name, mask in (("none", None), ("causal", "causal"), ("bool [B,1,L,S]", boolmask), ("additive bf16 [B,1,L,S]", addmask)):
        for _ in range(2):
            mx.clear_cache(); mx.reset_peak_memory()
            base = mx.get_active_memory()
            t = time.perf_counter()
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
            mx.eval(out)
            ms = (time.perf_counter() - t) * 1e3
            peak = mx.get_peak_memory() - base
            del out
        print(f"D={D:3d} {name:26s} {ms:7.2f} ms  transient {peak / 2**20:8.1f} MB "
              f"(scores [B,Hq,L,S] bf16 would be {B * HQ * L * S * 2 / 2**20:.0f} MB)", flush=True)
