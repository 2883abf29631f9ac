//! A fused attention kernel for decode steps over slot caches on CUDA: one query per row,
//! keys and values `[rows, kv_heads, positions, head_dim]`, and a boolean mask of the positions
//! each row may read — what MLX's `scaled_dot_product_attention` computes with such a mask,
//! in one kernel launch per layer.
//!
//! Why: MLX 0.32.2's CUDA backend has a fused vector kernel for one query per row only without
//! an array mask; with one (a slot cache's per-row lengths) it falls back to an unfused
//! attention of about five kernels a layer (scale, scores, mask, softmax, weighted sum). A
//! decode step of a small model on a GPU is bound by the host encoding its kernels, so those
//! launches are most of what a masked step costs more: mlx_lm's own forward of a random Llama
//! 1.07B (dense bfloat16, 16 layers) on an H100, pipelined as `generate_step` is, took 2.53 ms
//! a step at one row and 4.44 ms at eight without a mask, against 3.76 and 5.75 ms with an
//! all-true boolean mask (`probe2` of the 2026-11-26 session; README "On a GPU").
//!
//! Metal needs no such kernel: MLX's Metal vector kernel reads boolean masks itself, so a
//! masked decode step is one fused kernel there already. This kernel is the CUDA backend's
//! equivalent, written with MLX's custom-kernel API (`mx.fast.cuda_kernel`), compiled by MLX
//! at run time (NVRTC), and used only where [`applies`] holds (up to [`max_positions`], 2,048
//! positions: it pays below and loses beyond); it cannot run on this CPU, so its tests run on
//! the device (`perch check-kernels`, see README).
//!
//! The computation (the standard "online softmax" of one query over many positions, as in
//! Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): a thread block
//! per (row, query head) of 8 warps (32 past 1,024 positions); each warp walks every `WARPS`th
//! position, its lanes holding `head_dim / 32` components, and keeps a running maximum,
//! normalizer and weighted sum of values in float32; the warps' partial results are then
//! combined. Masked positions are
//! skipped; a row with no readable position gets zeros (MLX's fallback gives NaN there; such
//! rows are free slots whose output nothing reads).

use std::cell::RefCell;
use std::ffi::CString;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

/// Warps per thread block: 8 (256 threads), or 32 over more than [`MANY_POSITIONS`] positions,
/// so a long context is walked by more warps at once (one block per row and head).
fn warps(positions: i32) -> i32 {
    if positions > MANY_POSITIONS {
        32
    } else {
        8
    }
}

const MANY_POSITIONS: i32 = 1024;

const SOURCE: &str = r#"
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
"#;

/// Whether [`masked_decode_attention`] computes this attention: one query per row, keys and
/// values of one head size (a multiple of 32 up to 256) in the queries' float dtype, a
/// boolean mask `[rows or 1, heads or 1, 1, positions]`, no attention sinks, and whole heads
/// of queries per key head.
pub fn applies(
    queries: &Array,
    keys: &Array,
    values: &Array,
    mask: &Array,
    sinks: Option<&Array>,
) -> bool {
    let (q, k, v, m) = (queries.shape(), keys.shape(), values.shape(), mask.shape());
    let float = matches!(
        queries.dtype(),
        Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32
    );
    sinks.is_none()
        && float
        && keys.dtype() == queries.dtype()
        && values.dtype() == queries.dtype()
        && mask.dtype() == Dtype::Bool
        && q.len() == 4
        && k.len() == 4
        && v.len() == 4
        && m.len() == 4
        && q[2] == 1
        && k == v
        && q[0] == k[0]
        && q[3] == k[3]
        && q[3] % 32 == 0
        && q[3] <= 256
        && k[1] > 0
        && q[1] % k[1] == 0
        && (m[0] == 1 || m[0] == q[0])
        && (m[1] == 1 || m[1] == q[1])
        && m[2] == 1
        && m[3] == k[2]
        && k[2] <= max_positions()
}

/// The kernel, made once per thread (the engine thread owns MLX's arrays) and freed with it.
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: made by `mlx_fast_cuda_kernel_new`, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

fn strings(names: &[&str]) -> mlx_sys::mlx_vector_string {
    // SAFETY: a new vector; each name is copied by mlx-c.
    unsafe {
        let vector = mlx_sys::mlx_vector_string_new();
        for name in names {
            let name = CString::new(*name).expect("no NUL in a name");
            mlx_sys::mlx_vector_string_append_value(vector, name.as_ptr());
        }
        vector
    }
}

