//! The core of a Gated DeltaNet layer (see `models::gated_delta`) over all of a pass's tokens in
//! one GPU kernel launch per layer, CUDA or Metal, written with MLX's custom-kernel API (through
//! [`crate::nn::custom_kernel`]): from the projected `qkv`, `a` and `b` and the layer's
//! two states to its output `y` and the states after the pass — the causal depthwise
//! convolution and its SiLU, the L2 normalisation of queries and keys, the gates `g` and `β`,
//! and the recurrence.
//!
//! Why: a decode step of a small hybrid model on a GPU is bound by launching its kernels (the
//! host), and the same work as separate operations is about a dozen kernels per layer
//! (concatenation, convolution, SiLU, two norms and their scales, the gates, the recurrence
//! step); as ops, a prefill chunk of `T` tokens is also `T` recurrence steps (mlx_lm's
//! `gated_delta_ops`, the form it runs on CPU and CUDA). mlx_lm fuses the recurrence with the
//! gates for Metal (`gated_delta_kernel`); SGLang and vLLM fuse the norms and gates into their
//! recurrent kernels the same way. MLX 0.32.2 has none for CUDA.
//!
//! One body serves both backends ([`BODY`]), after a prelude that names each one's thread
//! indices, shared memory, barriers, warp sums and math functions ([`CUDA_PRELUDE`],
//! [`METAL_PRELUDE`]: `simd_sum` is Metal's warp sum). The CUDA build is checked against the
//! operations on an NVIDIA GPU (`perch check-kernels`); the Metal build has not run on a Mac
//! here: the engine uses either only after it has passed a small check at model load
//! (`models::gated_delta`), and runs the operations otherwise.
//!
//! The computation, per row `n` and value head `h` of `value_heads`, key head `kh = h /
//! (value_heads / key_heads)`, for each token `t` in order (Yang, Kautz and Hatamizadeh 2024,
//! "Gated Delta Networks"; the normalisations and gates as mlx_lm's `qwen3_5.py`):
//! - convolution input `x(p)`: the conv state's entry `p` for `p < taps - 1`, else the pass's
//!   `qkv` at token `p - (taps - 1)`; channel `c`'s output `silu(Σ_j w[c, j] · x(t + j)[c])`;
//!   queries are channels `kh·dk ..`, keys `key_heads·dk + kh·dk ..`, values `2·key_heads·dk +
//!   h·dv ..`;
//! - `q ← q / (√dk · ‖q‖)`, `k ← k / ‖k‖` (each `‖·‖` with 1e-6 added under the root);
//! - `g = exp(neg_rate[h] · softplus(a + dt_bias[h]))`, `β = sigmoid(b)`; a padded token
//!   (`t ≥ counts[n]`) has `g = 1`, `β = 0` and leaves the state as it was;
//! - from the state `S [dv, dk]` (float32): `S ← g·S`, `m = S·k`, `S ← S + β·(v − m) ⊗ k`,
//!   `y = S·q`.
//!
//! The new conv state is `x(real) .. x(real + taps - 2)`, `real` the row's real tokens. A warp
//! owns four rows of `S` (`dv` indices), its lanes `dk / 32` components of each, in registers
//! for the whole pass; the dot products and the two norms per token are warp reductions. Four
//! warps (sixteen `dv` rows) make a block, which computes each token's queries and keys once
//! into shared memory for its rows.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{with_kernel, CustomKernel, TemplateArg};

/// Warps per thread block.
const WARPS_PER_BLOCK: i32 = 4;

/// State rows (`dv` indices) per warp for a pass of `tokens` tokens: a block computes each
/// token's queries and keys for `WARPS_PER_BLOCK` times as many rows, and a warp's loads for its
/// rows overlap. Four for a decode step (its blocks are many and short: fewer of them compute
/// the same queries and keys), two for a prefill pass (few rows of many tokens: more blocks keep
/// the GPU busy). On an H200 (`perch check-kernels`, see docs/benchmarks.md): 32 rows of one
/// token 0.214 ms with four against 0.295 with two; 2 rows of 300 tokens 1.158 ms with two
/// against 1.472 with four.
fn rows_per_warp(tokens: i32) -> i32 {
    if tokens == 1 {
        4
    } else {
        2
    }
}

/// The most convolution taps the kernel takes (Qwen3.5 and Qwen3-Next have 4).
const MAX_TAPS: i32 = 16;

