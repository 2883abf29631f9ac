//! The experts' work at decode (few tokens) in CUDA kernels of Perch's own, written with MLX's
//! custom-kernel API ([`crate::nn::custom_kernel`]):
//! - [`gather_qmv`]: for each (token, expert) pair `p`, `y[p] = W[indices[p]] · x[p / x_per_row]`
//!   (plus the expert's bias) with `W` MLX-quantized (affine 4- or 8-bit, or MXFP4); optionally
//!   with the gated activation of the fused gate and up projections applied to the two halves
//!   ([`Epilogue::Gated`]), or with a token's k pairs summed with the router's weights
//!   ([`Epilogue::Weighted`]) — so a sparse block's experts are two launches.
//! - [`route`]: the router's top k of each token's expert scores and their softmax weights in
//!   one launch.
//!
//! Why: MLX 0.32's CUDA `gather_qmm` runs a CUTLASS GEMM kernel (`qmm_sm80`) for every shape,
//! also when each pair is one row; on an H200 a `qwen3_moe` decode step at 16 rows spends 28% of
//! its device time there, about 36 µs a product for weights that take a few µs to read, and
//! MLX's top k is a block sort per layer (see docs/benchmarks.md). A decode step is bound by the
//! host launching its kernels, so each launch saved shortens it. A matrix-vector product per
//! pair reads each weight once per pair (the repeats of an expert come from L2) and does no
//! padded arithmetic. On Metal MLX's own `gather_qmm` has such a path (`gather_qmv`), so the
//! kernels are built for CUDA only; the CPU runs MLX's operations.
//!
//! Layout of [`gather_qmv`]: a block of [`WARPS`] warps computes [`ROWS`]·[`WARPS`] output
//! features of one pair (or, weighted, of one token, its pairs in turn); the pair's input row is
//! staged in shared memory as float32; each lane reads every 32nd packed word of its warp's rows
//! (32-bit words, coalesced across the warp), dequantizes it in registers and accumulates in
//! float32; a warp sum gives each output. The kernel is bound by issuing instructions (about 9
//! a value in a plain loop, read from its SASS), so a value costs as few as it can:
//! - each value becomes a float by placing its bits in a float's (integer and float
//!   instructions only: CUDA's conversion instructions run at an eighth of their rate, and with
//!   one a value they bounded the kernel — a gpt-oss-20b-shaped gated product at 32 rows took
//!   1.45 ms with them, 0.93 ms without, on an H200): affine values left in place under an
//!   exponent of their own (one LOP3 and one subtraction a value); MXFP4 values two at a time
//!   as a half2 of the value times 2^-14, against an input staged times 2^14 (exact products);
//!   an E8M0 scale's float from its bits;
//! - the next word's loads are issued before this word's arithmetic (the word loop unrolled),
//!   and the pair's expert and first words before its input is staged;
//! - the warp sums exchange half the values a step (the same pairs added as a butterfly per
//!   value, so the same sums).
//!
//! Each output's products and sums, in their order, are a plain loop's. Dequantization as MLX's (`mlx/backend/*/quantized`):
//! affine `w = scale·q + bias` per group, the word's values low bits first; MXFP4 values are
//! E2M1 (`±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`) times `2^(s − 127)` of the group's E8M0 scale `s` (OCP
//! Microscaling Formats v1.0). Activations as [`Activation::gated`] computes them, in float32.

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{ops, Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{
    relative_error, time_call, with_kernel, within, CustomKernel, TemplateArg,
};
use crate::nn::layers::{Activation, QuantMode, QuantParams};

/// Warps per block.
const WARPS: i32 = 4;
/// Output features per warp.
const ROWS: i32 = 4;
/// The widest input row staged in shared memory (float32: 28 KiB).
const MAX_IN: i32 = 7168;
/// The most items (pairs, or tokens when weighted) a launch takes (CUDA's grid z).
const MAX_GRID_Z: i32 = 65_535;
/// The most (token, routed expert) pairs the engine sends to the kernel: a decode step of up
/// to 128 rows at 8 experts a token (a folded shared expert's pieces come on top:
/// `crate::models::moe`). Above it MLX's `gather_qmm`, whose GEMM reuses each expert's weights
/// across its tokens (prefill).
pub const MAX_PAIRS: usize = 1024;
/// The most experts [`route`] takes (32 scores a lane of one warp).
const MAX_EXPERTS: i32 = 1024;
/// The most experts a token [`route`] picks.
const MAX_TOP_K: i32 = 32;

/// Device functions of [`SOURCE`]: a packed word's values dequantized (before the group's scale)
/// times `xv`, and the gated activation of `ACT` (0: none, the gate's value).
const HEADER: &str = r#"
// (a & b) | c in one LOP3: with c in a register (ptxas keeps one immediate per LOP3, so a mask and a
// constant to OR in would otherwise take two).
__device__ __forceinline__ unsigned perch_and_or(unsigned a, unsigned b, unsigned c) {
  unsigned d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// A packed word's PER_WORD values (before the group's scale), exactly as floats, in order.
// Affine (BITS 2, 4, 8): the value n of k-th field of a 16-bit half, left in place (bits BITS*k) in
// the mantissa of a float of exponent 23 - BITS*k: that float less 2^(23 - BITS*k) is n exactly;
// one LOP3 and one FADD a value, one shift a word.
// MXFP4: two E2M1 values at once as a half2 (nibbles j and j + 4, in a word's two halves): sign to
// bit 15, exponent and mantissa bits to the half's lowest exponent bits and top mantissa bit: the
// value times 2^-14 exactly (0.5 a subnormal half); the caller's x are scaled by 2^14 instead
// (exact, unless |x| >= 2^114). Half to float conversions (HADD2.F32) are FMA-pipe instructions.
template <int BITS, int MXFP4>
__device__ __forceinline__ void perch_values(unsigned q, float* wv) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  if (MXFP4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned a = q << (12 - 4 * j);
      const unsigned b = j < 3 ? q << (9 - 4 * j) : q >> 3;
      const unsigned h = (a & 0x80008000u) | (b & 0x0E000E00u);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
      wv[j] = f.x;
      wv[j + 4] = f.y;
    }
  } else if (BITS == 2 || BITS == 4 || BITS == 8) {
    constexpr int HALF = 16 / BITS;
    const unsigned hi = q >> 16;
#pragma unroll
    for (int k = 0; k < HALF; ++k) {
      const unsigned magic = (150u - BITS * k) << 23;
      wv[k] = __uint_as_float(perch_and_or(q, MASK << (BITS * k), magic)) - __uint_as_float(magic);
      wv[k + HALF] =
          __uint_as_float(perch_and_or(hi, MASK << (BITS * k), magic)) - __uint_as_float(magic);
    }
  } else {
#pragma unroll
    for (int i = 0; i < PER_WORD; ++i) {
      const unsigned n = (q >> (BITS * i)) & MASK;
      wv[i] = __uint_as_float(0x4B000000u | n) - 8388608.0f;
    }
  }
}

// What the x staged in shared memory are multiplied by (see perch_values): exact.
template <int MXFP4>
__device__ __forceinline__ float perch_x_scale() {
  return MXFP4 ? 16384.0f : 1.0f;
}

template <int BITS, int MXFP4>
__device__ __forceinline__ float perch_qdot(unsigned q, const float* xv) {
  constexpr int PER_WORD = 32 / BITS;
  float wv[PER_WORD];
  perch_values<BITS, MXFP4>(q, wv);
  float dot = 0.0f;
#pragma unroll
  for (int i = 0; i < PER_WORD; ++i) dot += wv[i] * xv[i];
  return dot;
}

// 2^(s - 127) of an E8M0 scale s from its bits: exponent field s (s >= 1; s == 255 gives +inf, as
// exp2f(128) does), and for s == 0 (0.0f from the bits) 2^-127, a subnormal, by the max.
__device__ __forceinline__ float perch_e8m0(unsigned s) {
  return fmaxf(__uint_as_float(s << 23), __uint_as_float(0x00400000u));
}

// The element type of an input pointer.
template <typename P>
struct perch_elem;
template <typename E>
struct perch_elem<const E*> {
  using type = E;
};

// An input's element as raw bits in a 32-bit register (so that loads kept in flight across an
// iteration are not packed into and unpacked from shared registers), and back.
template <typename S>
__device__ __forceinline__ unsigned perch_raw(const S* p) {
  if constexpr (sizeof(S) == 1) {
    return *reinterpret_cast<const unsigned char*>(p);
  } else if constexpr (sizeof(S) == 2) {
    return *reinterpret_cast<const unsigned short*>(p);
  } else {
    return *reinterpret_cast<const unsigned*>(p);
  }
}
template <typename S>
__device__ __forceinline__ float perch_float(unsigned v) {
  S s;
  memcpy(&s, &v, sizeof(S));
  return static_cast<float>(s);
}

template <int ACT>
__device__ __forceinline__ float perch_gated(float v, float up) {
  if (ACT == 1) {
    return v / (1.0f + expf(-v)) * up;
  } else if (ACT == 2) {
    return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))) * up;
  } else if (ACT == 3) {
    const float gate = fminf(v, 7.0f);
    const float clamped = fminf(fmaxf(up, -7.0f), 7.0f);
    return (clamped + 1.0f) * gate / (1.0f + expf(-1.702f * gate));
  }
  return v;
}
"#;

const SOURCE: &str = r#"
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = IN / PER_WORD;
  constexpr int GROUPS = IN / GROUP;
  // Weight rows an output reads (gate and up when gated), pairs an output sums (weighted).
  constexpr int PARTS = ACT > 0 ? 2 : 1;
  constexpr int PAIRS = WEIGHTED ? K : 1;
  constexpr int ACCS = PARTS * ROWS;
  // Each lane's words: lane, lane + 32, ... (ITERS of them, the last maybe past WORDS).
  constexpr int ITERS = (WORDS + 31) / 32;
  __shared__ __align__(16) float xs[IN];
  const int lane = threadIdx.x;
  const int tid = threadIdx.y * 32 + lane;
  const int threads = blockDim.y * 32;
  const int item = blockIdx.z;
  const int rows = w_shape[1];
  const int out = rows / PARTS;
  const int first = (blockIdx.y * blockDim.y + threadIdx.y) * ROWS;
  // A row's offset from the warp's first row (gate rows, then up rows at `out`).
  auto row_at = [&](int r) -> long long {
    return static_cast<long long>((r / ROWS) * out + (r % ROWS));
  };
  float total[ACCS];
