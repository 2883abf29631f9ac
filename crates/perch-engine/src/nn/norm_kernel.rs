//! The residual add and the RMS norm after it in one CUDA kernel ([`add_rms_norm`]), written
//! with MLX's custom-kernel API ([`crate::nn::custom_kernel`]): `sum = x + residual` and
//! `rms_norm(sum, weight, eps)`, both returned, in one launch instead of MLX's two (a binary
//! add, then `fast::rms_norm`).
//!
//! Why: a decoder block adds its residual twice and norms each sum (before attention or the
//! linear-attention mixer, and before the MLP or experts); a decode step of a small model on a
//! GPU is bound by the host launching its kernels (see docs/benchmarks.md: about 17 a layer on
//! `qwen3_moe`), so one launch instead of two, twice a layer, shortens it. On Metal and the CPU
//! the engine keeps MLX's two operations.
//!
//! [`rms_norm_gated`] is Qwen3-Next's and Qwen3.5's gated norm after the Gated DeltaNet
//! recurrence (mlx_lm's `Qwen3NextRMSNormGated`: `rms_norm(y) · silu(z)` over each value head,
//! the product in float32) in one launch, reading `z` where the fused input projection wrote it:
//! MLX's operations take six (the norm, two casts, the SiLU, the product, the cast back) and a
//! copy of `z` out of the projection.
//!
//! The computation, as MLX 0.32's CUDA `rms_norm` does it (`mlx/backend/cuda/rms_norm.cu`):
//! one block per row; each element of the sum is rounded to the inputs' dtype (as MLX's add
//! writes it), its square accumulated in float32; `normalizer = rsqrt(mean + eps)`; the output
//! `weight · T(sum · normalizer)`, the product in the inputs' dtype.

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{
    judged, max_abs_error, time_call, unit_in_last_place, with_kernel, CustomKernel, TemplateArg,
};

const SOURCE: &str = r#"
  constexpr int PER_THREAD = (D + BLOCK - 1) / BLOCK;
  const float eps = __int_as_float(EPS_BITS);
  const long base = (long)blockIdx.x * D;
  float kept[PER_THREAD];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int d = threadIdx.x + i * BLOCK;
    kept[i] = 0.0f;
    if (d < D) {
      const T s = static_cast<T>(
          static_cast<float>(x[base + d]) + static_cast<float>(residual[base + d]));
      sum[base + d] = s;
      kept[i] = static_cast<float>(s);
      squares += kept[i] * kept[i];
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xffffffff, squares, offset);
  }
  __shared__ float partial[BLOCK / 32];
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = squares;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < BLOCK / 32; ++w) {
    total += partial[w];
  }
  const float normalizer = rsqrtf(total / D + eps);
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int d = threadIdx.x + i * BLOCK;
    if (d < D) {
      normed[base + d] = weight[d] * static_cast<T>(kept[i] * normalizer);
    }
  }
"#;

/// [`rms_norm_gated`]: one block a (token, head) row of `D` values; `z` read at `Z_OFFSET +
/// head · D` of its token's `Z_STRIDE` values. `out = T(silu(z) · float(weight · T(y ·
/// normalizer)))`, the norm as [`SOURCE`]'s and the gate in float32 as mlx_lm's.
const GATED_SOURCE: &str = r#"
  constexpr int PER_THREAD = (D + BLOCK - 1) / BLOCK;
  const float eps = __int_as_float(EPS_BITS);
  const long row = blockIdx.x;
  const long base = row * D;
  const long z_base = (row / HEADS) * Z_STRIDE + Z_OFFSET + (row % HEADS) * D;
  float kept[PER_THREAD];
  float squares = 0.0f;
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int d = threadIdx.x + i * BLOCK;
    kept[i] = 0.0f;
    if (d < D) {
      kept[i] = static_cast<float>(y[base + d]);
      squares += kept[i] * kept[i];
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xffffffff, squares, offset);
  }
  __shared__ float partial[BLOCK / 32];
  if (threadIdx.x % 32 == 0) {
    partial[threadIdx.x / 32] = squares;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < BLOCK / 32; ++w) {
    total += partial[w];
  }
  const float normalizer = rsqrtf(total / D + eps);
#pragma unroll
  for (int i = 0; i < PER_THREAD; ++i) {
    const int d = threadIdx.x + i * BLOCK;
    if (d < D) {
      const float normed = static_cast<float>(weight[d] * static_cast<T>(kept[i] * normalizer));
      const float g = static_cast<float>(z[z_base + d]);
      out[base + d] = static_cast<T>(g / (1.0f + expf(-g)) * normed);
    }
  }
"#;

/// Threads a block (one block a row): enough that each holds at most 8 of the row's elements.
fn block_size(dims: i32) -> i32 {
    (((dims + 7) / 8) as u32)
        .next_power_of_two()
        .clamp(64, 1024) as i32
}