/// What the CUDA build of [`BODY`] names: thread indices, shared memory, barriers, warp sums,
/// math functions.
const CUDA_PRELUDE: &str = r#"
#define PERCH_SHARED __shared__
#define PERCH_DEVICE
#define PERCH_BARRIER() __syncthreads()
#define PERCH_WARP_SUM(x) { for (int o_ = 16; o_ > 0; o_ /= 2) x += __shfl_xor_sync(0xffffffff, x, o_); }
#define PERCH_EXP(x) expf(x)
#define PERCH_SOFTPLUS(x) ((x) > 20.0f ? (x) : log1pf(expf(x)))
#define PERCH_RSQRT(x) rsqrtf(x)
#define PERCH_INDEX long long
#define PERCH_UNROLL _Pragma("unroll")
  const int lane = threadIdx.x;
  const int tid = threadIdx.y * 32 + lane;
  const int threads = blockDim.y * 32;
  const int warp_in_grid = blockIdx.y * blockDim.y + threadIdx.y;
  const int grid_z = blockIdx.z;
  const bool first_block = blockIdx.y == 0;
"#;

/// The same names in the Metal Shading Language, where a simdgroup of 32 threads is the warp
/// (MLX adds the thread-position arguments the source names).
const METAL_PRELUDE: &str = r#"
#define PERCH_SHARED threadgroup
#define PERCH_DEVICE device
#define PERCH_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define PERCH_WARP_SUM(x) { x = simd_sum(x); }
#define PERCH_EXP(x) metal::exp(x)
#define PERCH_SOFTPLUS(x) ((x) > 20.0f ? (x) : metal::log(1.0f + metal::exp(x)))
#define PERCH_RSQRT(x) metal::rsqrt(x)
#define PERCH_INDEX int64_t
#define PERCH_UNROLL
  const int lane = thread_index_in_simdgroup;
  const int tid = thread_position_in_threadgroup.y * 32 + thread_position_in_threadgroup.x;
  const int threads = threads_per_threadgroup.y * 32;
  const int warp_in_grid = thread_position_in_grid.y;
  const int grid_z = thread_position_in_grid.z;
  const bool first_block = thread_position_in_grid.y < threads_per_threadgroup.y;
"#;

/// The kernel's body on either backend, after its prelude: blocks of four warps of 32 threads
/// (`tid` a block's thread, `lane` its lane in the warp), the warp at `warp_in_grid` along the
/// grid's y axis owning `R` state rows, `grid_z` the row and value head.
const BODY: &str = r#"
  constexpr int PER_LANE = DK / 32;
  constexpr int R = ROWS_PER_WARP;
  PERCH_SHARED float q_shared[DK];
  PERCH_SHARED float k_shared[DK];
  const int first_row = warp_in_grid * R;
  const int n = grid_z / state_shape[1];
  const int h = grid_z % state_shape[1];
  const int heads = state_shape[1];
  const int rows = state_shape[2];
  const int kh = h / (heads / HK);
  const int steps = qkv_shape[1];
  const int channels = qkv_shape[2];
  const int taps = conv_weight_shape[1];
  const int keep = taps - 1;
  const int key_dim = HK * DK;
  const int real = PADDED ? counts[n] : steps;
  const int v_channel = 2 * key_dim + h * rows + first_row;
// Convolution input p of channel c (the conv state, then the pass's tokens), and output t.
#define PERCH_X(p, c) ((p) < keep \
    ? static_cast<float>(conv_state[n * conv_state_strides[0] + (p) * conv_state_strides[1] \
                                    + (c) * conv_state_strides[2]]) \
    : static_cast<float>(qkv[n * qkv_strides[0] + ((p) - keep) * qkv_strides[1] + (c) * qkv_strides[2]]))
#define PERCH_CONV(t, c, out) { \
    float acc_ = 0.0f; \
    for (int j_ = 0; j_ < taps; ++j_) { \
      acc_ += static_cast<float>(conv_weight[(c) * conv_weight_strides[0] + j_ * conv_weight_strides[1]]) \
          * PERCH_X((t) + j_, (c)); \
    } \
    out = acc_ / (1.0f + PERCH_EXP(-acc_)); }

  float s[R][PER_LANE];
