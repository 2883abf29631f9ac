//! A dense product of a few rows in one CUDA kernel of Perch's own ([`small_matmul`]), written
//! with MLX's custom-kernel API ([`crate::nn::custom_kernel`]): `y = x · Wᵀ (+ bias)` for `x`
//! `[..., in]` of at most [`MAX_ROWS`] rows and a weight `W` `[out, in]` of at most
//! [`MAX_WEIGHT_ELEMENTS`] values, both float16 or bfloat16.
//!
//! Why: on CUDA the engine multiplies dense weights (see [`crate::nn::layers::dense_weights`]),
//! and MLX 0.32 runs each such product through cuBLASLt captured into a child CUDA graph, which
//! costs its host 16–29 µs a product on an H200 (`scripts/bench_op_launch.py`; `cublasLtMatmul`
//! alone, timed inside MLX's capture by `scripts/probe_host.c`: 16–20 µs) against 3–5 µs for a
//! custom kernel (about 20 µs against 4–5). A decode step of a small model is bound by that host (docs/benchmarks.md): a
//! `qwen3_moe` step at 32 rows makes 33 such products (the attention's fused query/key/value
//! projection and its output projection in each of 16 layers, and the head), about a sixth of
//! its host time. The kernel replaces the layers' products, not the head's (its weights exceed
//! [`MAX_WEIGHT_ELEMENTS`]): it reads each weight once per four rows (from L2 after the first),
//! so it pays only where the weights are small and the rows few (decode steps and short prompt
//! passes); cuBLAS keeps larger products, whose device time counts. On Metal and the CPU MLX's
//! products stay.
//!
//! Layout: a block of [`WARPS`] warps; each warp computes 4 outputs for 4 rows (16 float32
//! accumulators a lane). Each lane reads 8 consecutive values of each of its 4 weight rows and 4
//! input rows (16-byte loads, coalesced across the warp), `in` covered in steps of 256; a warp
//! sum (butterfly) gives each output, the bias added in float32 and the result rounded to the
//! inputs' dtype once, as cuBLAS's epilogue does. Accumulation is in float32 in another order
//! than cuBLAS's: results differ by the last bits of the output dtype.

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{ops, Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{
    judged, relative_error, time_call, with_kernel, within, CustomKernel, TemplateArg,
};

/// Warps a block.
const WARPS: i32 = 4;
/// Outputs a warp computes (for each of its rows).
const FEATURES: i32 = 4;
/// Rows of `x` a block computes.
const ROW_TILE: i32 = 4;
/// The most rows of `x` the kernel takes: a decode step's batch of up to 32 rows. Past it each
/// weight read eight times and more is slower on the device than cuBLAS's GEMM.
pub const MAX_ROWS: i32 = 32;
/// The largest weight (`out · in` values) the kernel takes: 2 Mi values (4 MiB in bfloat16),
/// which stays in an H200's L2 across the row tiles that reread it; a model head's or a large
/// MLP's weights stay with cuBLAS.
pub const MAX_WEIGHT_ELEMENTS: i64 = 2 << 20;

const SOURCE: &str = r#"
  constexpr int V = 8;
  constexpr int F = 4;
  constexpr int TM = 4;
  int rows = 1;
  for (int i = 0; i + 1 < x_ndim; ++i) rows *= x_shape[i];
  const int out = w_shape[0];
  const int lane = threadIdx.x;
  const int n0 = (blockIdx.y * blockDim.y + threadIdx.y) * F;
  const int m0 = blockIdx.z * TM;
  float acc[TM][F];
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int f = 0; f < F; ++f) acc[t][f] = 0.0f;
  const bool aligned = ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15) == 0;
  if (aligned) {
    for (int k = lane * V; k < IN; k += 32 * V) {
      uint4 wv[F];
      uint4 xv[TM];
#pragma unroll
      for (int f = 0; f < F; ++f) wv[f] = *reinterpret_cast<const uint4*>(w + static_cast<long long>(n0 + f) * IN + k);
#pragma unroll
      for (int t = 0; t < TM; ++t)
        xv[t] = m0 + t < rows ? *reinterpret_cast<const uint4*>(x + static_cast<long long>(m0 + t) * IN + k)
                              : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int f = 0; f < F; ++f) {
        const T* we = reinterpret_cast<const T*>(&wv[f]);
        float wf[V];
#pragma unroll
        for (int j = 0; j < V; ++j) wf[j] = static_cast<float>(we[j]);
#pragma unroll
        for (int t = 0; t < TM; ++t) {
          const T* xe = reinterpret_cast<const T*>(&xv[t]);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[t][f] += static_cast<float>(xe[j]) * wf[j];
        }
      }
    }
  } else {
    for (int k = lane; k < IN; k += 32) {
#pragma unroll
      for (int f = 0; f < F; ++f) {
        const float wk = static_cast<float>(w[static_cast<long long>(n0 + f) * IN + k]);
#pragma unroll
        for (int t = 0; t < TM; ++t)
          if (m0 + t < rows) acc[t][f] += static_cast<float>(x[static_cast<long long>(m0 + t) * IN + k]) * wk;
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[t][f] += __shfl_xor_sync(0xffffffffu, acc[t][f], o);
#pragma unroll
  for (int t = 0; t < TM; ++t)
#pragma unroll
    for (int f = 0; f < F; ++f)
      if (lane == t * F + f && m0 + t < rows) {
        float v = acc[t][f];
        if (HAS_BIAS) v += static_cast<float>(bias[n0 + f]);
        y[static_cast<long long>(m0 + t) * out + n0 + f] = static_cast<T>(v);
      }
"#;

/// Whether the engine's dense products use [`small_matmul`] where [`takes`] holds: on MLX's
/// CUDA backend, unless `PERCH_GEMM_KERNEL=0` (for benchmarks against cuBLAS), once its load
/// check passed ([`self_test`]).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    let on = *ENABLED.get_or_init(|| std::env::var("PERCH_GEMM_KERNEL").as_deref() != Ok("0"));
    on && Backend::current() == Backend::Cuda && self_test().is_ok()
}

/// Whether [`small_matmul`] computes `x · weightᵀ (+ bias)`: `x` `[..., in]` of at most
/// [`MAX_ROWS`] rows, `weight` `[out, in]` of at most [`MAX_WEIGHT_ELEMENTS`] values, both
/// float16 or bfloat16 of one dtype (the bias too, `[out]`), `in` a multiple of 8 and `out` of 16
/// (a block's outputs).
pub fn takes(x: &Array, weight: &Array, bias: Option<&Array>) -> bool {
    let (xs, ws) = (x.shape(), weight.shape());
    let rows: i64 = xs[..xs.len().saturating_sub(1)]
        .iter()
        .map(|&d| d as i64)
        .product();
    let dtype = x.dtype();
    xs.len() >= 2
        && ws.len() == 2
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && weight.dtype() == dtype
        && xs[xs.len() - 1] == ws[1]
        && ws[1] > 0
        && ws[1] % 8 == 0
        && ws[0] % (FEATURES * WARPS) == 0
        && (1..=MAX_ROWS as i64).contains(&rows)
        && (ws[0] as i64) * (ws[1] as i64) <= MAX_WEIGHT_ELEMENTS
        && bias.is_none_or(|b| b.dtype() == dtype && b.shape() == [ws[0]])
}

/// `x · weightᵀ`, plus `bias` when given: `x` `[..., in]`, `weight` `[out, in]` (row-major, as a
/// linear layer keeps it) → `[..., out]` in `x`'s dtype. Only where [`takes`] holds, on MLX's
/// CUDA backend (the kernel is CUDA source).
pub fn small_matmul(x: &Array, weight: &Array, bias: Option<&Array>) -> Result<Array, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    if !takes(x, weight, bias) {
        return Err(Exception::custom("small_matmul: operands it does not take"));
    }
    let (out, input) = (weight.shape()[0], weight.shape()[1]);
    let rows = (x.size() / input as usize) as i32;
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("x has axes") = out;
    let dtype = x.dtype();
    with_kernel(
        &KERNEL,
        || {
            CustomKernel::new(
                Backend::Cuda,
                c"perch_small_matmul",
                &["x", "w", "bias"],
                &["y"],
                SOURCE,
                true,
            )
        },
        |kernel| {
            // Without a bias the kernel reads none: the weight stands in (one dtype a kernel name;
            // row-contiguous, so MLX copies nothing for it).
            let has_bias = bias.is_some();
            let bias = bias.unwrap_or(weight);
            let y = kernel.apply(
                &[x, weight, bias],
                &[(&shape, dtype)],
                (32, out / FEATURES, (rows + ROW_TILE - 1) / ROW_TILE),
                (32, WARPS, 1),
                &[
                    TemplateArg::Dtype(c"T", dtype),
                    TemplateArg::Int(c"IN", input),
                    TemplateArg::Int(c"HAS_BIAS", has_bias as i32),
                ],
            )?;
            Ok(y.into_iter().next().expect("one output"))
        },
    )
}

/// `x · weightᵀ (+ bias)` by MLX's operations: what [`small_matmul`] replaces.
fn reference(x: &Array, weight: &Array, bias: Option<&Array>) -> Result<Array, Exception> {
    match bias {
        Some(bias) => ops::addmm(bias, x, weight.t(), None, None),
        None => ops::matmul(x, weight.t()),
    }
}

/// A check case: `x` `[rows, tokens, input]` (with `offset`, a view one element into a larger
/// buffer, which the kernel reads without its 16-byte loads), `W` `[out, input]`, a bias or not.
#[derive(Clone, Copy, Debug)]
struct CaseSpec {
    rows: i32,
    tokens: i32,
    input: i32,
    out: i32,
    bias: bool,
    dtype: Dtype,
    offset: bool,
}

const fn spec(rows: i32, tokens: i32, input: i32, out: i32, bias: bool, dtype: Dtype) -> CaseSpec {
    CaseSpec {
        rows,
        tokens,
        input,
        out,
        bias,
        dtype,
        offset: false,
    }
}

/// The check cases; the first [`SELF_TEST_CASES`] make the load check.
const CASES: [CaseSpec; 8] = [
    spec(32, 1, 1024, 1536, false, Dtype::Bfloat16),
    spec(7, 1, 1032, 48, true, Dtype::Bfloat16),
    spec(1, 1, 64, 16, false, Dtype::Float16),
    spec(32, 1, 1024, 1024, true, Dtype::Bfloat16),
    spec(2, 3, 2048, 1024, false, Dtype::Bfloat16),
    spec(16, 1, 2880, 640, true, Dtype::Float16),
    spec(30, 1, 512, 4096, false, Dtype::Bfloat16),
    CaseSpec {
        offset: true,
        ..spec(9, 1, 1024, 256, true, Dtype::Bfloat16)
    },
];
const SELF_TEST_CASES: usize = 3;
/// The largest error a case may have, relative to the largest output: a few units in the last
/// place of bfloat16 (2⁻⁸), from summing in another order.
const TOLERANCE: f32 = 2e-2;

/// One case's largest error relative to the reference's largest output, and (when `timed`) the
/// kernel's and MLX's milliseconds a call. Its inputs come from keys of their own (MLX's global
/// random state, which the load check would otherwise move, is left alone).
fn case(c: CaseSpec, timed: bool) -> crate::Result<(f32, Option<(f64, f64)>)> {
    let (input, out, dtype) = (c.input, c.out, c.dtype);
    let normal = |shape: &[i32], seed: u64| -> crate::Result<Array> {
        let key = mlx_rs::random::key(seed)?;
        Ok(mlx_rs::random::normal::<f32>(shape, None, None, Some(&key))?.as_dtype(dtype)?)
    };
    let shape = [c.rows, c.tokens, input];
    let x = match c.offset {
        false => normal(&shape, 1)?,
        true => {
            let n = c.rows * c.tokens * input;
            let all = normal(&[n + 1], 1)?;
            crate::nn::mlx_ext::slice(&all, &[1], &[n + 1])?.reshape(&shape)?
        }
    };
    let weight = ops::multiply(
        &normal(&[out, input], 2)?,
        &Array::from_f32(1.0 / (input as f32).sqrt()).as_dtype(dtype)?,
    )?;
    let bias = c.bias.then(|| normal(&[out], 3)).transpose()?;
    // MLX's product on CUDA cannot read a view at an odd offset (cuBLASLt refuses the pointer:
    // status 15, seen on an H200): it gets an aligned copy of the same values.
    let aligned = match c.offset {
        true => x.as_dtype(Dtype::Float32)?.as_dtype(dtype)?,
        false => x.clone(),
    };
    let ours = small_matmul(&x, &weight, bias.as_ref())?;
    let theirs = reference(&aligned, &weight, bias.as_ref())?;
    let error = relative_error(&ours, &theirs)?;
    let times = match timed {
        true => Some((
            time_call(&|| Ok(small_matmul(&x, &weight, bias.as_ref())?))?,
            time_call(&|| Ok(reference(&aligned, &weight, bias.as_ref())?))?,
        )),
        false => None,
    };
    Ok((error, times))
}

/// The load check behind [`enabled`], once per process: the first [`SELF_TEST_CASES`] cases
/// against MLX's product. `Err` says why the kernel is not used (cuBLAS's products are).
pub fn self_test() -> &'static Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(|| {
        if Backend::current() != Backend::Cuda {
            return Err("not on CUDA".into());
        }
        for spec in &CASES[..SELF_TEST_CASES] {
            let (error, _) = case(*spec, false).map_err(|e| e.to_string())?;
            within(&format!("{spec:?}"), error, TOLERANCE)?;
        }
        Ok(())
    })
}