#pragma unroll
  for (int r = 0; r < ACCS; ++r) total[r] = 0.0f;
  for (int j = 0; j < PAIRS; ++j) {
    const int pair = item * PAIRS + j;
    // The expert and the lane's first words and scales, loaded before the input row is staged so
    // that their latency overlaps it.
    const long long row0 = static_cast<long long>(indices[pair]) * rows + first;
    // Raw words and scales (converted where used, so that no instruction waits on a load issued
    // for the next word).
    using S = typename perch_elem<decltype(scales)>::type;
    unsigned q[ACCS], sc[ACCS], bi[ACCS];
    auto load = [&](int word, unsigned* qq, unsigned* ss, unsigned* bb) {
      const int g = (word * PER_WORD) / GROUP;
#pragma unroll
      for (int r = 0; r < ACCS; ++r) {
        const long long row = row0 + row_at(r);
        qq[r] = w[row * WORDS + word];
        ss[r] = perch_raw(scales + row * GROUPS + g);
        if (!MXFP4) bb[r] = perch_raw(biases + row * GROUPS + g);
      }
    };
    load(min(lane, WORDS - 1), q, sc, bi);
    if (j > 0) __syncthreads();
    const long long x_row = static_cast<long long>(pair / X_PER_ROW) * IN;
    if (IN % 8 == 0 && sizeof(T) == 2 &&
        (reinterpret_cast<unsigned long long>(x + x_row) & 15) == 0) {
      for (int i = tid * 8; i < IN; i += threads * 8) {
        const uint4 v = *reinterpret_cast<const uint4*>(x + x_row + i);
        const T* e = reinterpret_cast<const T*>(&v);
        float4 a, b;
        a.x = static_cast<float>(e[0]) * perch_x_scale<MXFP4>();
        a.y = static_cast<float>(e[1]) * perch_x_scale<MXFP4>();
        a.z = static_cast<float>(e[2]) * perch_x_scale<MXFP4>();
        a.w = static_cast<float>(e[3]) * perch_x_scale<MXFP4>();
        b.x = static_cast<float>(e[4]) * perch_x_scale<MXFP4>();
        b.y = static_cast<float>(e[5]) * perch_x_scale<MXFP4>();
        b.z = static_cast<float>(e[6]) * perch_x_scale<MXFP4>();
        b.w = static_cast<float>(e[7]) * perch_x_scale<MXFP4>();
        *reinterpret_cast<float4*>(xs + i) = a;
        *reinterpret_cast<float4*>(xs + i + 4) = b;
      }
    } else {
      for (int i = tid; i < IN; i += threads) {
        xs[i] = static_cast<float>(x[x_row + i]) * perch_x_scale<MXFP4>();
      }
    }
    __syncthreads();
    float acc[ACCS];
#pragma unroll
    for (int r = 0; r < ACCS; ++r) acc[r] = 0.0f;
    // Software-pipelined: the next words' loads are issued before this word's arithmetic. Unrolled
    // whole up to 16 words a lane (inputs of up to 4,096 4-bit features); beyond, a loop, whose
    // registers stay few (ptxas: 56 against 147 a thread for an 8-bit weighted product of 2,880).
#pragma unroll (ITERS <= 16 ? ITERS : 1)
    for (int it = 0; it < ITERS; ++it) {
      const int word = lane + 32 * it;
      if (WORDS % 32 != 0 && word >= WORDS) break;
      // The next words (clamped: a lane past the row's end loads its last word again, unused).
      unsigned qn[ACCS], scn[ACCS], bin[ACCS];
      if (it + 1 < ITERS) load(min(word + 32, WORDS - 1), qn, scn, bin);
      const int base = word * PER_WORD;
      float xv[PER_WORD];
      float xsum = 0.0f;
#pragma unroll
      for (int i = 0; i < PER_WORD; ++i) {
        xv[i] = xs[base + i];
        if (!MXFP4) xsum += xv[i];
      }
#pragma unroll
      for (int r = 0; r < ACCS; ++r) {
        const float dot = perch_qdot<BITS, MXFP4>(q[r], xv);
        if (MXFP4) {
          acc[r] += perch_e8m0(sc[r]) * dot;
        } else {
          acc[r] += perch_float<S>(sc[r]) * dot + perch_float<S>(bi[r]) * xsum;
        }
      }
      if (it + 1 < ITERS) {
#pragma unroll
        for (int r = 0; r < ACCS; ++r) {
          q[r] = qn[r];
          sc[r] = scn[r];
          bi[r] = bin[r];
        }
      }
    }
    const float weight = WEIGHTED ? static_cast<float>(coef[pair]) : 1.0f;
#pragma unroll
    for (int r = 0; r < ACCS; ++r) total[r] += weight * acc[r];
  }
  // The warp sums, halving the values each lane holds at each of the first steps (the same pairs
  // of partial sums as a butterfly on each value, so the same result): after log2(ACCS) steps,
  // lane l holds value (l >> (5 - log2(ACCS))) & (ACCS - 1), summed over its group of lanes after
  // the remaining steps.
  static_assert((ACCS & (ACCS - 1)) == 0 && ACCS <= 32, "ACCS a power of two");
  int count = ACCS;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    if (count > 1) {
      const bool upper = (lane & o) != 0;
#pragma unroll
      for (int k = 0; k < ACCS / 2; ++k) {
        if (k < count / 2) {
          const float send = upper ? total[k] : total[k + count / 2];
          const float keep = upper ? total[k + count / 2] : total[k];
          total[k] = keep + __shfl_xor_sync(0xffffffff, send, o);
        }
      }
      count /= 2;
    } else {
      total[0] += __shfl_xor_sync(0xffffffff, total[0], o);
    }
  }
  // Lane group g (of 32 / ACCS lanes) holds value g: gate row g (g < ROWS), or up row g - ROWS.
  constexpr int SPAN = 32 / ACCS;
  const int r = lane / SPAN;
  float v = total[0];
  const float up = PARTS == 2 ? __shfl_down_sync(0xffffffff, v, ROWS * SPAN) : v;
  if (lane % SPAN == 0 && r < ROWS) {
    float vu = up;
    if (HAS_BIAS) {
      for (int j = 0; j < PAIRS; ++j) {
        const int pair = item * PAIRS + j;
        const float weight = WEIGHTED ? static_cast<float>(coef[pair]) : 1.0f;
        const long long row0 = static_cast<long long>(indices[pair]) * rows + first;
        v += weight * static_cast<float>(bias[row0 + r]);
        if (PARTS == 2) vu += weight * static_cast<float>(bias[row0 + out + r]);
      }
    }
    const float o = perch_gated<ACT>(v, vu);
    y[static_cast<long long>(item) * out + first + r] = static_cast<T>(o);
  }
"#;

/// A block a token. A token has `COLS` scores: the `E` experts', then, with `SHARED` above 0, a
/// shared expert's gate. With `FROM_X`, `logits` is the token's input `[H]` and its scores are
/// first computed by the block's warps (`W` `[COLS, H]`, a warp a score in turn, float32 sums plus
/// `bias[e]` with `HAS_BIAS`, each rounded to `T` as MLX's product in `T` is) into shared memory;
/// otherwise `logits` is the scores `[COLS]`. Then one warp: NaN read as −∞, the `K` largest of the
/// `E` experts' picked in turn (ties to the lower expert), then their softmax weights, over all `E`
/// scores (`ALL`) or over the `K`, each times `scale[expert]` (`SCALED`); then `SHARED` more
/// outputs, experts `E .. E + SHARED` (the shared expert's pieces, see
/// `crate::models::moe`), each weighted by the sigmoid of the gate's score.
const ROUTE_SOURCE: &str = r#"
  constexpr int PER_LANE = (E + 31) / 32;
  constexpr int COLS = E + (SHARED > 0 ? 1 : 0);
  constexpr int OUTS = K + SHARED;
  const float neg_inf = __int_as_float(0xff800000);
  const int lane = threadIdx.x;
  const long long row = blockIdx.y;
  __shared__ float computed[FROM_X ? COLS : 1];
  if (FROM_X) {
    // The token's input staged as float32; each lane reads 16-byte pieces of a weight row
    // (`H` a multiple of 8) and the matching input features.
    constexpr int VEC = 16 / sizeof(T);
    constexpr int PIECES = H / VEC;
    __shared__ float4 staged[FROM_X ? H / 4 : 1];
    float* xs = reinterpret_cast<float*>(staged);
    const T* x = logits + row * H;
    for (int h = threadIdx.y * 32 + lane; h < H; h += blockDim.y * 32) {
      xs[h] = static_cast<float>(x[h]);
    }
    __syncthreads();
    // A weight that starts off a 16-byte boundary (a view into another buffer) is read a value
    // at a time.
    const bool aligned = (reinterpret_cast<unsigned long long>(w) & 15ull) == 0;
    for (int e = threadIdx.y; e < COLS; e += blockDim.y) {
      const T* row_w = w + static_cast<long long>(e) * H;
      float acc = 0.0f;
      if (aligned) {
        const uint4* we = reinterpret_cast<const uint4*>(row_w);
#pragma unroll 4
        for (int c = lane; c < PIECES; c += 32) {
          const uint4 piece = we[c];
          const T* p = reinterpret_cast<const T*>(&piece);
#pragma unroll
          for (int j = 0; j < VEC; j += 4) {
            const float4 xv = staged[(c * VEC + j) / 4];
            acc += xv.x * static_cast<float>(p[j]) + xv.y * static_cast<float>(p[j + 1])
                + xv.z * static_cast<float>(p[j + 2]) + xv.w * static_cast<float>(p[j + 3]);
          }
        }
      } else {
        for (int h = lane; h < H; h += 32) acc += xs[h] * static_cast<float>(row_w[h]);
      }
      for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffff, acc, o);
      if (lane == 0) {
        if (HAS_BIAS && e < E) acc += static_cast<float>(bias[e]);
        computed[e] = static_cast<float>(static_cast<T>(acc));
      }
    }
    __syncthreads();
    if (threadIdx.y != 0) return;
  }
  float v[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + 32 * i;
    float s = neg_inf;
    if (e < E) s = FROM_X ? computed[e] : static_cast<float>(logits[row * COLS + e]);
    v[i] = s != s ? neg_inf : s;
  }
  unsigned taken = 0u;
  float top[K];
  int chosen[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float best = neg_inf;
    int best_e = -1;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((taken >> i) & 1u) && (best_e < 0 || v[i] > best)) {
        best = v[i];
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o /= 2) {
      const float other = __shfl_xor_sync(0xffffffff, best, o);
      const int other_e = __shfl_xor_sync(0xffffffff, best_e, o);
      if (other_e >= 0
          && (best_e < 0 || other > best || (other == best && other_e < best_e))) {
        best = other;
        best_e = other_e;
      }
    }
    if (best_e >= 0 && (best_e & 31) == lane) taken |= 1u << (best_e >> 5);
    top[k] = best;
    chosen[k] = best_e < 0 ? 0 : best_e;
  }
  const float m = top[0];
  float denom = 0.0f;
  if (ALL) {
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) denom += expf(v[i] - m);
    for (int o = 16; o > 0; o /= 2) denom += __shfl_xor_sync(0xffffffff, denom, o);
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) denom += expf(top[k] - m);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = expf(top[k] - m) / denom;
      if (SCALED) s *= static_cast<float>(scale[chosen[k]]);
      indices[row * OUTS + k] = static_cast<uint32_t>(chosen[k]);
      scores[row * OUTS + k] = static_cast<T>(s);
    }
    if (SHARED > 0) {
      const float g = FROM_X ? computed[E] : static_cast<float>(logits[row * COLS + E]);
      // The gate's sigmoid in float32, rounded to T (MLX's, computed in T, is within a unit
      // in the last place of it).
      const T s = static_cast<T>(1.0f / (1.0f + expf(-g)));
#pragma unroll
      for (int j = 0; j < SHARED; ++j) {
        indices[row * OUTS + K + j] = static_cast<uint32_t>(E + j);
        scores[row * OUTS + K + j] = s;
      }
    }
  }
"#;