PERCH_UNROLL
  for (int r = 0; r < R; ++r) {
    const PERCH_DEVICE float* s_in =
        state + n * state_strides[0] + h * state_strides[1] + (first_row + r) * state_strides[2];
PERCH_UNROLL
    for (int i = 0; i < PER_LANE; ++i) {
      s[r][i] = s_in[(lane + 32 * i) * state_strides[3]];
    }
  }
  const float dt = static_cast<float>(dt_bias[h * dt_bias_strides[0]]);
  const float rate_h = static_cast<float>(neg_rate[h * neg_rate_strides[0]]);
  for (int t = 0; t < steps; ++t) {
    // The gates and values first: their loads overlap the queries' and keys'.
    float decay = 1.0f;
    float rate = 0.0f;
    if (t < real) {
      const float x = static_cast<float>(
          a_proj[n * a_proj_strides[0] + t * a_proj_strides[1] + h * a_proj_strides[2]]) + dt;
      decay = PERCH_EXP(rate_h * PERCH_SOFTPLUS(x));
      const float logit = static_cast<float>(
          b_proj[n * b_proj_strides[0] + t * b_proj_strides[1] + h * b_proj_strides[2]]);
      rate = 1.0f / (1.0f + PERCH_EXP(-logit));
    }
    float values[R];
PERCH_UNROLL
    for (int r = 0; r < R; ++r) {
      PERCH_CONV(t, v_channel + r, values[r]);
    }
    for (int i = tid; i < DK; i += threads) {
      float qc, kc;
      PERCH_CONV(t, kh * DK + i, qc);
      PERCH_CONV(t, key_dim + kh * DK + i, kc);
      q_shared[i] = qc;
      k_shared[i] = kc;
    }
    PERCH_BARRIER();
    float keys[PER_LANE];
    float queries[PER_LANE];
    float qq = 0.0f;
    float kk = 0.0f;
PERCH_UNROLL
    for (int i = 0; i < PER_LANE; ++i) {
      queries[i] = q_shared[lane + 32 * i];
      keys[i] = k_shared[lane + 32 * i];
      qq += queries[i] * queries[i];
      kk += keys[i] * keys[i];
    }
    PERCH_WARP_SUM(qq);
    PERCH_WARP_SUM(kk);
    const float q_scale = PERCH_RSQRT(qq + 1e-6f) * PERCH_RSQRT(static_cast<float>(DK));
    const float k_scale = PERCH_RSQRT(kk + 1e-6f);
PERCH_UNROLL
    for (int i = 0; i < PER_LANE; ++i) {
      keys[i] *= k_scale;
    }
PERCH_UNROLL
    for (int r = 0; r < R; ++r) {
      float memory = 0.0f;
PERCH_UNROLL
      for (int i = 0; i < PER_LANE; ++i) {
        s[r][i] *= decay;
        memory += s[r][i] * keys[i];
      }
      PERCH_WARP_SUM(memory);
      const float delta = (values[r] - memory) * rate;
      float out = 0.0f;
PERCH_UNROLL
      for (int i = 0; i < PER_LANE; ++i) {
        // A padded token leaves the state as it was, even where its inputs are not finite.
        if (t < real) s[r][i] += keys[i] * delta;
        out += s[r][i] * queries[i];
      }
      PERCH_WARP_SUM(out);
      if (lane == 0) {
        y[((static_cast<PERCH_INDEX>(n) * steps + t) * heads + h) * rows + first_row + r] =
            static_cast<T>(out * q_scale);
      }
    }
    PERCH_BARRIER();
  }
PERCH_UNROLL
  for (int r = 0; r < R; ++r) {
    PERCH_DEVICE float* s_out =
        state_out + ((static_cast<PERCH_INDEX>(n) * heads + h) * rows + first_row + r) * DK;
PERCH_UNROLL
    for (int i = 0; i < PER_LANE; ++i) {
      s_out[lane + 32 * i] = s[r][i];
    }
  }
  // The conv state after the row's real tokens: each warp its rows' value channels, the first
  // block of each key head its query and key channels.
  PERCH_DEVICE T* conv_out = conv_state_out + static_cast<PERCH_INDEX>(n) * keep * channels;
  for (int j = lane; j < keep * R; j += 32) {
    const int c = v_channel + j / keep;
    conv_out[(j % keep) * channels + c] = static_cast<T>(PERCH_X(real + j % keep, c));
  }
  if (h % (heads / HK) == 0 && first_block) {
    for (int i = tid; i < DK; i += threads) {
      for (int j = 0; j < keep; ++j) {
        const int qc = kh * DK + i;
        const int kc = key_dim + qc;
        conv_out[j * channels + qc] = static_cast<T>(PERCH_X(real + j, qc));
        conv_out[j * channels + kc] = static_cast<T>(PERCH_X(real + j, kc));
      }
    }
  }
