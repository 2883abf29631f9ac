//! The Gated DeltaNet recurrence (see `models::gated_delta`) over all of a pass's tokens in one
//! GPU kernel launch per layer, CUDA or Metal, written with MLX's custom-kernel API (through
//! [`crate::attention::custom_kernel`]).
//!
//! Why: without it the recurrence runs a step per token (mlx_lm's `gated_delta_ops`, the form
//! it runs on CPU and CUDA): a prefill chunk of `T` tokens is `T` compiled steps of a few kernels
//! each, per linear-attention layer, and a decode step is one such step. mlx_lm has a kernel
//! for Metal (`gated_delta_kernel`); MLX 0.32.2 has none for CUDA.
//!
//! The CUDA source is checked against the step-per-token form on an NVIDIA GPU (`perch
//! check-kernels`). The Metal source is the same algorithm in the Metal Shading Language
//! (`simd_sum` for the warp reductions) and has not run on a Mac here: the engine uses either
//! only after it has passed a small check at model load (`models::gated_delta`), and falls back
//! to the step-per-token form otherwise.
//!
//! The computation, per row `b` and value head `h`, from the state `S [dv, dk]` (float32) and
//! for each token `t` in order: `S ← g·S`, `m = S·k`, `S ← S + β·(v − m) ⊗ k`, `y = S·q`
//! (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"). A warp owns one row of `S`
//! (one `dv` index), its lanes `dk / 32` components each, in registers for the whole pass; the
//! two dot products per token are warp reductions. Four warps (four `dv` rows) make a block, so
//! a block reads each token's `q` and `k` once for four rows.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::attention::custom_kernel::{CustomKernel, TemplateArg};
use crate::device::Backend;

/// Value rows (`dv` indices, one warp each) per thread block.
const ROWS_PER_BLOCK: i32 = 4;

const CUDA_SOURCE: &str = r#"
  constexpr int PER_LANE = DK / 32;
  const int lane = threadIdx.x;
  const int row = blockIdx.y * blockDim.y + threadIdx.y;
  const int heads = state_shape[1];
  const int b = blockIdx.z / heads;
  const int h = blockIdx.z % heads;
  const int key_head = h / (heads / q_shape[2]);
  const int steps = q_shape[1];
  const int rows = state_shape[2];

  const float* s_in = state + b * state_strides[0] + h * state_strides[1] + row * state_strides[2];
  float s[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    s[i] = s_in[(lane + 32 * i) * state_strides[3]];
  }
  for (int t = 0; t < steps; ++t) {
    const T* qt = q + b * q_strides[0] + t * q_strides[1] + key_head * q_strides[2];
    const T* kt = k + b * k_strides[0] + t * k_strides[1] + key_head * k_strides[2];
    float keys[PER_LANE];
    float queries[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      keys[i] = static_cast<float>(kt[(lane + 32 * i) * k_strides[3]]);
      queries[i] = static_cast<float>(qt[(lane + 32 * i) * q_strides[3]]);
    }
    const float decay = static_cast<float>(g[b * g_strides[0] + t * g_strides[1] + h * g_strides[2]]);
    const float rate =
        static_cast<float>(beta[b * beta_strides[0] + t * beta_strides[1] + h * beta_strides[2]]);
    const float value = static_cast<float>(
        v[b * v_strides[0] + t * v_strides[1] + h * v_strides[2] + row * v_strides[3]]);
    float memory = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] *= decay;
      memory += s[i] * keys[i];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      memory += __shfl_xor_sync(0xffffffff, memory, offset);
    }
    const float delta = (value - memory) * rate;
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] += keys[i] * delta;
      out += s[i] * queries[i];
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      out += __shfl_xor_sync(0xffffffff, out, offset);
    }
    if (lane == 0) {
      y[(((long)b * steps + t) * heads + h) * rows + row] = static_cast<T>(out);
    }
  }
  float* s_out = state_out + (((long)b * heads + h) * rows + row) * DK;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    s_out[lane + 32 * i] = s[i];
  }
"#;