fn new_kernel() -> Kernel {
    let source = CString::new(SOURCE).expect("no NUL in the source");
    let (inputs, outputs) = (strings(&["q", "k", "v", "mask"]), strings(&["out"]));
    // SAFETY: every argument is valid for the call; mlx-c copies the strings.
    unsafe {
        let kernel = mlx_sys::mlx_fast_cuda_kernel_new(
            c"perch_masked_decode_attention".as_ptr(),
            inputs,
            outputs,
            source.as_ptr(),
            c"".as_ptr(),
            false,
            0,
        );
        mlx_sys::mlx_vector_string_free(inputs);
        mlx_sys::mlx_vector_string_free(outputs);
        Kernel(kernel)
    }
}

/// `softmax(scale · q kᵀ, masked) v` for one query per row: `queries` `[rows, heads, 1, D]`,
/// `keys`/`values` `[rows, kv_heads, positions, D]`, `mask` bool `[rows or 1, heads or 1, 1,
/// positions]` (true where a row reads) → `[rows, heads, 1, D]` in the queries' dtype. Only
/// where [`applies`] holds, and only on MLX's CUDA backend (the kernel is CUDA source).
pub fn masked_decode_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    mask: &Array,
    scale: f32,
) -> Result<Array, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<Kernel>> = const { RefCell::new(None) };
    }
    if !applies(queries, keys, values, mask, None) {
        return Err(Exception::custom(
            "masked_decode_attention: shapes or dtypes it does not take",
        ));
    }
    let shape = queries.shape().to_vec();
    let (rows, heads, head_dim) = (shape[0], shape[1], shape[3]);
    let warps = warps(keys.shape()[2]);
    let dtype = queries.dtype() as mlx_sys::mlx_dtype;
    let stream = Stream::thread_local_or_default();
    KERNEL.with(|kernel| {
        let mut kernel = kernel.borrow_mut();
        let kernel = kernel.get_or_insert_with(new_kernel);
        // SAFETY: handles made here are freed here; the arrays outlive the call; the result
        // vector's array is copied out with a reference of its own.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                config,
                shape.as_ptr(),
                shape.len(),
                dtype,
            );
            mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, heads * warps * 32, rows, 1);
            mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, warps * 32, 1, 1);
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                config,
                c"WARPS".as_ptr(),
                warps,
            );
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                config,
                c"T".as_ptr(),
                dtype,
            );
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                config,
                c"D".as_ptr(),
                head_dim,
            );
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                config,
                c"SCALE_BITS".as_ptr(),
                scale.to_bits() as i32,
            );
            let inputs = mlx_sys::mlx_vector_array_new();
            for a in [queries, keys, values, mask] {
                mlx_sys::mlx_vector_array_append_value(inputs, a.as_ptr());
            }
            let mut outputs = mlx_sys::mlx_vector_array_new();
            let status = mlx_sys::mlx_fast_cuda_kernel_apply(
                &mut outputs,
                kernel.0,
                inputs,
                config,
                stream.as_ref().as_ptr(),
            );
            mlx_sys::mlx_vector_array_free(inputs);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            let result = if status == 0 && mlx_sys::mlx_vector_array_size(outputs) == 1 {
                let mut out = mlx_sys::mlx_array_new();
                if mlx_sys::mlx_vector_array_get(&mut out, outputs, 0) == 0 {
                    Ok(Array::from_ptr(out))
                } else {
                    mlx_sys::mlx_array_free(out);
                    Err(Exception::custom("masked_decode_attention: no output"))
                }
            } else {
                Err(Exception::custom(
                    "masked_decode_attention: MLX's custom CUDA kernel failed",
                ))
            };
            mlx_sys::mlx_vector_array_free(outputs);
            result
        }
    })
}

/// Whether decode steps over slot caches use [`masked_decode_attention`] on CUDA: yes unless
/// `PERCH_DECODE_KERNEL=0` (for benchmarks against MLX's own masked attention).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("PERCH_DECODE_KERNEL").as_deref() != Ok("0"))
}