/// The widest row the kernel takes (8 elements a thread at 1,024 threads).
const MAX_DIMS: i32 = 8192;

/// Whether [`add_rms_norm`] computes this: `x` and `residual` of one shape and float dtype,
/// `weight` `[last dim]` of that dtype, the last dimension at most [`MAX_DIMS`].
pub fn computes(x: &Array, residual: &Array, weight: &Array) -> bool {
    let dims = x.shape().last().copied().unwrap_or(0);
    matches!(x.dtype(), Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
        && residual.dtype() == x.dtype()
        && weight.dtype() == x.dtype()
        && residual.shape() == x.shape()
        && weight.shape() == [dims]
        && (1..=MAX_DIMS).contains(&dims)
}

/// Whether the engine's blocks use [`add_rms_norm`]: on MLX's CUDA backend unless
/// `PERCH_NORM_KERNEL=0` (for benchmarks against MLX's two operations).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("PERCH_NORM_KERNEL").as_deref() != Ok("0"))
        && Backend::current() == Backend::Cuda
}

/// `x + residual` and its RMS norm scaled by `weight`: `x`, `residual` `[..., dims]`, `weight`
/// `[dims]` → (`sum`, `normed`), both `[..., dims]` in `x`'s dtype. Only where [`computes`]
/// holds, on MLX's CUDA backend (the kernel is CUDA source).
pub fn add_rms_norm(
    x: &Array,
    residual: &Array,
    weight: &Array,
    eps: f32,
) -> Result<(Array, Array), Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    if !computes(x, residual, weight) {
        return Err(Exception::custom(
            "add_rms_norm: shapes or dtypes it does not take",
        ));
    }
    let shape = x.shape().to_vec();
    let dims = shape[shape.len() - 1];
    let rows: i32 = shape[..shape.len() - 1].iter().product();
    let block = block_size(dims);
    let dtype = x.dtype();
    with_kernel(
        &KERNEL,
        || {
            CustomKernel::new(
                Backend::Cuda,
                c"perch_add_rms_norm",
                &["x", "residual", "weight"],
                &["sum", "normed"],
                SOURCE,
                true,
            )
        },
        |kernel| {
            let mut out = kernel.apply(
                &[x, residual, weight],
                &[(&shape, dtype), (&shape, dtype)],
                (rows * block, 1, 1),
                (block, 1, 1),
                &[
                    TemplateArg::Dtype(c"T", dtype),
                    TemplateArg::Int(c"D", dims),
                    TemplateArg::Int(c"BLOCK", block),
                    TemplateArg::Int(c"EPS_BITS", eps.to_bits() as i32),
                ],
            )?;
            let normed = out.pop().expect("two outputs");
            let sum = out.pop().expect("two outputs");
            Ok((sum, normed))
        },
    )
}

/// Whether [`rms_norm_gated`] computes this: `y` `[tokens..., heads, dims]` of a float dtype,
/// `weight` `[dims]` in it, `z_source` `[tokens..., width]` in it with each token's `z` at
/// `offset .. offset + heads · dims` of its row, `dims` at most [`MAX_DIMS`].
pub fn computes_gated(y: &Array, z_source: &Array, offset: i32, weight: &Array) -> bool {
    let (ys, zs) = (y.shape(), z_source.shape());
    if ys.len() < 2 || zs.len() + 1 != ys.len() {
        return false;
    }
    let (heads, dims) = (ys[ys.len() - 2], ys[ys.len() - 1]);
    let width = zs[zs.len() - 1];
    matches!(y.dtype(), Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32)
        && z_source.dtype() == y.dtype()
        && weight.dtype() == y.dtype()
        && weight.shape() == [dims]
        && ys[..ys.len() - 2] == zs[..zs.len() - 1]
        && (1..=MAX_DIMS).contains(&dims)
        && heads > 0
        && offset >= 0
        && offset + heads * dims <= width
}