#undef PERCH_CONV
#undef PERCH_X
#undef PERCH_SHARED
#undef PERCH_DEVICE
#undef PERCH_BARRIER
#undef PERCH_WARP_SUM
#undef PERCH_EXP
#undef PERCH_SOFTPLUS
#undef PERCH_RSQRT
#undef PERCH_INDEX
#undef PERCH_UNROLL
"#;

/// The GPU backend the kernel runs on here: CUDA or Metal, unless `PERCH_GATED_DELTA_KERNEL=0`
/// (for benchmarks against the operations); `None` on CPU.
pub fn backend() -> Option<Backend> {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled =
        *ENABLED.get_or_init(|| std::env::var("PERCH_GATED_DELTA_KERNEL").as_deref() != Ok("0"));
    match Backend::current() {
        backend @ (Backend::Cuda | Backend::Metal) if enabled => Some(backend),
        _ => None,
    }
}

/// A pass's inputs to a layer's core ([`gated_delta`]).
pub struct CoreInputs<'a> {
    /// `[rows, tokens, conv_dim]`: the input projection's queries, keys and values, `conv_dim =
    /// 2·key_heads·dk + value_heads·dv` (any strides).
    pub qkv: &'a Array,
    /// `[rows, tokens, value_heads]` each: the decay's and the update rate's projections.
    pub a: &'a Array,
    pub b: &'a Array,
    /// `[rows, taps - 1, conv_dim]`: the convolution's last inputs before the pass.
    pub conv_state: &'a Array,
    /// `[rows, value_heads, dv, dk]` float32: the recurrent state before the pass.
    pub state: &'a Array,
    /// `[rows]` int32: real tokens per row when some row pads (the rest are padding); `None`
    /// when every token is real.
    pub counts: Option<&'a Array>,
}

/// A layer's weights that its core reads.
pub struct CoreWeights<'a> {
    /// `[conv_dim, taps, 1]`.
    pub conv_weight: &'a Array,
    /// `[value_heads]`.
    pub dt_bias: &'a Array,
    /// `[value_heads]` float32: `-exp(A_log)`.
    pub neg_rate: &'a Array,
    pub key_heads: i32,
    pub key_head_dim: i32,
}

/// Whether [`gated_delta`] computes this core: a float `qkv` `[rows, tokens, conv_dim]` with
/// `dk` a multiple of 32 up to 256, `dv` a multiple of the rows a block computes (16 for one
/// token, 8 for more), whole value heads
/// per key head, 2 to [`MAX_TAPS`] taps, at most 65,535 rows × value heads, and every shape
/// consistent.
pub fn computes(inputs: &CoreInputs, weights: &CoreWeights) -> bool {
    let (qs, ss, cs, ws) = (
        inputs.qkv.shape(),
        inputs.state.shape(),
        inputs.conv_state.shape(),
        weights.conv_weight.shape(),
    );
    let (hk, dk) = (weights.key_heads, weights.key_head_dim);
    if qs.len() != 3 || ss.len() != 4 || cs.len() != 3 || ws.len() != 3 || hk < 1 {
        return false;
    }
    let (rows, tokens, channels) = (qs[0], qs[1], qs[2]);
    let (hv, dv) = (ss[1], ss[2]);
    let taps = ws[1];
    let gates = [rows, tokens, hv];
    rows > 0
        && tokens > 0
        && hv > 0
        && dv > 0
        // CUDA's grid: at most 65,535 blocks along z (one per row and value head).
        && i64::from(rows) * i64::from(hv) <= 65_535
        && matches!(
        inputs.qkv.dtype(),
        Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
    ) && inputs.state.dtype() == Dtype::Float32
        && inputs.conv_state.dtype() == inputs.qkv.dtype()
        && weights.neg_rate.dtype() == Dtype::Float32
        && dk % 32 == 0
        && dk <= 256
        && dv % (WARPS_PER_BLOCK * rows_per_warp(tokens)) == 0
        && hv % hk == 0
        && (2..=MAX_TAPS).contains(&taps)
        && channels == 2 * hk * dk + hv * dv
        && ss == [rows, hv, dv, dk]
        && cs == [rows, taps - 1, channels]
        && ws == [channels, taps, 1]
        && inputs.a.shape() == gates
        && inputs.b.shape() == gates
        && weights.dt_bias.shape() == [hv]
        && weights.neg_rate.shape() == [hv]
        && inputs
            .counts
            .is_none_or(|c| c.shape() == [rows] && c.dtype() == Dtype::Int32)
}