/// Put before [`ROUTE_SOURCE`] (with `FROM_X`) for [`route_after_add_norm`]: the block's 1,024
/// threads first write the token's `sum = T(unnormed + residual)` and `normed = norm_w ·
/// T(sum · rsqrt(mean(sum²) + eps))` (as `crate::nn::norm_kernel`'s kernel computes them, squares
/// in float32), then the router reads `normed` back as its input (`logits`; global writes of a
/// block are visible to its threads after `__syncthreads`).
const ADD_NORM_PROLOGUE: &str = r#"
  {
    constexpr int THREADS = 32 * 32;
    constexpr int PER_THREAD = (H + THREADS - 1) / THREADS;
    const float eps_norm = __int_as_float(EPS_BITS);
    const int t = threadIdx.y * 32 + threadIdx.x;
    const long long base = static_cast<long long>(blockIdx.y) * H;
    float kept[PER_THREAD];
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int d = t + i * THREADS;
      kept[i] = 0.0f;
      if (d < H) {
        const T s = static_cast<T>(
            static_cast<float>(unnormed[base + d]) + static_cast<float>(residual[base + d]));
        sum[base + d] = s;
        kept[i] = static_cast<float>(s);
        squares += kept[i] * kept[i];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) squares += __shfl_xor_sync(0xffffffff, squares, o);
    __shared__ float norm_partial[32];
    if (threadIdx.x == 0) norm_partial[threadIdx.y] = squares;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < 32; ++w) total += norm_partial[w];
    const float normalizer = rsqrtf(total / H + eps_norm);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
      const int d = t + i * THREADS;
      if (d < H) normed[base + d] = norm_w[d] * static_cast<T>(kept[i] * normalizer);
    }
    __syncthreads();
  }
  const T* logits = normed;
"#;

/// CUDA, unless `PERCH_EXPERT_KERNEL=0` (benchmarks against MLX's operations); `None` elsewhere.
pub fn backend() -> Option<Backend> {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    let enabled =
        *ENABLED.get_or_init(|| std::env::var("PERCH_EXPERT_KERNEL").as_deref() != Ok("0"));
    (enabled && Backend::current() == Backend::Cuda).then_some(Backend::Cuda)
}

/// What [`gather_qmv`] does with a pair's product before writing it.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    /// Written as it is: `y` `[indices.shape, 1, out]`.
    Plain,
    /// The weights' rows are the gate's then the up projection's (`out` each, as
    /// [`crate::nn::layers::halves`] splits them); `y` `[indices.shape, 1, out]` is the gated
    /// activation of the two ([`Activation::gated`]).
    Gated(Activation),
    /// `x` has a row per pair; each token's pairs (the last axis of `indices`) are summed,
    /// each times its weight in `scores` (the shape of `indices`): `y` `[indices.shape[..-1],
    /// out]`.
    Weighted(&'a Array),
}

/// One product's operands: `x` `[..., 1, in]` (a row per token, or per pair; or, with
/// `per_token`, `[tokens..., in]` for `indices` `[tokens..., k]`), `indices` the pairs' experts
/// (any shape, int32 or uint32), the weights `[experts, rows, in · bits / 32]`
/// uint32 with their scales (and, affine, biases) `[experts, rows, in / group_size]`, and the
/// experts' own bias `[experts, rows]` where they have one.
#[derive(Clone, Copy)]
pub struct Operands<'a> {
    pub x: &'a Array,
    pub weight: &'a Array,
    pub scales: &'a Array,
    pub biases: Option<&'a Array>,
    pub indices: &'a Array,
    pub params: QuantParams,
    pub bias: Option<&'a Array>,
    pub epilogue: Epilogue<'a>,
    /// `x` is `[tokens..., in]` for `indices` `[tokens..., k]`: a row per token, read by each of
    /// its pairs (what gather_qmm reads from `[tokens..., 1, 1, in]`; without the two unit axes,
    /// each a reshape in every step's graph). Off: `x` broadcasts as gather_qmm's.
    pub per_token: bool,
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
}

/// Whether [`gather_qmv`] takes weights quantized with `params` of `input` features and
/// `output` outputs (each half's, for the gated product): affine 4/8-bit with groups of 32, 64 or
/// 128 or MXFP4 (groups of 32), `input` a whole number of groups up to [`MAX_IN`], `output` a
/// multiple of a block's features. [`Operands::x_per_row`] asks this and more of the arrays.
pub fn takes(params: QuantParams, input: i32, output: i32) -> bool {
    let format = match params.mode {
        QuantMode::Affine => {
            matches!(params.bits, 4 | 8) && matches!(params.group_size, 32 | 64 | 128)
        }
        QuantMode::Mxfp4 => params.bits == 4 && params.group_size == 32,
        QuantMode::Mxfp8 => false,
    };
    format
        && (1..=MAX_IN).contains(&input)
        && input % params.group_size == 0
        && output > 0
        && output % (ROWS * WARPS) == 0
}

impl Operands<'_> {
    /// Pairs sharing one row of `x`, when the kernel computes this product: a float `x` whose
    /// rows divide the pairs (one a pair when weighted), `in` a multiple of the group and at
    /// most [`MAX_IN`], the outputs a multiple of a block's features, affine 4/8-bit with
    /// groups of 32, 64 or 128 or MXFP4 (groups of 32, uint8 scales), at most [`MAX_GRID_Z`]
    /// items, and every shape consistent.
    pub fn x_per_row(&self) -> Option<i32> {
        let (ws, ss, xs) = (self.weight.shape(), self.scales.shape(), self.x.shape());
        let per_token = self.per_token && self.row_per_token();
        if ws.len() != 3 || xs.len() < 2 || (xs[xs.len() - 2] != 1 && !per_token) {
            return None;
        }
        let (experts, rows, words) = (ws[0], ws[1], ws[2]);
        let p = self.params;
        let input = *xs.last()?;
        let pairs = i32::try_from(self.indices.size()).ok()?;
        let x_rows = i32::try_from(self.x.size()).ok()? / input.max(1);
        let parts = match self.epilogue {
            Epilogue::Gated(_) => 2,
            _ => 1,
        };
        let out = rows / parts;
        let formats = takes(p, input, out)
            && match p.mode {
                QuantMode::Affine => {
                    self.biases
                        .is_some_and(|b| b.shape() == ss && b.dtype() == self.scales.dtype())
                        // gather_qmm's output is in the promoted dtype, the kernel's in x's.
                        && self.scales.dtype() == self.x.dtype()
                }
                QuantMode::Mxfp4 => self.biases.is_none() && self.scales.dtype() == Dtype::Uint8,
                QuantMode::Mxfp8 => false,
            };
        let items = match self.epilogue {
            Epilogue::Weighted(scores) => {
                let k = self.indices.shape().last().copied().unwrap_or(0);
                let fits = scores.shape() == self.indices.shape()
                    && is_float(scores.dtype())
                    && k > 0
                    && x_rows == pairs
                    && xs[..xs.len() - 2] == *self.indices.shape();
                if !fits {
                    return None;
                }
                pairs / k
            }
            _ => pairs,
        };
        let bias_fits = self
            .bias
            .is_none_or(|b| b.shape() == [experts, rows] && is_float(b.dtype()));
        let fits = formats
            && bias_fits
            && experts > 0
            && rows % parts == 0
            && words * 32 == input * p.bits
            && ss == [experts, rows, input / p.group_size]
            && self.weight.dtype() == Dtype::Uint32
            && matches!(self.indices.dtype(), Dtype::Int32 | Dtype::Uint32)
            && is_float(self.x.dtype())
            && (1..=MAX_GRID_Z).contains(&items)
            && x_rows > 0
            && pairs % x_rows == 0
            && (per_token || self.broadcasts_as_gather_qmm());
        fits.then(|| pairs / x_rows)
    }

    /// Whether `x` is `[tokens..., in]` for `indices` `[tokens..., k]` (see
    /// [`Operands::per_token`]).
    fn row_per_token(&self) -> bool {
        let (xs, is) = (self.x.shape(), self.indices.shape());
        !is.is_empty() && xs.len() == is.len() && xs[..xs.len() - 1] == is[..is.len() - 1]
    }

    /// Whether `x`'s leading axes meet `indices`' as the kernel reads them: the same axes, the
    /// last of `x`'s 1 (a row per token, its experts on `indices`' last axis) or equal (a row
    /// per pair).
    fn broadcasts_as_gather_qmm(&self) -> bool {
        let (xs, is) = (self.x.shape(), self.indices.shape());
        let lead = &xs[..xs.len() - 2];
        lead.len() == is.len()
            && lead
                .iter()
                .zip(is)
                .enumerate()
                .all(|(axis, (&x, &i))| x == i || (axis + 1 == is.len() && x == 1))
    }
}

/// The product as `gather_qmm(x, w, scales, biases, indices, transpose = true)` gives it when
/// `x`'s leading axes broadcast against `indices`' (a row per token, or per pair), plus the
/// experts' bias, then the [`Epilogue`]; in `x`'s dtype. `Err` where [`Operands::x_per_row`]
/// refuses the operands or there is no backend ([`backend`]).
pub fn gather_qmv(o: &Operands) -> Result<Array, Exception> {
    let (Some(backend), Some(x_per_row)) = (backend(), o.x_per_row()) else {
        return Err(Exception::custom("gather_qmv: operands it does not take"));
    };
    let weighted = matches!(o.epilogue, Epilogue::Weighted(_));
    let input = *o.x.shape().last().expect("x has axes");
    let rows = o.weight.shape()[1];
    let pairs = o.indices.size() as i32;
    let k = *o.indices.shape().last().unwrap_or(&1);
    let (act, out, items, shape) = match o.epilogue {
        Epilogue::Plain => (0, rows, pairs, [o.indices.shape(), &[1, rows]].concat()),
        Epilogue::Gated(activation) => {
            let act = match activation {
                Activation::Silu => 1,
                Activation::GeluApprox => 2,
                Activation::SwigluOai => 3,
            };
            let out = rows / 2;
            (act, out, pairs, [o.indices.shape(), &[1, out]].concat())
        }
        Epilogue::Weighted(_) => {
            let lead = &o.indices.shape()[..o.indices.ndim() - 1];
            (0, rows, pairs / k, [lead, &[rows]].concat())
        }
    };
    let template = [
        TemplateArg::Dtype(c"T", o.x.dtype()),
        TemplateArg::Int(c"IN", input),
        TemplateArg::Int(c"BITS", o.params.bits),
        TemplateArg::Int(c"GROUP", o.params.group_size),
        TemplateArg::Int(c"X_PER_ROW", x_per_row),
        TemplateArg::Int(c"MXFP4", (o.params.mode == QuantMode::Mxfp4) as i32),
        TemplateArg::Int(c"ROWS", ROWS),
        TemplateArg::Int(c"ACT", act),
        TemplateArg::Int(c"WEIGHTED", weighted as i32),
        // Only a weighted product reads K: one value otherwise, so as not to compile a kernel per
        // pair count.
        TemplateArg::Int(c"K", if weighted { k } else { 1 }),
        TemplateArg::Int(c"HAS_BIAS", o.bias.is_some() as i32),
    ];
    // Every launch passes seven inputs; the kernel reads none of those its template leaves out
    // (MXFP4's biases, the experts' bias, the weights of an unweighted product). MLX keys a
    // compiled kernel by its name and template only, so inputs whose dtype the template does
    // not name come in fixed dtypes: `x`'s for the bias and weights, uint32 for the indices.
    let biases = o.biases.unwrap_or(o.scales);
    let in_dtype = |a: &Array, dtype: Dtype| match a.dtype() == dtype {
        true => Ok(a.clone()),
        false => a.as_dtype(dtype),
    };
    let indices = in_dtype(o.indices, Dtype::Uint32)?;
    let bias = match o.bias {
        Some(bias) => in_dtype(bias, o.x.dtype())?,
        None => o.x.clone(),
    };
    let coef = match o.epilogue {
        Epilogue::Weighted(scores) => in_dtype(scores, o.x.dtype())?,
        _ => o.x.clone(),
    };
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    let y = with_kernel(
        &KERNEL,
        || {
            CustomKernel::with_header(
                backend,
                c"perch_gather_qmv",
                &["x", "w", "scales", "biases", "indices", "bias", "coef"],
                &["y"],
                SOURCE,
                HEADER,
                true,
            )
        },
        |kernel| {
            // Declared in the shape the caller reads (the kernel writes `[items, out]` row-major,
            // the same memory): a reshape after it would be one more operation in every step.
            kernel.apply(
                &[o.x, o.weight, o.scales, biases, &indices, &bias, &coef],
                &[(&shape, o.x.dtype())],
                (32, out / ROWS, items),
                (32, WARPS, 1),
                &template,
            )
        },
    )?;
    Ok(y.into_iter().next().expect("one output"))
}