/// Qwen3-Next's gated norm: `y` `[tokens..., heads, dims]` normed over `dims` with `weight`
/// `[dims]`, times `silu(z)` in float32, where `z` `[tokens..., heads · dims]` is `z_source`'s
/// `offset .. offset + heads · dims` of each token's row (a part of a fused projection's
/// output, read in place) → `[tokens..., heads · dims]` in `y`'s dtype. Only where
/// [`computes_gated`] holds, on MLX's CUDA backend.
pub fn rms_norm_gated(
    y: &Array,
    (z_source, offset): (&Array, i32),
    weight: &Array,
    eps: f32,
) -> Result<Array, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    if !computes_gated(y, z_source, offset, weight) {
        return Err(Exception::custom(
            "rms_norm_gated: shapes or dtypes it does not take",
        ));
    }
    let shape = y.shape();
    let (heads, dims) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    let rows: i32 = shape[..shape.len() - 1].iter().product();
    let out_shape = [&shape[..shape.len() - 2], &[heads * dims]].concat();
    let block = block_size(dims);
    let dtype = y.dtype();
    with_kernel(
        &KERNEL,
        || {
            CustomKernel::new(
                Backend::Cuda,
                c"perch_rms_norm_gated",
                &["y", "z", "weight"],
                &["out"],
                GATED_SOURCE,
                true,
            )
        },
        |kernel| {
            let mut out = kernel.apply(
                &[y, z_source, weight],
                &[(&out_shape, dtype)],
                (rows * block, 1, 1),
                (block, 1, 1),
                &[
                    TemplateArg::Dtype(c"T", dtype),
                    TemplateArg::Int(c"D", dims),
                    TemplateArg::Int(c"HEADS", heads),
                    TemplateArg::Int(c"Z_STRIDE", *z_source.shape().last().expect("an axis")),
                    TemplateArg::Int(c"Z_OFFSET", offset),
                    TemplateArg::Int(c"BLOCK", block),
                    TemplateArg::Int(c"EPS_BITS", eps.to_bits() as i32),
                ],
            )?;
            Ok(out.pop().expect("one output"))
        },
    )
}

/// MLX's operations for [`rms_norm_gated`] (as `crate::models::gated_delta` runs them without
/// the kernel): `y` `[..., heads, dims]`, `z` `[..., heads, dims]`.
pub fn rms_norm_gated_ops(
    y: &Array,
    z: &Array,
    weight: &Array,
    eps: f32,
) -> Result<Array, Exception> {
    use mlx_rs::ops;
    let normed = mlx_rs::fast::rms_norm(y, Some(weight), eps)?;
    ops::multiply(
        &mlx_rs::nn::silu(z.as_dtype(Dtype::Float32)?)?,
        &normed.as_dtype(Dtype::Float32)?,
    )?
    .as_dtype(y.dtype())
}

