// Kernels of scripts/probe_fused_step.py (CUDA bodies for mx.fast.cuda_kernel).
// ---- attention
  constexpr int PER_LANE = D / 32;
  const float scale = __int_as_float(SCALE_BITS);
  const float lowest = __int_as_float(0xff800000);  // -infinity
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int heads = q_shape[1];
  const int kv_head = head / (heads / k_shape[1]);
  const int positions = k_shape[2];
  const T* qp = q + row * q_strides[0] + head * q_strides[1];
  const T* kp = k + row * k_strides[0] + kv_head * k_strides[1];
  const T* vp = v + row * v_strides[0] + kv_head * v_strides[1];
  const bool* mp = mask + (mask_shape[0] == 1 ? 0 : row * mask_strides[0])
      + (mask_shape[1] == 1 ? 0 : head * mask_strides[1]);
  const auto mask_step = mask_strides[3];

  float query[PER_LANE];
  float acc[PER_LANE];
  for (int i = 0; i < PER_LANE; ++i) {
    query[i] = static_cast<float>(qp[(lane + 32 * i) * q_strides[3]]) * scale;
    acc[i] = 0.0f;
  }
  float running_max = lowest;
  float normalizer = 0.0f;
  for (int p = warp; p < positions; p += WARPS) {
    if (!mp[p * mask_step]) {
      continue;
    }
    const T* key = kp + p * k_strides[2];
    float score = 0.0f;
    for (int i = 0; i < PER_LANE; ++i) {
      score += query[i] * static_cast<float>(key[(lane + 32 * i) * k_strides[3]]);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      score += __shfl_xor_sync(0xffffffff, score, offset);
    }
    const float new_max = fmaxf(running_max, score);
    const float rescale = expf(running_max - new_max);
    const float weight = expf(score - new_max);
    normalizer = normalizer * rescale + weight;
    const T* value = vp + p * v_strides[2];
    for (int i = 0; i < PER_LANE; ++i) {
      acc[i] = acc[i] * rescale + weight * static_cast<float>(value[(lane + 32 * i) * v_strides[3]]);
    }
    running_max = new_max;
  }

  __shared__ float maxima[WARPS];
  __shared__ float normalizers[WARPS];
  __shared__ float sums[WARPS][D];
  if (lane == 0) {
    maxima[warp] = running_max;
    normalizers[warp] = normalizer;
  }
  for (int i = 0; i < PER_LANE; ++i) {
    sums[warp][lane + 32 * i] = acc[i];
  }
  __syncthreads();
  float overall = lowest;
  for (int w = 0; w < WARPS; ++w) {
    overall = fmaxf(overall, maxima[w]);
  }
  T* result = out + (row * heads + head) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float numerator = 0.0f;
    float denominator = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      if (normalizers[w] > 0.0f) {
        const float c = expf(maxima[w] - overall);
        numerator += c * sums[w][d];
        denominator += c * normalizers[w];
      }
    }
    result[d] = static_cast<T>(denominator > 0.0f ? numerator / denominator : 0.0f);
  }
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