/// How [`route`] turns the chosen experts' scores into weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalize {
    /// A softmax over every expert's score, kept for the top k (Qwen3-MoE without
    /// `norm_topk_prob`).
    All,
    /// A softmax over the top k scores alone (gpt-oss, Gemma 4; Qwen with `norm_topk_prob`,
    /// whose renormalised top k of the full softmax is the same).
    TopK,
}

/// The `k` largest of `logits` `[..., experts]` (float) and their weights, each `[..., k]`:
/// indices uint32 in descending order of score, weights in `logits`' dtype, each times
/// `scale[expert]` (`[experts]`) when given. With `shared` above 0, `logits`' last column is a
/// shared expert's gate score instead (`[..., experts + 1]`) and `shared` outputs follow the
/// top k (`[..., k + shared]`): experts `experts .. experts + shared`, each weighted by the
/// gate's sigmoid (a shared expert folded into the experts' stack in `shared` pieces). `Ok(None)`
/// where the kernel does not take it (no [`backend`], more than [`MAX_EXPERTS`] experts, `k`
/// above [`MAX_TOP_K`] or the experts, `shared` above [`MAX_SHARED`]).
pub fn route(
    logits: &Array,
    k: i32,
    normalize: Normalize,
    scale: Option<&Array>,
    shared: i32,
) -> Result<Option<(Array, Array)>, Exception> {
    let Some(&columns) = logits.shape().last() else {
        return Ok(None);
    };
    let experts = columns - (shared > 0) as i32;
    Ok(launch_route(
        RouterInput::Scores(logits),
        experts,
        (k, shared),
        normalize,
        scale,
    )?
    .map(|launched| launched.routed))
}

/// [`route`] of the router's scores `x W^T (+ bias)` computed in the same launch, for `x`
/// `[..., hidden]` and the router's dense weight `W` `[experts, hidden]` (`[experts + 1,
/// hidden]` with `shared`, its last row the shared expert's gate; and `bias` `[experts]`) in
/// `x`'s dtype: one launch a layer fewer at decode. `Ok(None)` where
/// [`route`] would refuse, for other dtypes, hidden sizes that are not a multiple of 8 or above
/// [`MAX_IN`], above [`MAX_ROUTER_TOKENS`] tokens (a prefill, whose scores are one GEMM), for
/// more than 128 scores (experts, and a shared expert's gate) or 8 experts a token, and for a
/// bias with a shared expert's gate.
pub fn route_from_hidden(
    x: &Array,
    (weight, bias): (&Array, Option<&Array>),
    k: i32,
    normalize: Normalize,
    scale: Option<&Array>,
    shared: i32,
) -> Result<Option<(Array, Array)>, Exception> {
    let Some(experts) = router_product_experts(x, (weight, bias), k, shared) else {
        return Ok(None);
    };
    Ok(launch_route(
        RouterInput::Hidden {
            x,
            weight,
            bias,
            add_norm: None,
        },
        experts,
        (k, shared),
        normalize,
        scale,
    )?
    .map(|routed| routed.routed))
}

/// The residual add and RMS norm before a sparse block (`crate::nn::norm_kernel`'s
/// `add_rms_norm`) and [`route_from_hidden`] of the normed sum, in one launch: `x`, `residual`
/// `[..., hidden]`, the norm's `norm_weight` `[hidden]` and `eps` → `(sum, normed)` `[...,
/// hidden]` and the routed `(indices, scores)`. One launch a sparse layer fewer at decode.
/// `Ok(None)` where either would refuse, with `PERCH_ROUTE_ADD_NORM=0` (benchmarks) or where
/// its own load check ([`add_norm_self_test`]) failed; the other expert kernels do not depend
/// on it.
#[allow(clippy::type_complexity)]
pub fn route_after_add_norm(
    (x, residual): (&Array, &Array),
    (norm_weight, eps): (&Array, f32),
    (weight, bias): (&Array, Option<&Array>),
    k: i32,
    normalize: Normalize,
    shared: i32,
) -> Result<Option<((Array, Array), (Array, Array))>, Exception> {
    if !route_add_norm_enabled() || add_norm_self_test().is_err() {
        return Ok(None);
    }
    launch_add_norm_route(&AddNormRoute {
        x,
        residual,
        norm_weight,
        eps,
        weight,
        bias,
        k,
        normalize,
        shared,
    })
}

/// [`route_after_add_norm`]'s operands (see there).
struct AddNormRoute<'a> {
    x: &'a Array,
    residual: &'a Array,
    norm_weight: &'a Array,
    eps: f32,
    weight: &'a Array,
    bias: Option<&'a Array>,
    k: i32,
    normalize: Normalize,
    shared: i32,
}

/// Whether the engine may use [`route_after_add_norm`]: not with `PERCH_ROUTE_ADD_NORM=0`
/// (benchmarks of the separate launches).
fn route_add_norm_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("PERCH_ROUTE_ADD_NORM").as_deref() != Ok("0"))
}

/// [`route_after_add_norm`] whatever its switch and load check say (the checks run it).
#[allow(clippy::type_complexity)]
fn launch_add_norm_route(
    route: &AddNormRoute,
) -> Result<Option<((Array, Array), (Array, Array))>, Exception> {
    let (x, residual, norm_weight) = (route.x, route.residual, route.norm_weight);
    let (weight, bias, k, shared) = (route.weight, route.bias, route.k, route.shared);
    if !crate::nn::norm_kernel::enabled()
        || !crate::nn::norm_kernel::computes(x, residual, norm_weight)
    {
        return Ok(None);
    }
    let Some(experts) = router_product_experts(x, (weight, bias), k, shared) else {
        return Ok(None);
    };
    let routed = launch_route(
        RouterInput::Hidden {
            x,
            weight,
            bias,
            add_norm: Some(AddNorm {
                residual,
                weight: norm_weight,
                eps: route.eps,
            }),
        },
        experts,
        (k, shared),
        route.normalize,
        None,
    )?;
    Ok(routed.map(|r| (r.normed.expect("asked for"), r.routed)))
}

/// The routed experts of a router whose product [`route_from_hidden`] computes for `x`: `None`
/// where it refuses (see there).
fn router_product_experts(
    x: &Array,
    (weight, bias): (&Array, Option<&Array>),
    k: i32,
    shared: i32,
) -> Option<i32> {
    let (Some(&hidden), [rows, width]) = (x.shape().last(), weight.shape()) else {
        return None;
    };
    let experts = rows - (shared > 0) as i32;
    let fits = *width == hidden
        && hidden > 0
        && hidden % 8 == 0
        && hidden <= MAX_IN
        && *rows <= MAX_ROUTER_PRODUCT_EXPERTS
        && k <= MAX_ROUTER_PRODUCT_TOP_K
        && weight.dtype() == x.dtype()
        && x.size() / hidden as usize <= MAX_ROUTER_TOKENS
        && bias.is_none_or(|b| shared == 0 && b.shape() == [experts] && is_float(b.dtype()));
    fits.then_some(experts)
}

/// The most tokens [`route_from_hidden`] takes: each block reads the router's whole weight,
/// which pays against a separate GEMM's launch at decode only.
pub const MAX_ROUTER_TOKENS: usize = 256;
/// The most experts and experts a token [`route_from_hidden`] takes: its blocks are 1,024
/// threads, which CUDA launches only while the kernel needs at most 64 registers a thread, and
/// the picking warp's registers grow with both (checked on a GPU up to 128 and 8; larger
/// routers take the router's GEMM and [`route`]).
const MAX_ROUTER_PRODUCT_EXPERTS: i32 = 128;
/// The most pieces of a shared expert [`route`] appends to a token's experts.
pub const MAX_SHARED: i32 = 8;
const MAX_ROUTER_PRODUCT_TOP_K: i32 = 8;

/// What [`launch_route`] reads a token's scores from.
enum RouterInput<'a> {
    /// `[..., experts]`.
    Scores(&'a Array),
    /// `x` `[..., hidden]`, the scores `x W^T (+ bias)`; with `add_norm`, of `x + residual`
    /// normed ([`route_after_add_norm`]).
    Hidden {
        x: &'a Array,
        weight: &'a Array,
        bias: Option<&'a Array>,
        add_norm: Option<AddNorm<'a>>,
    },
}

/// The residual and the RMS norm [`route_after_add_norm`] applies to the router's input first.
struct AddNorm<'a> {
    residual: &'a Array,
    weight: &'a Array,
    eps: f32,
}

/// What [`launch_route`] gives: the routed `(indices, scores)`, and with [`AddNorm`] the `(sum,
/// normed)` it wrote first.
struct Launched {
    routed: (Array, Array),
    normed: Option<(Array, Array)>,
}

/// `logits` `[..., experts + 1]` (`shared` above 0: the last column a shared expert's gate
/// score, as [`route`] reads it) → the experts' scores `[..., experts]` and the gate's `[..., 1]`;
/// `logits` itself and `None` when `shared` is 0.
pub fn split_shared_gate(logits: &Array, shared: i32) -> Result<(Array, Option<Array>), Exception> {
    if shared == 0 {
        return Ok((logits.clone(), None));
    }
    let experts = *logits.shape().last().expect("a scores axis") - 1;
    let mut parts = logits.split_at_indices(&[experts], -1)?.into_iter();
    let (routed, gate) = (parts.next(), parts.next());
    Ok((routed.expect("two parts"), gate))
}

/// What [`route`] appends with `shared`, in MLX's operations: a token's top k (`indices` of
/// `experts` experts and `weights`, `[..., k]`) followed by experts `experts .. experts +
/// shared`, each weighted by the sigmoid of the shared expert's gate score `gate` `[..., 1]`
/// (in its dtype, as mlx_lm's `sigmoid(shared_expert_gate(x))`) → `[..., k + shared]` each.
pub fn append_shared(
    (indices, weights): (Array, Array),
    gate: &Array,
    (experts, shared): (i32, i32),
) -> Result<(Array, Array), Exception> {
    let lead = &indices.shape()[..indices.ndim() - 1];
    let shape = [lead, &[shared]].concat();
    let pieces =
        Array::from_iter(experts..experts + shared, &[shared]).as_dtype(indices.dtype())?;
    let pieces = ops::broadcast_to(&pieces, &shape)?;
    let weight = ops::sigmoid(gate)?.as_dtype(weights.dtype())?;
    let weight = ops::broadcast_to(&weight, &shape)?;
    Ok((
        ops::concatenate(&[indices, pieces], -1)?,
        ops::concatenate(&[weights, weight], -1)?,
    ))
}