/// [`CUDA_SOURCE`]'s algorithm in the Metal Shading Language: a simdgroup of 32 threads per
/// state row.
const METAL_SOURCE: &str = r#"
  constexpr int PER_LANE = DK / 32;
  const uint lane = thread_index_in_simdgroup;
  const int row = thread_position_in_grid.y;
  const int heads = state_shape[1];
  const int b = thread_position_in_grid.z / heads;
  const int h = thread_position_in_grid.z % heads;
  const int key_head = h / (heads / q_shape[2]);
  const int steps = q_shape[1];
  const int rows = state_shape[2];

  const device float* s_in =
      state + b * state_strides[0] + h * state_strides[1] + row * state_strides[2];
  float s[PER_LANE];
  for (int i = 0; i < PER_LANE; ++i) {
    s[i] = s_in[(lane + 32 * i) * state_strides[3]];
  }
  for (int t = 0; t < steps; ++t) {
    const device T* qt = q + b * q_strides[0] + t * q_strides[1] + key_head * q_strides[2];
    const device T* kt = k + b * k_strides[0] + t * k_strides[1] + key_head * k_strides[2];
    float keys[PER_LANE];
    float queries[PER_LANE];
    for (int i = 0; i < PER_LANE; ++i) {
      keys[i] = static_cast<float>(kt[(lane + 32 * i) * k_strides[3]]);
      queries[i] = static_cast<float>(qt[(lane + 32 * i) * q_strides[3]]);
    }
    const float decay =
        static_cast<float>(g[b * g_strides[0] + t * g_strides[1] + h * g_strides[2]]);
    const float rate =
        static_cast<float>(beta[b * beta_strides[0] + t * beta_strides[1] + h * beta_strides[2]]);
    const float value = static_cast<float>(
        v[b * v_strides[0] + t * v_strides[1] + h * v_strides[2] + row * v_strides[3]]);
    float memory = 0.0f;
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] *= decay;
      memory += s[i] * keys[i];
    }
    memory = simd_sum(memory);
    const float delta = (value - memory) * rate;
    float out = 0.0f;
    for (int i = 0; i < PER_LANE; ++i) {
      s[i] += keys[i] * delta;
      out += s[i] * queries[i];
    }
    out = simd_sum(out);
    if (lane == 0) {
      y[((b * steps + t) * heads + h) * rows + row] = static_cast<T>(out);
    }
  }
  device float* s_out = state_out + ((b * heads + h) * rows + row) * DK;
  for (int i = 0; i < PER_LANE; ++i) {
    s_out[lane + 32 * i] = s[i];
  }
"#;

/// The GPU backend the kernel runs on here: CUDA or Metal, unless `PERCH_GATED_DELTA_KERNEL=0`
/// (for benchmarks against the step-per-token form); `None` on CPU.
pub fn backend() -> Option<Backend> {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled =
        *ENABLED.get_or_init(|| std::env::var("PERCH_GATED_DELTA_KERNEL").as_deref() != Ok("0"));
    match Backend::current() {
        backend @ (Backend::Cuda | Backend::Metal) if enabled => Some(backend),
        _ => None,
    }
}

/// Whether [`gated_delta`] computes this recurrence: `q`/`k` `[rows, tokens, key_heads, dk]` in
/// a float dtype with `dk` a multiple of 32 up to 256, `v` `[rows, tokens, value_heads, dv]`
/// with `dv` a multiple of [`ROWS_PER_BLOCK`], whole value heads per key head, a float32 state
/// `[rows, value_heads, dv, dk]`.
pub fn computes(q: &Array, v: &Array, state: &Array) -> bool {
    let (qs, vs, ss) = (q.shape(), v.shape(), state.shape());
    qs.len() == 4
        && vs.len() == 4
        && ss.len() == 4
        && matches!(q.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16)
        && state.dtype() == Dtype::Float32
        && qs[3] % 32 == 0
        && qs[3] <= 256
        && vs[3] % ROWS_PER_BLOCK == 0
        && vs[2] % qs[2] == 0
        && vs[..2] == qs[..2]
        && ss == [qs[0], vs[2], vs[3], qs[3]]
}

