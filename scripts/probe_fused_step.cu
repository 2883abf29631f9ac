// Kernels of scripts/probe_fused_step.py (CUDA bodies for mx.fast.cuda_kernel); its attention kernel is
// read from crates/perch-engine/src/decode_kernel.rs.
// ---- add_norm
  // One block per row: h = x + r (rounded to T), normed = rms_norm(h) * w.
  const int row = blockIdx.x;
  const int n = w_shape[0];
  const float eps = __int_as_float(EPS_BITS);
  const T* xr = x + (size_t)row * n;
  const T* rr = r + (size_t)row * n;
  T* hr = h + (size_t)row * n;
  T* outr = normed + (size_t)row * n;
  float sq = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
    hr[i] = s;
    const float f = static_cast<float>(s);
    sq += f * f;
  }
  __shared__ float partial[32];
  for (int o = 16; o > 0; o /= 2) {
    sq += __shfl_xor_sync(0xffffffff, sq, o);
  }
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = sq;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o /= 2) {
      v += __shfl_xor_sync(0xffffffff, v, o);
    }
    if (threadIdx.x == 0) {
      partial[0] = v;
    }
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    outr[i] = static_cast<T>(static_cast<float>(hr[i]) * inv * static_cast<float>(w[i]));
  }
// ---- rope
  // qkv [rows, 1, (H + 2 KV) D] -> q [rows, H, 1, D] and k [rows, KV, 1, D] with RoPE (non-traditional:
  // component i pairs with i + D/2), or with PACK, k [rows, 2 KV, 1, D]: keys with RoPE, then values copied.
  constexpr int HALF = D / 2;
  constexpr int SECOND = PACK ? 2 * KV : KV;
  const int rows = pos_shape[0];
  const long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long)rows * (H + SECOND) * HALF) {
    return;
  }
  const int i = t % HALF;
  const int head = (t / HALF) % (H + SECOND);
  const int row = t / ((long)HALF * (H + SECOND));
  const T* src = qkv + (size_t)row * (H + 2 * KV) * D + (size_t)head * D;
  const float x1 = static_cast<float>(src[i]);
  const float x2 = static_cast<float>(src[i + HALF]);
  T* dst = head < H ? q + ((size_t)row * H + head) * D : k + ((size_t)row * SECOND + head - H) * D;
  if (head >= H + KV) {
    dst[i] = src[i];
    dst[i + HALF] = src[i + HALF];
    return;
  }
  const float angle = static_cast<float>(pos[row]) * inv_freq[i];
  float s, c;
  sincosf(angle, &s, &c);
  dst[i] = static_cast<T>(x1 * c - x2 * s);
  dst[i + HALF] = static_cast<T>(x1 * s + x2 * c);
// ----