/// Warps a block computing scores ([`RouterInput::Hidden`]): each takes every 32nd expert.
/// [`ADD_NORM_PROLOGUE`] counts on 32 (1,024 threads).
const ROUTER_WARPS: i32 = 32;
const _: () = assert!(ROUTER_WARPS == 32);

/// `experts`: the routed experts (the scores' columns, less the shared expert's gate when
/// `shared` is above 0).
fn launch_route(
    input: RouterInput,
    experts: i32,
    (k, shared): (i32, i32),
    normalize: Normalize,
    scale: Option<&Array>,
) -> Result<Option<Launched>, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
        static ADD_NORM_KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    let columns = experts + (shared > 0) as i32;
    let (lead, width) = match &input {
        RouterInput::Scores(logits) => (logits, columns),
        RouterInput::Hidden { x, weight, .. } => (x, weight.shape()[1]),
    };
    let Some(backend) = backend() else {
        return Ok(None);
    };
    let dtype = lead.dtype();
    let fits = (1..=MAX_EXPERTS).contains(&experts)
        && (1..=MAX_TOP_K.min(experts)).contains(&k)
        && (0..=MAX_SHARED).contains(&shared)
        && is_float(dtype)
        && lead.size() > 0
        && lead.size() / width as usize <= MAX_GRID_Z as usize
        && scale.is_none_or(|s| s.shape() == [experts] && is_float(s.dtype()));
    if !fits {
        return Ok(None);
    }
    let tokens = (lead.size() / width as usize) as i32;
    // The template names the leading input's dtype only (MLX keys compiled kernels by it): the
    // scale and the bias come in that dtype, unused inputs as the leading one.
    let in_dtype = |a: Option<&Array>| match a {
        Some(a) if a.dtype() != dtype => a.as_dtype(dtype),
        Some(a) => Ok(a.clone()),
        None => Ok((*lead).clone()),
    };
    let scaled = scale.is_some();
    let scale = in_dtype(scale)?;
    let (from_x, weight, bias, has_bias, add_norm) = match &input {
        RouterInput::Scores(_) => (false, (*lead).clone(), (*lead).clone(), false, None),
        RouterInput::Hidden {
            weight,
            bias,
            add_norm,
            ..
        } => (
            true,
            (*weight).clone(),
            in_dtype(*bias)?,
            bias.is_some(),
            add_norm.as_ref(),
        ),
    };
    let mut template = vec![
        TemplateArg::Dtype(c"T", dtype),
        TemplateArg::Int(c"E", experts),
        TemplateArg::Int(c"K", k),
        TemplateArg::Int(c"ALL", (normalize == Normalize::All) as i32),
        TemplateArg::Int(c"SCALED", scaled as i32),
        TemplateArg::Int(c"FROM_X", from_x as i32),
        TemplateArg::Int(c"H", if from_x { width } else { 1 }),
        TemplateArg::Int(c"HAS_BIAS", has_bias as i32),
        TemplateArg::Int(c"SHARED", shared),
    ];
    // `[tokens, k + shared]` row-major, declared in the input's leading shape (see
    // `gather_qmv`).
    let shape = lead.shape();
    let out_shape = [&shape[..shape.len() - 1], &[k + shared]].concat();
    let warps = if from_x { ROUTER_WARPS } else { 1 };
    let grid = (32, tokens * warps, 1);
    let out = match add_norm {
        None => with_kernel(
            &KERNEL,
            || {
                CustomKernel::new(
                    backend,
                    c"perch_route",
                    &["logits", "scale", "w", "bias"],
                    &["indices", "scores"],
                    ROUTE_SOURCE,
                    true,
                )
            },
            |kernel| {
                kernel.apply(
                    &[lead, &scale, &weight, &bias],
                    &[(&out_shape, Dtype::Uint32), (&out_shape, dtype)],
                    grid,
                    (32, warps, 1),
                    &template,
                )
            },
        )?,
        Some(norm) => {
            template.push(TemplateArg::Int(c"EPS_BITS", norm.eps.to_bits() as i32));
            with_kernel(
                &ADD_NORM_KERNEL,
                || {
                    CustomKernel::new(
                        backend,
                        c"perch_add_norm_route",
                        &["unnormed", "residual", "norm_w", "scale", "w", "bias"],
                        &["sum", "normed", "indices", "scores"],
                        &format!("{ADD_NORM_PROLOGUE}{ROUTE_SOURCE}"),
                        true,
                    )
                },
                |kernel| {
                    kernel.apply(
                        &[lead, norm.residual, norm.weight, &scale, &weight, &bias],
                        &[
                            (shape, dtype),
                            (shape, dtype),
                            (&out_shape, Dtype::Uint32),
                            (&out_shape, dtype),
                        ],
                        grid,
                        (32, warps, 1),
                        &template,
                    )
                },
            )?
        }
    };
    let mut out = out.into_iter();
    let mut next = || out.next().expect("the kernel's outputs");
    let normed = add_norm.map(|_| (next(), next()));
    Ok(Some(Launched {
        routed: (next(), next()),
        normed,
    }))
}

/// Whether the engine uses [`gather_qmv`] and [`route`]: on CUDA ([`backend`]) once they have
/// passed [`self_test`] (asked at model load).
pub fn usable() -> bool {
    backend().is_some() && self_test().is_ok()
}

/// The small check behind [`usable`], once per process: decode-shaped cases of each format
/// (affine 4-bit, affine 8-bit, MXFP4; a row per token and a row per pair) and each epilogue
/// against MLX's `gather_qmm` and operations, and the router against MLX's top k and softmax.
/// `Err` says why the kernels are not used.
pub fn self_test() -> &'static Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(|| {
        if backend().is_none() {
            return Err("not on CUDA, or PERCH_EXPERT_KERNEL=0".into());
        }
        for case in &CASES[..SELF_TEST_CASES] {
            let run = Case::run(case).map_err(|e| e.to_string())?;
            within(case.name, run.error, case.tolerance)?;
        }
        for case in &ROUTE_CASES[..SELF_TEST_ROUTES] {
            let run = RouteCase::run(case).map_err(|e| e.to_string())?;
            within(case.name, run.error, case.tolerance)?;
        }
        // Its result gates only the add-and-norm router; asked here so that it runs at load.
        let _ = add_norm_self_test();
        Ok(())
    })
}

/// The load check of [`route_after_add_norm`] alone, once per process: the first
/// [`ADD_NORM_ROUTES`] case (not timed). `Err` says why the one launch is not used (the
/// separate add-and-norm and router launches are); it needs the norm kernel, and
/// `PERCH_ROUTE_ADD_NORM=0` skips it.
fn add_norm_self_test() -> &'static Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(|| {
        if backend().is_none() || !crate::nn::norm_kernel::enabled() || !route_add_norm_enabled() {
            return Err("not on CUDA, or a kernel it needs is switched off".into());
        }
        let spec = &ADD_NORM_ROUTES[0];
        let (error, tolerance, _) = add_norm_route_case(spec, false).map_err(|e| e.to_string())?;
        within(spec.name, error, tolerance)
    })
}

/// What a check case's product does after the gather ([`Epilogue`]).
#[derive(Clone, Copy)]
enum Kind {
    /// `x` a row per token (`false`) or per pair.
    Plain(bool),
    Gated(Activation),
    Weighted,
}

/// A check case: `tokens` tokens of `k` experts each out of `experts`, `(in, out)` features
/// (`out` each for the gate and the up projection when gated); `bias`: the experts have one.
struct CaseSpec {
    name: &'static str,
    tokens: i32,
    k: i32,
    experts: i32,
    features: (i32, i32),
    params: QuantParams,
    kind: Kind,
    bias: bool,
    dtype: Dtype,
    tolerance: f32,
}

const fn affine(bits: i32, group_size: i32) -> QuantParams {
    QuantParams {
        group_size,
        bits,
        mode: QuantMode::Affine,
    }
}

const MXFP4: QuantParams = QuantParams {
    group_size: 32,
    bits: 4,
    mode: QuantMode::Mxfp4,
};

/// The first cases, small and in float32, are also the load check's.
const SELF_TEST_CASES: usize = 9;

const fn case(
    name: &'static str,
    (tokens, k, experts): (i32, i32, i32),
    features: (i32, i32),
    params: QuantParams,
    (kind, bias): (Kind, bool),
    dtype: Dtype,
) -> CaseSpec {
    CaseSpec {
        name,
        tokens,
        k,
        experts,
        features,
        params,
        kind,
        bias,
        dtype,
        tolerance: match dtype {
            Dtype::Float32 => 1e-3,
            _ => 5e-2,
        },
    }
}

const F32: Dtype = Dtype::Float32;
const BF16: Dtype = Dtype::Bfloat16;

const CASES: [CaseSpec; 15] = [
    case(
        "affine 4-bit g64, 2 tokens × 4 of 8 experts, 256 → 64",
        (2, 4, 8),
        (256, 64),
        affine(4, 64),
        (Kind::Plain(false), false),
        F32,
    ),
    case(
        "affine 8-bit g32, a row per pair, 3 tokens × 2 of 4 experts, 128 → 32",
        (3, 2, 4),
        (128, 32),
        affine(8, 32),
        (Kind::Plain(true), false),
        F32,
    ),
    case(
        "MXFP4 with biases, 2 tokens × 2 of 4 experts, 128 → 32",
        (2, 2, 4),
        (128, 32),
        MXFP4,
        (Kind::Plain(false), true),
        F32,
    ),
    case(
        "affine 4-bit g64 gated SiLU, 2 tokens × 4 of 8 experts, 256 → 2 × 32",
        (2, 4, 8),
        (256, 32),
        affine(4, 64),
        (Kind::Gated(Activation::Silu), false),
        F32,
    ),
    case(
        "affine 8-bit g128 gated GELU, 2 tokens × 2 of 4 experts, 256 → 2 × 16",
        (2, 2, 4),
        (256, 16),
        affine(8, 128),
        (Kind::Gated(Activation::GeluApprox), false),
        F32,
    ),
    case(
        "MXFP4 with biases gated clamped SwiGLU, 3 tokens × 2 of 4 experts, 128 → 2 × 32",
        (3, 2, 4),
        (128, 32),
        MXFP4,
        (Kind::Gated(Activation::SwigluOai), true),
        F32,
    ),
    case(
        "affine 4-bit g32 with biases weighted, 3 tokens × 4 of 8 experts, 128 → 32",
        (3, 4, 8),
        (128, 32),
        affine(4, 32),
        (Kind::Weighted, true),
        F32,
    ),
    case(
        "affine 4-bit g64 gated SiLU, 12 tokens × 4 of 8 experts (6 pairs an expert), 256 → 2 × \
         32",
        (12, 4, 8),
        (256, 32),
        affine(4, 64),
        (Kind::Gated(Activation::Silu), false),
        F32,
    ),
    case(
        "MXFP4 with biases weighted, 12 tokens × 4 of 8 experts (6 pairs an expert), 128 → 32",
        (12, 4, 8),
        (128, 32),
        MXFP4,
        (Kind::Weighted, true),
        F32,
    ),
    case(
        "qwen3_moe gate+up gated, 16 rows × 8 of 64 experts, 1024 → 2 × 256, 4-bit g64",
        (16, 8, 64),
        (1024, 256),
        affine(4, 64),
        (Kind::Gated(Activation::Silu), false),
        BF16,
    ),
    case(
        "qwen3_moe down weighted, 16 rows × 8 of 64 experts, 256 → 1024, 4-bit g64",
        (16, 8, 64),
        (256, 1024),
        affine(4, 64),
        (Kind::Weighted, false),
        BF16,
    ),
    case(
        "qwen3_moe gate+up gated, 128 rows × 8 of 64 experts, 1024 → 2 × 256, 4-bit g64",
        (128, 8, 64),
        (1024, 256),
        affine(4, 64),
        (Kind::Gated(Activation::Silu), false),
        BF16,
    ),
    case(
        "gpt_oss gate+up gated, 32 rows × 4 of 32 experts, 1024 → 2 × 1024, MXFP4",
        (32, 4, 32),
        (1024, 1024),
        MXFP4,
        (Kind::Gated(Activation::SwigluOai), true),
        BF16,
    ),
    case(
        "gpt_oss down weighted, 32 rows × 4 of 32 experts, 1024 → 1024, MXFP4",
        (32, 4, 32),
        (1024, 1024),
        MXFP4,
        (Kind::Weighted, true),
        BF16,
    ),
    case(
        "gpt-oss-20b gate+up gated, 32 rows × 4 of 32 experts, 2880 → 2 × 2880, MXFP4",
        (32, 4, 32),
        (2880, 2880),
        MXFP4,
        (Kind::Gated(Activation::SwigluOai), true),
        BF16,
    ),
];