/// Checks [`add_rms_norm`] against MLX's add and `fast::rms_norm` on random inputs of several
/// widths, row counts and dtypes; the sums must be equal, the norms within a unit in the last
/// place of the dtype. One line per case; an error at the first case outside its tolerance.
/// MLX's CUDA backend only (`perch check-kernels` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    use mlx_rs::ops;
    if Backend::current() != Backend::Cuda {
        return Err(crate::EngineError::Request(
            "the add-and-norm kernel is CUDA source: run this where MLX has its CUDA backend"
                .into(),
        ));
    }
    mlx_rs::random::seed(11)?;
    let mut lines = Vec::new();
    // (rows, tokens, dims, dtype)
    let cases = [
        (1, 1, 1024, Dtype::Bfloat16),
        (32, 1, 1024, Dtype::Bfloat16),
        (128, 1, 2048, Dtype::Bfloat16),
        (4, 37, 2880, Dtype::Bfloat16),
        (8, 1, 4096, Dtype::Float16),
        (3, 5, 576, Dtype::Float32),
        (2, 1, 8192, Dtype::Bfloat16),
        (5, 1, 100, Dtype::Float32),
    ];
    for (rows, tokens, dims, dtype) in cases {
        let normal = |shape: &[i32], std: f32| -> crate::Result<Array> {
            Ok(mlx_rs::random::normal::<f32>(shape, None, Some(std), None)?.as_dtype(dtype)?)
        };
        let x = normal(&[rows, tokens, dims], 4.0)?;
        let residual = normal(&[rows, tokens, dims], 1.0)?;
        let weight = normal(&[dims], 0.5)?;
        let eps = 1e-6;
        let (sum, normed) = add_rms_norm(&x, &residual, &weight, eps)?;
        let expected_sum = ops::add(&x, &residual)?;
        let expected = mlx_rs::fast::rms_norm(&expected_sum, Some(&weight), eps)?;
        let sum_error = max_abs_error(&sum, &expected_sum)?;
        // The norm's products are rounded to the dtype, so one unit in the last place of the
        // largest output is the tolerance (float32: the reduction's order differs).
        let largest = ops::abs(&expected.as_dtype(Dtype::Float32)?)?
            .max(None)?
            .item_exact::<f32>();
        let tolerance = largest * unit_in_last_place(dtype);
        let norm_error = max_abs_error(&normed, &expected)?;
        let kernel_ms = time_call(&|| Ok(add_rms_norm(&x, &residual, &weight, eps)?.1))?;
        let mlx_ms = time_call(&|| {
            Ok(mlx_rs::fast::rms_norm(
                &ops::add(&x, &residual)?,
                Some(&weight),
                eps,
            )?)
        })?;
        let line = format!(
            "rows {rows}, tokens {tokens}, width {dims}, {dtype:?}: sum max |error| \
             {sum_error:.1e}, norm max |error| {norm_error:.2e} (tolerance {tolerance:.1e}); \
             {kernel_ms:.3} ms a call against MLX's {mlx_ms:.3}"
        );
        // The sums must be equal: a NaN or any difference fails as the norm's error.
        let error = if sum_error == 0.0 {
            norm_error
        } else {
            f32::NAN
        };
        lines.push(judged("add-and-norm kernel", line, error, tolerance)?);
    }
    // The gated norm: (rows, tokens, heads, dims, z's offset in a row of `width`, dtype).
    let gated = [
        (32, 1, 32, 128, (4096, 8192 + 64), Dtype::Bfloat16),
        (1, 1, 16, 128, (2048, 4096 + 32), Dtype::Bfloat16),
        (2, 37, 8, 64, (0, 512), Dtype::Float32),
        (3, 5, 4, 96, (100, 100 + 384 + 7), Dtype::Float16),
    ];
    for (rows, tokens, heads, dims, (offset, width), dtype) in gated {
        let normal = |shape: &[i32], std: f32| -> crate::Result<Array> {
            Ok(mlx_rs::random::normal::<f32>(shape, None, Some(std), None)?.as_dtype(dtype)?)
        };
        let y = normal(&[rows, tokens, heads, dims], 2.0)?;
        let z_source = normal(&[rows, tokens, width], 2.0)?;
        let weight = normal(&[dims], 0.5)?;
        let eps = 1e-6;
        let z = crate::nn::mlx_ext::slice(
            &z_source,
            &[0, 0, offset],
            &[rows, tokens, offset + heads * dims],
        )?
        .reshape(&[rows, tokens, heads, dims])?;
        let expected = rms_norm_gated_ops(&y, &z, &weight, eps)?.reshape(&[rows, tokens, -1])?;
        let got = rms_norm_gated(&y, (&z_source, offset), &weight, eps)?;
        // Rounded to the dtype twice (the norm, the output): two units in the last place of
        // the largest output (float32: the reduction's order and `expf` differ).
        let largest = ops::abs(&expected.as_dtype(Dtype::Float32)?)?
            .max(None)?
            .item_exact::<f32>();
        let tolerance = 2.0 * largest * unit_in_last_place(dtype);
        let error = match got.shape() == expected.shape() {
            true => max_abs_error(&got, &expected)?,
            false => f32::NAN,
        };
        let kernel_ms = time_call(&|| Ok(rms_norm_gated(&y, (&z_source, offset), &weight, eps)?))?;
        let mlx_ms = time_call(&|| Ok(rms_norm_gated_ops(&y, &z, &weight, eps)?))?;
        let line = format!(
            "rows {rows}, tokens {tokens}, {heads} heads of {dims}, z at {offset} of {width}, \
             {dtype:?}: max |error| {error:.2e} (tolerance {tolerance:.1e}); {kernel_ms:.3} ms \
             a call against MLX's {mlx_ms:.3}"
        );
        lines.push(judged("gated norm kernel", line, error, tolerance)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::Dtype;

    use super::{block_size, computes};

    use crate::nn::custom_kernel::zeros;

    /// Taken only for what the kernel computes: equal shapes, one float dtype for all three, a
    /// weight per feature, rows up to 8,192 wide.
    #[test]
    fn computes_only_matching_shapes_and_dtypes() {
        let bf = Dtype::Bfloat16;
        let x = zeros(&[4, 1, 1024], bf);
        assert!(computes(&x, &x, &zeros(&[1024], bf)));
        assert!(!computes(&x, &x, &zeros(&[1024], Dtype::Float32)));
        assert!(!computes(
            &x,
            &zeros(&[4, 1, 1024], Dtype::Float16),
            &zeros(&[1024], bf)
        ));
        assert!(!computes(
            &x,
            &zeros(&[1, 1, 1024], bf),
            &zeros(&[1024], bf)
        ));
        assert!(!computes(&x, &x, &zeros(&[512], bf)));
        let wide = zeros(&[1, 8193], bf);
        assert!(!computes(&wide, &wide, &zeros(&[8193], bf)));
        let ints = zeros(&[2, 64], Dtype::Int32);
        assert!(!computes(&ints, &ints, &ints));
    }

    /// At most 8 elements a thread, whole warps, at most 1,024 threads.
    #[test]
    fn blocks_hold_every_element() {
        for dims in [1, 100, 576, 1024, 2880, 4096, 8192] {
            let block = block_size(dims);
            assert!(block % 32 == 0 && block <= 1024, "{dims}: {block}");
            assert!(block * 8 >= dims, "{dims}: {block}");
        }
    }
}