/// Every case against MLX's product, with both times: one line a case; an error at the first
/// outside [`TOLERANCE`]. MLX's CUDA backend only (`perch check-kernels gemm` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    if Backend::current() != Backend::Cuda {
        return Err(crate::EngineError::Request(
            "the small-product kernel is CUDA source: run this where MLX has its CUDA backend"
                .into(),
        ));
    }
    let mut lines = Vec::new();
    for c in CASES {
        let (error, times) = case(c, true)?;
        let (ours, theirs) = times.expect("timed");
        let line = format!(
            "small_matmul {}x{}x{} -> {}{}{} {:?}: largest error {error:.2e} of the largest output; \
             {ours:.3} ms a call, MLX's product {theirs:.3} ms",
            c.rows,
            c.tokens,
            c.input,
            c.out,
            if c.bias { " + bias" } else { "" },
            if c.offset { ", x a view at an odd offset" } else { "" },
            c.dtype,
        );
        lines.push(judged("small_matmul", line, error, TOLERANCE)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::custom_kernel::zeros;

    /// The kernel takes a decode step's few rows over small weights of a half dtype, nothing else.
    #[test]
    fn takes_few_rows_of_small_half_weights() {
        let bf16 = Dtype::Bfloat16;
        let w = zeros(&[1536, 1024], bf16);
        assert!(takes(&zeros(&[32, 1, 1024], bf16), &w, None));
        assert!(takes(&zeros(&[1, 1024], bf16), &w, None));
        assert!(takes(
            &zeros(&[4, 1024], bf16),
            &w,
            Some(&zeros(&[1536], bf16))
        ));
        assert!(
            !takes(&zeros(&[33, 1, 1024], bf16), &w, None),
            "more rows than MAX_ROWS"
        );
        assert!(
            !takes(&zeros(&[32, 1024], Dtype::Float32), &w, None),
            "float32 input"
        );
        assert!(
            !takes(&zeros(&[32, 1024], Dtype::Float16), &w, None),
            "dtypes differ"
        );
        assert!(
            !takes(&zeros(&[32, 1004], bf16), &zeros(&[1536, 1004], bf16), None),
            "in % 8"
        );
        assert!(
            !takes(&zeros(&[32, 1024], bf16), &zeros(&[1544, 1024], bf16), None),
            "out % 16"
        );
        assert!(
            !takes(&zeros(&[32, 2048], bf16), &zeros(&[2048, 2048], bf16), None),
            "a large weight"
        );
        assert!(
            !takes(&zeros(&[32, 1024], bf16), &w, Some(&zeros(&[1024], bf16))),
            "bias shape"
        );
        assert!(!takes(&zeros(&[1024], bf16), &w, None), "no row axis");
        assert!(
            !takes(&zeros(&[4, 0], bf16), &zeros(&[16, 0], bf16), None),
            "no input features"
        );
    }
}