/// One random case through [`gather_qmv`] and MLX's `gather_qmm` and operations: the largest
/// |difference| relative to the largest |reference| value, and the operands kept for timing.
struct Case {
    error: f32,
    x: Array,
    weight: Array,
    scales: Array,
    biases: Option<Array>,
    indices: Array,
    bias: Option<Array>,
    scores: Array,
    params: QuantParams,
    kind: Kind,
}

impl Case {
    fn run(spec: &CaseSpec) -> crate::Result<Self> {
        use mlx_rs::random::{key, normal, randint, uniform};
        let (input, out) = spec.features;
        let rows = match spec.kind {
            Kind::Gated(_) => 2 * out,
            _ => out,
        };
        let p = spec.params;
        let words = input * p.bits / 32;
        let groups = input / p.group_size;
        let e = spec.experts;
        let seed = (spec.tokens * 131 + input + rows) as u64;
        let k = |i: u64| key(seed * 8 + i);
        let weight =
            crate::nn::custom_kernel::random_words(&[e, rows, words], (seed * 8, seed * 8 + 1))?;
        let (scales, biases) = match p.mode {
            QuantMode::Mxfp4 => (
                randint::<_, i32>(120, 130, &[e, rows, groups], Some(&k(2)?))?
                    .as_dtype(Dtype::Uint8)?,
                None,
            ),
            _ => {
                let scale = 1.0 / (1 << p.bits) as f32;
                let s = normal::<f32>(&[e, rows, groups], None, None, Some(&k(2)?))?
                    .multiply(Array::from_f32(scale))?
                    .as_dtype(spec.dtype)?;
                let b = normal::<f32>(&[e, rows, groups], None, None, Some(&k(3)?))?
                    .multiply(Array::from_f32(0.1))?
                    .as_dtype(spec.dtype)?;
                (s, Some(b))
            }
        };
        let indices = randint::<_, i32>(0, e, &[spec.tokens, spec.k], Some(&k(4)?))?
            .as_dtype(Dtype::Uint32)?;
        let per_pair = matches!(spec.kind, Kind::Plain(true) | Kind::Weighted);
        let x_shape = [spec.tokens, if per_pair { spec.k } else { 1 }, 1, input];
        let x = normal::<f32>(&x_shape, None, None, Some(&k(5)?))?.as_dtype(spec.dtype)?;
        let bias = spec
            .bias
            .then(|| -> crate::Result<Array> {
                Ok(normal::<f32>(&[e, rows], None, None, Some(&k(6)?))?.as_dtype(spec.dtype)?)
            })
            .transpose()?;
        let scores = uniform::<_, f32>(0.0, 1.0, &[spec.tokens, spec.k], Some(&k(7)?))?
            .as_dtype(spec.dtype)?;
        let case = Self {
            error: 0.0,
            x,
            weight,
            scales,
            biases,
            indices,
            bias,
            scores,
            params: p,
            kind: spec.kind,
        };
        let error = relative_error(&case.kernel()?, &case.mlx()?)?;
        Ok(Self { error, ..case })
    }

    fn kernel(&self) -> crate::Result<Array> {
        Ok(gather_qmv(&Operands {
            x: &self.x,
            weight: &self.weight,
            scales: &self.scales,
            biases: self.biases.as_ref(),
            indices: &self.indices,
            params: self.params,
            bias: self.bias.as_ref(),
            epilogue: match self.kind {
                Kind::Plain(_) => Epilogue::Plain,
                Kind::Gated(activation) => Epilogue::Gated(activation),
                Kind::Weighted => Epilogue::Weighted(&self.scores),
            },
            per_token: false,
        })?)
    }

    /// The same through MLX: `gather_qmm`, the bias, then the activation or the weighted sum.
    fn mlx(&self) -> crate::Result<Array> {
        let p = self.params;
        let y = crate::nn::mlx_ext::gather_qmm(
            &self.x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            &self.indices,
            p.sizes(),
            p.mode.mlx_name(),
            false,
        )?;
        let y = match &self.bias {
            Some(bias) => ops::add(&y, &bias.take_axis(&self.indices, 0)?.expand_dims(-2)?)?,
            None => y,
        };
        Ok(match self.kind {
            Kind::Plain(_) => y,
            Kind::Gated(activation) => {
                let (gate, up) = crate::nn::layers::halves(&y)?;
                activation.gated(&gate, &up)?
            }
            Kind::Weighted => {
                ops::multiply(&y.squeeze_axes(&[-2])?, &self.scores.expand_dims(-1)?)?
                    .sum_axis(1, false)?
            }
        })
    }
}

/// A router check case: `tokens` tokens' scores over `experts`, the top `k` kept; with `hidden`
/// the scores are computed in the kernel from an input of `hidden` features
/// ([`route_from_hidden`]), with a router bias when `bias`.
struct RouteSpec {
    name: &'static str,
    tokens: i32,
    experts: i32,
    k: i32,
    normalize: Normalize,
    scaled: bool,
    hidden: Option<(i32, bool)>,
    dtype: Dtype,
    tolerance: f32,
    /// Pieces of a shared expert after the top k ([`route`]'s `shared`).
    shared: i32,
}

/// The first are also the load check's.
const SELF_TEST_ROUTES: usize = 4;

const fn route_case(
    name: &'static str,
    (tokens, experts, k): (i32, i32, i32),
    normalize: Normalize,
    scaled: bool,
    hidden: Option<(i32, bool)>,
    dtype: Dtype,
) -> RouteSpec {
    RouteSpec {
        name,
        tokens,
        experts,
        k,
        normalize,
        scaled,
        hidden,
        dtype,
        tolerance: match dtype {
            Dtype::Float32 => 1e-5,
            _ => 2e-2,
        },
        shared: 0,
    }
}

const ROUTE_CASES: [RouteSpec; 11] = [
    route_case(
        "router, 3 tokens, top 4 of 40 experts, softmax over all",
        (3, 40, 4),
        Normalize::All,
        false,
        None,
        F32,
    ),
    route_case(
        "router, 5 tokens, top 2 of 8 experts, softmax over the top, scaled",
        (5, 8, 2),
        Normalize::TopK,
        true,
        None,
        F32,
    ),
    route_case(
        "router with its product and bias, 4 tokens, top 4 of 40 experts, 128 features",
        (4, 40, 4),
        Normalize::TopK,
        false,
        Some((128, true)),
        F32,
    ),
    RouteSpec {
        shared: 2,
        ..route_case(
            "router with its product and a shared expert in 2 pieces, 4 tokens, top 4 of 40 \
             experts, 128 features",
            (4, 40, 4),
            Normalize::TopK,
            false,
            Some((128, false)),
            F32,
        )
    },
    route_case(
        "qwen3_moe router, 32 rows, top 8 of 128 experts",
        (32, 128, 8),
        Normalize::TopK,
        false,
        None,
        BF16,
    ),
    route_case(
        "router, 128 rows, top 10 of 256 experts, softmax over all",
        (128, 256, 10),
        Normalize::All,
        false,
        None,
        BF16,
    ),
    route_case(
        "qwen3_moe router with its product, 32 rows, top 8 of 128 experts, 2048 features",
        (32, 128, 8),
        Normalize::All,
        false,
        Some((2048, false)),
        BF16,
    ),
    route_case(
        "gpt_oss router with its product and bias, 32 rows, top 4 of 32 experts, 2880 features",
        (32, 32, 4),
        Normalize::TopK,
        false,
        Some((2880, true)),
        BF16,
    ),
    route_case(
        "gemma4 router with its product, scaled, 32 rows, top 8 of 128 experts, 2816 features",
        (32, 128, 8),
        Normalize::TopK,
        true,
        Some((2816, false)),
        BF16,
    ),
    RouteSpec {
        shared: 2,
        ..route_case(
            "qwen3_5_moe router with its product and a shared expert in 2 pieces, 32 rows, top 8 \
             of 64 experts, 1024 features",
            (32, 64, 8),
            Normalize::TopK,
            false,
            Some((1024, false)),
            BF16,
        )
    },
    RouteSpec {
        shared: 1,
        ..route_case(
            "router with a shared expert, 128 rows, top 10 of 256 experts, softmax over all",
            (128, 256, 10),
            Normalize::All,
            false,
            None,
            BF16,
        )
    },
];

/// One random router case through [`route`] (or [`route_from_hidden`]) and MLX's operations
/// (product, softmax, top k, softmax), compared as each token's weights scattered over its
/// experts.
struct RouteCase {
    error: f32,
    logits: Array,
    /// `x`, `W` and the bias, when the kernel computes the scores.
    hidden: Option<(Array, Array, Option<Array>)>,
    scale: Option<Array>,
    k: i32,
    normalize: Normalize,
    shared: i32,
}