/// What [`gated_delta`] returns.
pub struct CoreOutputs {
    /// `[rows, tokens, value_heads, dv]` in `qkv`'s dtype (a padded token's is undefined).
    pub y: Array,
    /// `[rows, taps - 1, conv_dim]`: the convolution's last inputs up to each row's real tokens.
    pub conv_state: Array,
    /// `[rows, value_heads, dv, dk]` float32: the state after each row's real tokens.
    pub state: Array,
}

/// The core over every token of the pass (see the module docs), in one launch. Only where
/// [`computes`] holds, on a GPU backend ([`backend`]).
pub fn gated_delta(inputs: &CoreInputs, weights: &CoreWeights) -> Result<CoreOutputs, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
        /// What the kernel reads as `counts` when no row pads (it reads none).
        static NO_COUNTS: Array = Array::from_slice(&[0i32], &[1]);
    }
    if backend().is_none() || !computes(inputs, weights) {
        return Err(Exception::custom(
            "gated_delta: shapes or dtypes it does not take",
        ));
    }
    let qs = inputs.qkv.shape();
    let (rows, tokens, channels) = (qs[0], qs[1], qs[2]);
    let (hv, dv, dk) = (
        inputs.state.shape()[1],
        inputs.state.shape()[2],
        weights.key_head_dim,
    );
    let keep = weights.conv_weight.shape()[1] - 1;
    let dtype = inputs.qkv.dtype();
    let template = [
        TemplateArg::Dtype(c"T", dtype),
        TemplateArg::Int(c"DK", dk),
        TemplateArg::Int(c"HK", weights.key_heads),
        TemplateArg::Int(c"PADDED", inputs.counts.is_some() as i32),
        TemplateArg::Int(c"ROWS_PER_WARP", rows_per_warp(tokens)),
    ];
    let no_counts = NO_COUNTS.with(Array::clone);
    let counts = inputs.counts.unwrap_or(&no_counts);
    with_kernel(
        &KERNEL,
        || {
            let backend = backend().unwrap_or(Backend::Cuda);
            let prelude = match backend {
                Backend::Metal => METAL_PRELUDE,
                _ => CUDA_PRELUDE,
            };
            let source = format!("{prelude}{BODY}");
            CustomKernel::new(
                backend,
                c"perch_gated_delta",
                &[
                    "qkv",
                    "conv_state",
                    "conv_weight",
                    "a_proj",
                    "b_proj",
                    "dt_bias",
                    "neg_rate",
                    "counts",
                    "state",
                ],
                &["y", "state_out", "conv_state_out"],
                &source,
                false,
            )
        },
        |kernel| {
            let mut outputs = kernel.apply(
                &[
                    inputs.qkv,
                    inputs.conv_state,
                    weights.conv_weight,
                    inputs.a,
                    inputs.b,
                    weights.dt_bias,
                    weights.neg_rate,
                    counts,
                    inputs.state,
                ],
                &[
                    (&[rows, tokens, hv, dv], dtype),
                    (&[rows, hv, dv, dk], Dtype::Float32),
                    (&[rows, keep, channels], dtype),
                ],
                (32, dv / rows_per_warp(tokens), rows * hv),
                (32, WARPS_PER_BLOCK, 1),
                &template,
            )?;
            let conv_state = outputs.pop().expect("three outputs");
            let state = outputs.pop().expect("three outputs");
            let y = outputs.pop().expect("three outputs");
            Ok(CoreOutputs {
                y,
                conv_state,
                state,
            })
        },
    )
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::{backend, computes, CoreInputs, CoreWeights};

    use crate::nn::custom_kernel::zeros;

    /// Arrays of a core with `hk` key heads of `dk`, `hv` value heads of `dv` and `taps` taps
    /// (2 rows, 5 tokens, bfloat16).
    struct Case {
        qkv: Array,
        a: Array,
        conv_state: Array,
        state: Array,
        conv_weight: Array,
        dt_bias: Array,
        neg_rate: Array,
        hk: i32,
        dk: i32,
    }

    impl Case {
        fn new(hk: i32, dk: i32, hv: i32, dv: i32, taps: i32) -> Self {
            Self::with_tokens(hk, dk, hv, dv, taps, 5)
        }

        fn with_tokens(hk: i32, dk: i32, hv: i32, dv: i32, taps: i32, tokens: i32) -> Self {
            let channels = 2 * hk * dk + hv * dv;
            let bf16 = Dtype::Bfloat16;
            Self {
                qkv: zeros(&[2, tokens, channels], bf16),
                a: zeros(&[2, tokens, hv], bf16),
                conv_state: zeros(&[2, taps - 1, channels], bf16),
                state: zeros(&[2, hv, dv, dk], Dtype::Float32),
                conv_weight: zeros(&[channels, taps, 1], bf16),
                dt_bias: zeros(&[hv], bf16),
                neg_rate: zeros(&[hv], Dtype::Float32),
                hk,
                dk,
            }
        }

        fn computes(&self, counts: Option<&Array>) -> bool {
            computes(
                &CoreInputs {
                    qkv: &self.qkv,
                    a: &self.a,
                    b: &self.a,
                    conv_state: &self.conv_state,
                    state: &self.state,
                    counts,
                },
                &CoreWeights {
                    conv_weight: &self.conv_weight,
                    dt_bias: &self.dt_bias,
                    neg_rate: &self.neg_rate,
                    key_heads: self.hk,
                    key_head_dim: self.dk,
                },
            )
        }
    }

    /// The kernel is chosen only for what it computes, and never on the CPU.
    #[test]
    fn computes_only_whole_heads_of_supported_sizes() {
        let case = Case::new(16, 128, 32, 128, 4);
        assert!(case.computes(None));
        assert!(case.computes(Some(&Array::from_slice(&[5i32, 3], &[2]))));
        assert!(backend().is_none(), "no GPU backend on this machine");
        // Counts of other rows or dtype.
        assert!(!case.computes(Some(&Array::from_slice(&[5i32], &[1]))));
        assert!(!case.computes(Some(&Array::from_slice(&[5.0f32, 3.0], &[2]))));
        // dk not a multiple of 32, or over 256; dv not a multiple of 16; value heads not a
        // multiple of key heads; one tap, or too many.
        assert!(!Case::new(16, 80, 32, 128, 4).computes(None));
        assert!(!Case::new(16, 512, 32, 128, 4).computes(None));
        assert!(!Case::new(16, 128, 32, 6, 4).computes(None));
        // A block computes 8 rows of a multi-token pass, 16 of a decode step.
        assert!(Case::new(16, 128, 32, 8, 4).computes(None));
        assert!(!Case::with_tokens(16, 128, 32, 8, 4, 1).computes(None));
        assert!(Case::with_tokens(16, 128, 32, 16, 4, 1).computes(None));
        // A pass of no tokens.
        assert!(!Case::with_tokens(16, 128, 32, 128, 4, 0).computes(None));
        assert!(!Case::new(16, 128, 24, 128, 4).computes(None));
        assert!(!Case::new(16, 128, 32, 128, 1).computes(None));
        assert!(!Case::new(16, 128, 32, 128, 17).computes(None));
        // A state in bfloat16, of other rows; an integer qkv; qkv of other channels.
        let mut bad = Case::new(16, 128, 32, 128, 4);
        bad.state = zeros(&[2, 32, 128, 128], Dtype::Bfloat16);
        assert!(!bad.computes(None));
        let mut bad = Case::new(16, 128, 32, 128, 4);
        bad.state = zeros(&[3, 32, 128, 128], Dtype::Float32);
        assert!(!bad.computes(None));
        let mut bad = Case::new(4, 32, 8, 16, 4);
        bad.qkv = zeros(&[2, 5, 2 * 4 * 32 + 8 * 16], Dtype::Int32);
        assert!(!bad.computes(None));
        let mut bad = Case::new(4, 32, 8, 16, 4);
        bad.qkv = zeros(&[2, 5, 2 * 4 * 32 + 8 * 16 + 1], Dtype::Bfloat16);
        assert!(!bad.computes(None));
    }
}