/// The recurrence over every token of the pass: `q`, `k` `[rows, tokens, key_heads, dk]`, `v`
/// `[rows, tokens, value_heads, dv]`, `g` and `beta` `[rows, tokens, value_heads]` (any float
/// dtype; a padded token has `g = 1`, `beta = 0` and leaves the state as it was), `state`
/// `[rows, value_heads, dv, dk]` float32 → `y` `[rows, tokens, value_heads, dv]` in `q`'s dtype
/// and the state after the last token. Value head `h` reads key head `h / (value_heads /
/// key_heads)`. Only where [`computes`] holds, on a GPU backend ([`backend`]).
pub fn gated_delta(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array), Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    if backend().is_none()
        || !computes(q, v, state)
        || k.shape() != q.shape()
        || k.dtype() != q.dtype()
    {
        return Err(Exception::custom(
            "gated_delta: shapes or dtypes it does not take",
        ));
    }
    let (rows, tokens) = (q.shape()[0], q.shape()[1]);
    let (heads, dv, dk) = (v.shape()[2], v.shape()[3], q.shape()[3]);
    let template = [
        TemplateArg::Dtype(c"T", q.dtype()),
        TemplateArg::Int(c"DK", dk),
    ];
    KERNEL.with(|kernel| {
        let mut kernel = kernel.borrow_mut();
        let kernel = kernel.get_or_insert_with(|| {
            let backend = backend().unwrap_or(Backend::Cuda);
            let source = match backend {
                Backend::Metal => METAL_SOURCE,
                _ => CUDA_SOURCE,
            };
            CustomKernel::new(
                backend,
                c"perch_gated_delta",
                &["q", "k", "v", "g", "beta", "state"],
                &["y", "state_out"],
                source,
                false,
            )
        });
        let mut outputs = kernel.apply(
            &[q, k, v, g, beta, state],
            &[
                (&[rows, tokens, heads, dv], q.dtype()),
                (&[rows, heads, dv, dk], Dtype::Float32),
            ],
            (32, dv, rows * heads),
            (32, ROWS_PER_BLOCK, 1),
            &template,
        )?;
        let state = outputs.pop().expect("two outputs");
        Ok((outputs.pop().expect("two outputs"), state))
    })
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::{backend, computes};

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        mlx_rs::ops::zeros_dtype(shape, dtype).unwrap()
    }

    /// The kernel is chosen only for what it computes, and never on the CPU.
    #[test]
    fn computes_only_whole_heads_of_supported_sizes() {
        let bf16 = Dtype::Bfloat16;
        let state = zeros(&[2, 32, 128, 128], Dtype::Float32);
        let q = zeros(&[2, 5, 16, 128], bf16);
        let v = zeros(&[2, 5, 32, 128], bf16);
        assert!(computes(&q, &v, &state));
        assert!(backend().is_none(), "no GPU backend on this machine");
        // dk not a multiple of 32, or over 256.
        let (q80, s80) = (
            zeros(&[2, 5, 16, 80], bf16),
            zeros(&[2, 32, 128, 80], Dtype::Float32),
        );
        assert!(!computes(&q80, &v, &s80));
        let (q512, s512) = (
            zeros(&[2, 5, 16, 512], bf16),
            zeros(&[2, 32, 128, 512], Dtype::Float32),
        );
        assert!(!computes(&q512, &v, &s512));
        // dv not a multiple of 4; value heads not a multiple of key heads.
        let (v6, s6) = (
            zeros(&[2, 5, 32, 6], bf16),
            zeros(&[2, 32, 6, 128], Dtype::Float32),
        );
        assert!(!computes(&q, &v6, &s6));
        let (v24, s24) = (
            zeros(&[2, 5, 24, 128], bf16),
            zeros(&[2, 24, 128, 128], Dtype::Float32),
        );
        assert!(!computes(&q, &v24, &s24));
        // A state in bfloat16, a state of other rows, an integer q, tokens that differ.
        assert!(!computes(&q, &v, &zeros(&[2, 32, 128, 128], bf16)));
        assert!(!computes(
            &q,
            &v,
            &zeros(&[3, 32, 128, 128], Dtype::Float32)
        ));
        assert!(!computes(
            &zeros(&[2, 5, 16, 128], Dtype::Int32),
            &v,
            &state
        ));
        assert!(!computes(&q, &zeros(&[2, 4, 32, 128], bf16), &state));
    }
}