impl RouteCase {
    fn run(spec: &RouteSpec) -> crate::Result<Self> {
        use mlx_rs::random::{key, normal, uniform};
        let (t, e) = (spec.tokens, spec.experts);
        let columns = e + (spec.shared > 0) as i32;
        let k = |i: u64| key((t * 1009 + e) as u64 * 4 + i);
        // Distinct scores (a permutation of multiples of 1/16, exact in bfloat16), so the top k
        // has no ties to break either way; a shared expert's gate score (the last column)
        // moved to either side of 0.
        let order =
            ops::argsort_axis(&normal::<f32>(&[t, columns], None, None, Some(&k(0)?))?, -1)?;
        let logits = ops::multiply(&order.as_dtype(F32)?, Array::from_f32(1.0 / 16.0))?;
        let logits = match spec.shared {
            0 => logits,
            _ => {
                let shift = Array::from_iter(
                    (0..columns).map(|c| {
                        if c == e {
                            (columns / 2) as f32 / 16.0
                        } else {
                            0.0
                        }
                    }),
                    &[columns],
                );
                ops::subtract(&logits, &shift)?
            }
        };
        let scale = spec
            .scaled
            .then(|| uniform::<_, f32>(0.5, 2.0, &[e], Some(&k(1).unwrap())))
            .transpose()?
            .map(|s| s.as_dtype(spec.dtype))
            .transpose()?;
        let hidden = match spec.hidden {
            Some((h, bias)) => Some(exact_product(&logits, h, bias, spec.dtype)?),
            None => None,
        };
        let case = Self {
            error: 0.0,
            logits: logits.as_dtype(spec.dtype)?,
            hidden,
            scale,
            k: spec.k,
            normalize: spec.normalize,
            shared: spec.shared,
        };
        let (ours, reference) = (case.kernel()?, case.mlx()?);
        let dense = |(indices, scores): (Array, Array)| -> crate::Result<Array> {
            let outputs = e + spec.shared;
            let experts = Array::from_iter(0..outputs, &[outputs]);
            let hot = ops::eq(&indices.as_dtype(Dtype::Int32)?.expand_dims(-1)?, &experts)?;
            Ok(
                ops::multiply(&hot.as_dtype(F32)?, &scores.as_dtype(F32)?.expand_dims(-1)?)?
                    .sum_axis(-2, false)?,
            )
        };
        let error = relative_error(&dense(ours)?, &dense(reference)?)?;
        Ok(Self { error, ..case })
    }

    fn kernel(&self) -> crate::Result<(Array, Array)> {
        let routed = match &self.hidden {
            Some((x, w, b)) => route_from_hidden(
                x,
                (w, b.as_ref()),
                self.k,
                self.normalize,
                self.scale.as_ref(),
                self.shared,
            )?,
            None => route(
                &self.logits,
                self.k,
                self.normalize,
                self.scale.as_ref(),
                self.shared,
            )?,
        };
        routed
            .ok_or_else(|| crate::EngineError::Kernel("the router kernel refused its case".into()))
    }

    fn mlx(&self) -> crate::Result<(Array, Array)> {
        let logits = match &self.hidden {
            Some((x, w, Some(b))) => ops::addmm(b, x, w.t(), None, None)?,
            Some((x, w, None)) => ops::matmul(x, w.t())?,
            None => self.logits.clone(),
        };
        let (logits, gate) = split_shared_gate(&logits, self.shared)?;
        let (indices, scores) = match self.normalize {
            Normalize::All => {
                let probabilities = ops::softmax_axis(&logits, -1, true)?;
                crate::nn::mlx_ext::top_k(&probabilities, self.k)?
            }
            Normalize::TopK => {
                let (indices, top) = crate::nn::mlx_ext::top_k(&logits, self.k)?;
                (indices, ops::softmax_axis(&top, -1, true)?)
            }
        };
        let scores = match &self.scale {
            Some(scale) => ops::multiply(&scores, &scale.take(&indices)?)?,
            None => scores,
        };
        match gate {
            Some(gate) => {
                let experts = *self.logits.shape().last().expect("scores") - 1;
                Ok(append_shared(
                    (indices, scores),
                    &gate,
                    (experts, self.shared),
                )?)
            }
            None => Ok((indices, scores)),
        }
    }
}

/// A [`route_after_add_norm`] check case: `tokens` rows of `hidden` features, top `k` of
/// `experts`, a router bias or none.
struct AddNormRouteSpec {
    name: &'static str,
    tokens: i32,
    hidden: i32,
    experts: i32,
    k: i32,
    normalize: Normalize,
    bias: bool,
}

/// The first is also the load check's.
const ADD_NORM_ROUTES: [AddNormRouteSpec; 2] = [
    AddNormRouteSpec {
        name: "add, norm and router (qwen3_moe), 32 rows, top 8 of 128 experts, 1024 features",
        tokens: 32,
        hidden: 1024,
        experts: 128,
        k: 8,
        normalize: Normalize::TopK,
        bias: false,
    },
    AddNormRouteSpec {
        name: "add, norm and router with its bias (gpt_oss), 32 rows, top 4 of 32 experts, 2880 \
               features",
        tokens: 32,
        hidden: 2880,
        experts: 32,
        k: 4,
        normalize: Normalize::TopK,
        bias: true,
    },
];

/// One random [`AddNormRouteSpec`] case in bfloat16, and the kernel's time and MLX's (its add, its
/// `rms_norm`, the router's product, then [`route`]): the sum must equal MLX's add, the normed
/// sum be within a unit in the last place of MLX's `rms_norm` (largest output), and the routing
/// equal [`route_from_hidden`]'s of the kernel's own normed sum (the same product, so the
/// same experts and weights). Returns the norm's error (NaN when the sum or the routing
/// differs), its tolerance and, when `timed`, the two times in ms.
#[allow(clippy::type_complexity)]
fn add_norm_route_case(
    spec: &AddNormRouteSpec,
    timed: bool,
) -> crate::Result<(f32, f32, Option<(f64, f64)>)> {
    use crate::nn::custom_kernel::{max_abs_error, unit_in_last_place};
    use mlx_rs::random::{key, normal};
    let (t, h, e) = (spec.tokens, spec.hidden, spec.experts);
    let k = |i: u64| key((t * 7919 + h) as u64 * 8 + i);
    let normal = |shape: &[i32], std: f32, i: u64| -> crate::Result<Array> {
        Ok(normal::<f32>(shape, None, Some(std), Some(&k(i)?))?.as_dtype(BF16)?)
    };
    let (x, residual) = (normal(&[t, 1, h], 4.0, 0)?, normal(&[t, 1, h], 1.0, 1)?);
    let norm_weight = normal(&[h], 0.5, 2)?;
    let weight = normal(&[e, h], 0.05, 3)?;
    let bias = spec.bias.then(|| normal(&[e], 0.1, 4)).transpose()?;
    let eps = 1e-5;
    let ours = || {
        launch_add_norm_route(&AddNormRoute {
            x: &x,
            residual: &residual,
            norm_weight: &norm_weight,
            eps,
            weight: &weight,
            bias: bias.as_ref(),
            k: spec.k,
            normalize: spec.normalize,
            shared: 0,
        })?
        .ok_or_else(|| crate::EngineError::Kernel(format!("{}: refused", spec.name)))
    };
    let ((sum, normed), (indices, scores)) = ours()?;
    let expected_sum = ops::add(&x, &residual)?;
    let expected = mlx_rs::fast::rms_norm(&expected_sum, Some(&norm_weight), eps)?;
    let (alone_indices, alone_scores) = route_from_hidden(
        &normed,
        (&weight, bias.as_ref()),
        spec.k,
        spec.normalize,
        None,
        0,
    )?
    .ok_or_else(|| crate::EngineError::Kernel(format!("{}: refused", spec.name)))?;
    let same_routing = ops::array_eq(&indices, &alone_indices, None)?.item_exact::<bool>()
        && ops::array_eq(&scores, &alone_scores, None)?.item_exact::<bool>();
    let largest = ops::abs(&expected.as_dtype(F32)?)?
        .max(None)?
        .item_exact::<f32>();
    let tolerance = largest * unit_in_last_place(BF16);
    let norm_error = max_abs_error(&normed, &expected)?;
    let error = match max_abs_error(&sum, &expected_sum)? == 0.0 && same_routing {
        true => norm_error,
        false => f32::NAN,
    };
    if !timed {
        return Ok((error, tolerance, None));
    }
    let ours_ms = time_call(&|| Ok(ours()?.1 .1))?;
    let mlx_ms = time_call(&|| {
        let normed = mlx_rs::fast::rms_norm(&ops::add(&x, &residual)?, Some(&norm_weight), eps)?;
        let logits = match &bias {
            Some(b) => ops::addmm(b, &normed, weight.t(), None, None)?,
            None => ops::matmul(&normed, weight.t())?,
        };
        let routed = route(&logits, spec.k, spec.normalize, None, 0)?;
        Ok(routed.expect("the router kernel takes it").1)
    })?;
    Ok((error, tolerance, Some((ours_ms, mlx_ms))))
}

/// An input `x` `[tokens, hidden]`, a weight `W` `[experts, hidden]` and (with `bias`) a bias
/// `[experts]` in `dtype` whose product `x W^T + b` is exactly `logits` `[tokens, experts]`
/// (multiples of 1/16 below 16), however its sums are ordered: `x`'s row `t` is the unit vector
/// `t` then small integers `r` twice (`[1_t | r | r]`), `W`'s row `e` is that expert's column of
/// `logits − b` then multiples of 1/16 `z` and `−z` (`[l_e − b_e | z | −z]`), so the `r·z` terms
/// cancel exactly, every partial sum a multiple of 1/16 well within float32's precision.
fn exact_product(
    logits: &Array,
    hidden: i32,
    bias: bool,
    dtype: Dtype,
) -> crate::Result<(Array, Array, Option<Array>)> {
    let [tokens, experts] = logits.shape() else {
        return Err(crate::EngineError::Kernel(
            "router logits must be 2-D".into(),
        ));
    };
    let (tokens, experts) = (*tokens, *experts);
    let half = (hidden - tokens) / 2;
    if half < 1 || tokens + 2 * half != hidden {
        return Err(crate::EngineError::Kernel(format!(
            "a router case of {hidden} features takes an even number above {tokens} tokens"
        )));
    }
    // A fixed small-integer sequence (a linear congruential generator's high bits) in −3..=3.
    let mut state = (tokens * 7919 + experts * 104_729 + hidden) as u32;
    let mut small = move || {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        ((state >> 24) % 7) as f32 - 3.0
    };
    let r: Vec<f32> = (0..tokens * half).map(|_| small()).collect();
    let z: Vec<f32> = (0..experts * half).map(|_| small() / 16.0).collect();
    let b: Vec<f32> = (0..experts)
        .map(|_| if bias { (small() + 3.0) / 16.0 } else { 0.0 })
        .collect();
    let l = logits.as_dtype(F32)?;
    l.eval()?;
    let l = l.as_slice::<f32>().to_vec();
    let (t, e, h, m) = (
        tokens as usize,
        experts as usize,
        hidden as usize,
        half as usize,
    );
    let mut x = vec![0f32; t * h];
    for row in 0..t {
        x[row * h + row] = 1.0;
        for j in 0..m {
            x[row * h + t + j] = r[row * m + j];
            x[row * h + t + m + j] = r[row * m + j];
        }
    }
    let mut w = vec![0f32; e * h];
    for expert in 0..e {
        for row in 0..t {
            w[expert * h + row] = l[row * e + expert] - b[expert];
        }
        for j in 0..m {
            w[expert * h + t + j] = z[expert * m + j];
            w[expert * h + t + m + j] = -z[expert * m + j];
        }
    }
    let x = Array::from_slice(&x, &[tokens, hidden]).as_dtype(dtype)?;
    let w = Array::from_slice(&w, &[experts, hidden]).as_dtype(dtype)?;
    let b = match bias {
        true => Some(Array::from_slice(&b, &[experts]).as_dtype(dtype)?),
        false => None,
    };
    Ok((x, w, b))
}