/// The most positions (the slot cache's capacity) a step reads through the kernel; longer ones
/// go to MLX. The kernel walks a row's positions with the warps of one block, which pays below
/// a few thousand positions and loses beyond: on an H100, one request with a 7,900-token prompt
/// decoded at 5.8 ms a step through it against 3.15 ms through MLX's unfused attention (a block
/// per row and head leaves most of the GPU idle there; splitting positions across blocks would
/// fix that). `PERCH_DECODE_KERNEL_MAX_POSITIONS` overrides it (for benchmarks).
pub fn max_positions() -> i32 {
    static MAX: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("PERCH_DECODE_KERNEL_MAX_POSITIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(MAX_POSITIONS)
    })
}

const MAX_POSITIONS: i32 = 2048;

/// Checks [`masked_decode_attention`] against MLX's own masked attention (computed in float32)
/// on random inputs of several shapes, dtypes and masks: per-row lengths, a broadcast mask, a
/// mask per head, holes (a sliding window's ring), a row that reads nothing (zeros expected).
/// Returns one line per case; an error names the first case outside its tolerance. Runs on
/// MLX's CUDA backend only (`perch check-kernels` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    use mlx_rs::ops;
    if crate::device::Backend::current() != crate::device::Backend::Cuda {
        return Err(crate::EngineError::Request(
            "the decode attention kernel is CUDA source: run this where MLX has its CUDA backend"
                .into(),
        ));
    }
    mlx_rs::random::seed(7)?;
    let mut lines = Vec::new();
    // (rows, heads, kv_heads, head_dim, positions, dtype, mask kind)
    let cases = [
        (1, 32, 8, 64, 384, Dtype::Bfloat16, "lengths"),
        (1, 32, 8, 64, 2048, Dtype::Bfloat16, "lengths"),
        (2, 8, 2, 128, 1536, Dtype::Float32, "ring"),
        (8, 32, 8, 64, 512, Dtype::Bfloat16, "lengths"),
        (128, 32, 8, 64, 512, Dtype::Bfloat16, "lengths"),
        (3, 8, 8, 128, 1000, Dtype::Float16, "lengths"),
        (2, 8, 1, 256, 700, Dtype::Bfloat16, "ring"),
        (4, 16, 4, 64, 256, Dtype::Float32, "per head"),
        (5, 4, 2, 128, 300, Dtype::Float32, "broadcast"),
        (4, 8, 2, 64, 512, Dtype::Bfloat16, "empty row"),
    ];
    for (rows, heads, kv_heads, head_dim, positions, dtype, kind) in cases {
        let normal = |shape: &[i32]| -> crate::Result<Array> {
            Ok(mlx_rs::random::normal::<f32>(shape, None, None, None)?.as_dtype(dtype)?)
        };
        let q = normal(&[rows, heads, 1, head_dim])?;
        let k = normal(&[rows, kv_heads, positions, head_dim])?;
        let v = normal(&[rows, kv_heads, positions, head_dim])?;
        let index = ops::arange::<_, i32>(0, positions, None)?.reshape(&[1, 1, 1, positions])?;
        let lengths: Vec<i32> = (0..rows).map(|r| 1 + (r * 37 + 11) % positions).collect();
        let lengths = Array::from_slice(&lengths, &[rows, 1, 1, 1]);
        let mask = match kind {
            "per head" => {
                let per_head: Vec<i32> = (0..rows * heads)
                    .map(|i| 1 + (i * 29) % positions)
                    .collect();
                ops::lt(&index, Array::from_slice(&per_head, &[rows, heads, 1, 1]))?
            }
            "broadcast" => ops::lt(&index, Array::from_int(positions / 2 + 3))?,
            "ring" => {
                // Entries older than a window of a third of the ring, by each row's position.
                let age = ops::remainder(
                    &ops::add(
                        &ops::subtract(&lengths, &index)?,
                        Array::from_int(positions),
                    )?,
                    Array::from_int(positions),
                )?;
                ops::lt(&age, Array::from_int(positions / 3))?
            }
            _ => ops::lt(&index, &lengths)?,
        };
        // Which rows read anything: all but row 1 of the "empty row" case, which must get zeros.
        let empty_row = kind == "empty row";
        let reading: Vec<bool> = (0..rows).map(|r| !empty_row || r != 1).collect();
        let reading = Array::from_slice(&reading, &[rows, 1, 1, 1]);
        let mask = ops::logical_and(&mask, &reading)?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let ours = masked_decode_attention(&q, &k, &v, &mask, scale)?.as_dtype(Dtype::Float32)?;
        ours.eval()?;
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32);
        let reference = mlx_rs::fast::scaled_dot_product_attention(
            f32(&q)?,
            f32(&k)?,
            f32(&v)?,
            scale,
            mlx_rs::fast::ScaledDotProductAttentionMask::Array(&mask),
            None,
        )?;
        let tolerance = match dtype {
            Dtype::Float32 => 1e-4,
            Dtype::Float16 => 4e-3,
            _ => 3e-2,
        };
        // MLX gives NaN for a row that reads nothing; the kernel must give zeros.
        let expected = ops::select(&reading, &reference, &ops::zeros_like(&reference)?)?;
        let error = ops::abs(&ops::subtract(&ours, &expected)?)?
            .max(None)?
            .item_exact::<f32>();
        // A call of each alone, evaluated: the kernel against MLX's masked attention in the
        // inputs' dtype (what the engine runs without the kernel).
        let time = |f: &dyn Fn() -> crate::Result<Array>| -> crate::Result<f64> {
            f()?.eval()?;
            let start = std::time::Instant::now();
            for _ in 0..20 {
                f()?.eval()?;
            }
            Ok(start.elapsed().as_secs_f64() * 1e3 / 20.0)
        };
        let kernel_ms = time(&|| Ok(masked_decode_attention(&q, &k, &v, &mask, scale)?))?;
        let mlx_ms = time(&|| {
            Ok(mlx_rs::fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                scale,
                mlx_rs::fast::ScaledDotProductAttentionMask::Array(&mask),
                None,
            )?)
        })?;
        let line =
            format!(
            "rows {rows}, heads {heads}/{kv_heads}, head size {head_dim}, {positions} positions, \
             {dtype:?}, mask {kind}: max |error| {error:.2e} (tolerance {tolerance:.0e}){}; \
             {kernel_ms:.3} ms a call against MLX's {mlx_ms:.3}",
            if empty_row { ", the empty row zeros" } else { "" }
        );
        if error.is_nan() || error > tolerance {
            return Err(crate::EngineError::Kernel(format!(
                "decode attention kernel: {line}"
            )));
        }
        lines.push(line);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::applies;

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        mlx_rs::ops::zeros_dtype(shape, dtype).unwrap()
    }

    /// The kernel is only chosen for what it computes: one query a row, a boolean mask per row
    /// over every position, whole query heads per key head, no sinks.
    #[test]
    fn applies_only_to_what_the_kernel_computes() {
        let bf = Dtype::Bfloat16;
        let q = zeros(&[4, 8, 1, 64], bf);
        let kv = zeros(&[4, 2, 512, 64], bf);
        let mask = zeros(&[4, 1, 1, 512], Dtype::Bool);
        assert!(applies(&q, &kv, &kv, &mask, None));
        assert!(applies(
            &q,
            &kv,
            &kv,
            &zeros(&[1, 1, 1, 512], Dtype::Bool),
            None
        ));
        // Two queries a row (a prompt chunk), an additive mask, sinks, a short mask, an odd
        // head size, mixed dtypes, key heads that do not divide the query heads: not taken.
        let chunk = zeros(&[4, 8, 2, 64], bf);
        assert!(!applies(
            &chunk,
            &kv,
            &kv,
            &zeros(&[4, 1, 2, 512], Dtype::Bool),
            None
        ));
        assert!(!applies(&q, &kv, &kv, &zeros(&[4, 1, 1, 512], bf), None));
        assert!(!applies(&q, &kv, &kv, &mask, Some(&zeros(&[8], bf))));
        assert!(!applies(
            &q,
            &kv,
            &kv,
            &zeros(&[4, 1, 1, 256], Dtype::Bool),
            None
        ));
        let odd = zeros(&[4, 8, 1, 80], bf);
        let odd_kv = zeros(&[4, 2, 512, 80], bf);
        assert!(!applies(&odd, &odd_kv, &odd_kv, &mask, None));
        assert!(!applies(
            &q,
            &zeros(&[4, 2, 512, 64], Dtype::Float32),
            &kv,
            &mask,
            None
        ));
        let three = zeros(&[4, 3, 512, 64], bf);
        assert!(!applies(&q, &three, &three, &mask, None));
        // Past the positions where the kernel pays (read from the environment; unset in tests).
        let long = zeros(&[4, 2, 4096, 64], bf);
        assert!(!applies(
            &q,
            &long,
            &long,
            &zeros(&[4, 1, 1, 4096], Dtype::Bool),
            None
        ));
    }
}