/// Checks [`gather_qmv`] against MLX's `gather_qmm` (with the same bias, activation or weighted
/// sum) on random operands of each format and of the experts' shapes at decode, and [`route`]
/// against MLX's softmax and top k, with each one's time a call: one line per case, an error at
/// the first case outside its tolerance (relative to the largest reference value). CUDA only
/// (`perch check-kernels` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    if backend().is_none() {
        return Err(crate::EngineError::Request(
            "the experts' kernels run on MLX's CUDA backend, with PERCH_EXPERT_KERNEL unset".into(),
        ));
    }
    let mut lines = Vec::new();
    let report = |name: &str, dtype: Dtype, (error, tolerance): (f32, f32), ours, mlx| {
        let line = format!(
            "experts' kernels, {name}, {dtype:?}: relative error {error:.2e} (tolerance \
             {tolerance:.0e}); {ours:.3} ms a call against MLX's {mlx:.3}"
        );
        if error.is_nan() || error > tolerance {
            return Err(crate::EngineError::Kernel(line));
        }
        Ok(line)
    };
    for spec in &CASES {
        let case = Case::run(spec)?;
        let ours = time_call(&|| case.kernel())?;
        let mlx = time_call(&|| case.mlx())?;
        lines.push(report(
            spec.name,
            spec.dtype,
            (case.error, spec.tolerance),
            ours,
            mlx,
        )?);
    }
    for spec in &ROUTE_CASES {
        let case = RouteCase::run(spec)?;
        let ours = time_call(&|| Ok(case.kernel()?.1))?;
        let mlx = time_call(&|| Ok(case.mlx()?.1))?;
        lines.push(report(
            spec.name,
            spec.dtype,
            (case.error, spec.tolerance),
            ours,
            mlx,
        )?);
    }
    for spec in &ADD_NORM_ROUTES {
        let (error, tolerance, times) = add_norm_route_case(spec, true)?;
        let (ours, mlx) = times.expect("timed");
        lines.push(report(spec.name, BF16, (error, tolerance), ours, mlx)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::{
        affine, backend, exact_product, route, route_from_hidden, takes, Epilogue, Normalize,
        Operands, MXFP4,
    };
    use crate::nn::layers::Activation;

    use crate::nn::custom_kernel::zeros;

    /// The operands of one product as the experts give them: `tokens` tokens of `k` experts,
    /// `x` a row per token (`[tokens, 1, 1, in]`) or per pair (`[tokens, k, 1, in]`), `(in, out)`
    /// features, affine `bits` (or MXFP4) in bfloat16.
    fn accepts(
        (tokens, k, per_pair): (i32, i32, bool),
        (input, out): (i32, i32),
        bits: i32,
        mxfp4: bool,
    ) -> Option<i32> {
        let x_shape = [tokens, if per_pair { k } else { 1 }, 1, input];
        operands(
            &x_shape,
            &[tokens, k],
            (input, out),
            bits,
            mxfp4,
            Dtype::Bfloat16,
        )
    }

    fn operands(
        x_shape: &[i32],
        indices_shape: &[i32],
        (input, out): (i32, i32),
        bits: i32,
        mxfp4: bool,
        scale_dtype: Dtype,
    ) -> Option<i32> {
        let params = if mxfp4 { MXFP4 } else { affine(bits, 64) };
        let groups = input / params.group_size;
        let x = zeros(x_shape, Dtype::Bfloat16);
        let weight = zeros(&[8, out, input * bits / 32], Dtype::Uint32);
        let scales = zeros(
            &[8, out, groups],
            if mxfp4 { Dtype::Uint8 } else { scale_dtype },
        );
        let biases = zeros(&[8, out, groups], scale_dtype);
        let indices = zeros(indices_shape, Dtype::Uint32);
        Operands {
            x: &x,
            weight: &weight,
            scales: &scales,
            biases: (!mxfp4).then_some(&biases),
            indices: &indices,
            params,
            bias: None,
            epilogue: Epilogue::Plain,
            per_token: false,
        }
        .x_per_row()
    }

    /// The kernel takes the formats and shapes it computes, refuses the rest, and is never
    /// chosen on the CPU.
    #[test]
    fn takes_only_the_shapes_it_computes() {
        assert!(backend().is_none(), "no CUDA on this machine");
        // A row per token of 8 experts, a row per pair; MXFP4; 8-bit.
        assert_eq!(accepts((4, 8, false), (1024, 512), 4, false), Some(8));
        assert_eq!(accepts((4, 8, true), (256, 1024), 4, false), Some(1));
        assert_eq!(accepts((4, 4, false), (1024, 2048), 4, true), Some(4));
        assert_eq!(accepts((4, 4, false), (1024, 512), 8, false), Some(4));
        // Sorted pairs: a row each, flat.
        let sorted = operands(
            &[32, 1, 1024],
            &[32],
            (1024, 512),
            4,
            false,
            Dtype::Bfloat16,
        );
        assert_eq!(sorted, Some(1));
        // out not a multiple of 16; in over the staged width; bits MLX has but the kernel does
        // not; scales in another dtype than x (gather_qmm would promote).
        assert_eq!(accepts((4, 8, false), (1024, 520), 4, false), None);
        assert_eq!(accepts((4, 8, false), (8192, 512), 4, false), None);
        assert_eq!(accepts((4, 8, false), (1024, 512), 3, false), None);
        let float32_scales = operands(
            &[4, 1, 1, 1024],
            &[4, 8],
            (1024, 512),
            4,
            false,
            Dtype::Float32,
        );
        assert_eq!(float32_scales, None);
        // x's axes not those of the indices (a batch of k rows against [tokens, k]; rows
        // that do not divide the pairs).
        assert_eq!(
            operands(
                &[8, 1, 1024],
                &[4, 8],
                (1024, 512),
                4,
                false,
                Dtype::Bfloat16
            ),
            None
        );
        assert_eq!(
            operands(
                &[3, 1, 1, 1024],
                &[4, 8],
                (1024, 512),
                4,
                false,
                Dtype::Bfloat16
            ),
            None
        );
        // No pairs; more pairs than a grid takes.
        assert_eq!(accepts((0, 8, false), (1024, 512), 4, false), None);
        assert_eq!(accepts((8_750, 8, false), (1024, 512), 4, false), None);
        // The format and sizes alone (what the shared expert's fold asks).
        assert!(takes(affine(4, 64), 1024, 256));
        assert!(takes(MXFP4, 2880, 2880));
        assert!(!takes(affine(3, 64), 1024, 256));
        assert!(!takes(affine(4, 64), 1024, 250));
        assert!(!takes(affine(4, 64), 8192, 256));
        assert!(!takes(affine(4, 64), 1000, 256));
    }

    /// The epilogues' own conditions: gated weights of two halves, each a multiple of a block's
    /// features; weighted products a row per pair with a weight per pair; the experts' bias a
    /// row per expert.
    #[test]
    fn epilogues_take_only_their_shapes() {
        let params = affine(4, 64);
        let (tokens, k, input) = (4, 8, 256);
        let weight = |rows: i32| zeros(&[8, rows, input / 8], Dtype::Uint32);
        let groups = |rows: i32| zeros(&[8, rows, input / 64], Dtype::Bfloat16);
        let per_token = zeros(&[tokens, 1, 1, input], Dtype::Bfloat16);
        let per_pair = zeros(&[tokens, k, 1, input], Dtype::Bfloat16);
        let indices = zeros(&[tokens, k], Dtype::Uint32);
        let scores = zeros(&[tokens, k], Dtype::Bfloat16);
        let wrong_scores = zeros(&[tokens, k, 1], Dtype::Bfloat16);
        let operands = |x: &Array, rows: i32, bias: Option<&Array>, epilogue, per_token| {
            let (w, s, b) = (weight(rows), groups(rows), groups(rows));
            Operands {
                x,
                weight: &w,
                scales: &s,
                biases: Some(&b),
                indices: &indices,
                params,
                bias,
                epilogue,
                per_token,
            }
            .x_per_row()
        };
        let accepts =
            |x: &Array, rows: i32, bias, epilogue| operands(x, rows, bias, epilogue, false);
        let gated = Epilogue::Gated(Activation::Silu);
        assert_eq!(accepts(&per_token, 64, None, gated), Some(k));
        // Halves of 24 features: not a multiple of a block's 16.
        assert_eq!(accepts(&per_token, 48, None, gated), None);
        assert_eq!(
            accepts(&per_pair, 32, None, Epilogue::Weighted(&scores)),
            Some(1)
        );
        // A row per token, or weights of another shape.
        assert_eq!(
            accepts(&per_token, 32, None, Epilogue::Weighted(&scores)),
            None
        );
        assert_eq!(
            accepts(&per_pair, 32, None, Epilogue::Weighted(&wrong_scores)),
            None
        );
        let bias = zeros(&[8, 64], Dtype::Bfloat16);
        let short_bias = zeros(&[8, 32], Dtype::Bfloat16);
        assert_eq!(accepts(&per_token, 64, Some(&bias), gated), Some(k));
        assert_eq!(accepts(&per_token, 64, Some(&short_bias), gated), None);
        // A row per token without the unit axes `[tokens, in]`: only when asked for (the same
        // array broadcasts otherwise as gather_qmm's `[tokens, in]` matrix for every pair), and
        // never for a weighted product (a row per pair).
        let rows = zeros(&[tokens, input], Dtype::Bfloat16);
        assert_eq!(operands(&rows, 64, None, gated, true), Some(k));
        assert_eq!(operands(&rows, 64, None, gated, false), None);
        assert_eq!(
            operands(&rows, 32, None, Epilogue::Weighted(&scores), true),
            None
        );
    }

    /// The router's kernel is never chosen on the CPU: the engine keeps MLX's operations.
    #[test]
    fn router_kernel_only_on_cuda() {
        let logits = zeros(&[2, 1, 64], Dtype::Float32);
        assert!(route(&logits, 8, Normalize::TopK, None, 0)
            .unwrap()
            .is_none());
        let x = zeros(&[2, 1, 128], Dtype::Float32);
        let w = zeros(&[64, 128], Dtype::Float32);
        let routed = route_from_hidden(&x, (&w, None), 8, Normalize::TopK, None, 0).unwrap();
        assert!(routed.is_none());
    }

    /// The router check's operands give exactly the scores asked for (in bfloat16, with and
    /// without a bias), so the kernel and MLX see no ties either way.
    #[test]
    fn router_check_operands_multiply_exactly() {
        let order: Vec<f32> = (0..4 * 40).map(|i| ((i * 37) % 40) as f32 / 16.0).collect();
        let logits = Array::from_slice(&order, &[4, 40]);
        for bias in [false, true] {
            let (x, w, b) = exact_product(&logits, 128, bias, Dtype::Bfloat16).unwrap();
            assert_eq!(b.is_some(), bias);
            let x = x.as_dtype(Dtype::Float32).unwrap();
            let w = w.as_dtype(Dtype::Float32).unwrap();
            let mut product = mlx_rs::ops::matmul(&x, w.t()).unwrap();
            if let Some(b) = b {
                product = mlx_rs::ops::add(&product, b.as_dtype(Dtype::Float32).unwrap()).unwrap();
            }
            let product = product.as_dtype(Dtype::Bfloat16).unwrap();
            product.eval().unwrap();
            let got = product.as_dtype(Dtype::Float32).unwrap();
            got.eval().unwrap();
            assert_eq!(got.as_slice::<f32>(), &order[..], "bias {bias}");
        }
        // An odd number of features beside the tokens' unit vectors is refused.
        assert!(exact_product(&logits, 127, false, Dtype::Float32).is_err());
    }
}
