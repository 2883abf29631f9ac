//! A fused attention kernel for decode steps over slot caches on CUDA: one query per row,
//! keys and values `[rows, kv_heads, positions, head_dim]`, and a boolean mask of the positions
//! each row may read — what MLX's `scaled_dot_product_attention` computes with such a mask,
//! in one kernel launch per layer.
//!
//! Why: MLX 0.32.2's CUDA backend has a fused vector kernel for one query per row only without
//! an array mask; with one (a slot cache's per-row lengths) it falls back to an unfused
//! attention of about five kernels a layer (scale, scores, mask, softmax, weighted sum). A
//! decode step of a small model on a GPU is bound by the host encoding its kernels, so those
//! launches are most of what a masked step costs more (mlx_lm's own forward of a 1.07B Llama at
//! one row: 2.5 ms a step without a mask, 3.8 ms with an all-true boolean mask).
//!
//! Metal needs no such kernel: MLX's Metal vector kernel reads boolean masks itself, so a
//! masked decode step is one fused kernel there already. This kernel is the CUDA backend's
//! equivalent, written with MLX's custom-kernel API (`mx.fast.cuda_kernel`, through
//! [`crate::nn::custom_kernel`]), compiled by MLX at run time (NVRTC), and used only where [`applies`]
//! holds (up to [`max_positions`], 8,192 positions by default); it cannot run on
//! this CPU, so its tests run on the device (`perch check-kernels`, see README).
//!
//! The computation (the standard "online softmax" of one query over many positions, as in
//! Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): a thread block
//! per (row, query head) of 8 warps (16 past 1,024 positions); each warp walks its share of
//! the positions [`STEP`] at a time, its lanes holding `head_dim / 32` components, and keeps a
//! running maximum, normalizer and weighted sum of values in float32; the warps' partial
//! results are then combined. Where a step has few rows and heads over many positions, each
//! (row, head) gets several blocks, each over its part of the positions, and a second kernel
//! combines the parts' results the same way ([`parts`]; "split-K" or flash-decoding, as in Dao
//! et al. 2023, "Flash-Decoding for long-context inference"). Masked positions are skipped; a
//! row with no readable position gets zeros (MLX's fallback gives NaN there; such rows are free
//! slots whose output nothing reads).

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{judged, max_abs_error, time_call, CustomKernel, TemplateArg};

/// Warps per thread block: 8 (256 threads), or 16 when one block walks more than
/// [`MANY_POSITIONS`] positions (one part), so a long context is walked by more warps at once.
/// Not 32: a block of 1,024 threads leaves each 64 registers, fewer than [`STEP`] positions at
/// a time take at the larger head sizes.
fn warps(positions: i32, parts: i32) -> i32 {
    if parts == 1 && positions > MANY_POSITIONS {
        16
    } else {
        8
    }
}

/// Positions a warp reads at a time: their key and value loads are issued together, so their
/// latencies overlap instead of adding up position after position.
const STEP: i32 = 4;

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
  // STEP positions a warp at a time (its loads issued together, so their latencies overlap).
  // This block's part of the positions: all of them, or the `blockIdx.z`th of `gridDim.z`
  // parts (whole STEPs) in the split variant.
  const int part = ((positions + gridDim.z - 1) / gridDim.z + STEP - 1) / STEP * STEP;
  const int first = blockIdx.z * part;
  const int end = min(positions, first + part);
  for (int base = first + warp * STEP; base < end; base += WARPS * STEP) {
    bool valid[STEP];
    float keys[STEP][PER_LANE];
#pragma unroll
    for (int j = 0; j < STEP; ++j) {
      const int p = base + j;
      valid[j] = p < end && mp[p * mask_step];
      const T* key = kp + (long)p * k_strides[2];
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        keys[j][i] = valid[j] ? static_cast<float>(key[(lane + 32 * i) * k_strides[3]]) : 0.0f;
      }
    }
    float scores[STEP];
#pragma unroll
    for (int j = 0; j < STEP; ++j) {
      scores[j] = 0.0f;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        scores[j] += query[i] * keys[j][i];
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
      for (int j = 0; j < STEP; ++j) {
        scores[j] += __shfl_xor_sync(0xffffffff, scores[j], offset);
      }
    }
    float new_max = running_max;
#pragma unroll
    for (int j = 0; j < STEP; ++j) {
      if (valid[j]) {
        new_max = fmaxf(new_max, scores[j]);
      }
    }
    if (new_max == lowest) {
      continue;  // nothing readable yet
    }
    const float rescale = expf(running_max - new_max);
    float values[STEP][PER_LANE];
    float weights[STEP];
#pragma unroll
    for (int j = 0; j < STEP; ++j) {
      weights[j] = valid[j] ? expf(scores[j] - new_max) : 0.0f;
      const T* value = vp + (long)(base + j) * v_strides[2];
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        values[j][i] = valid[j] ? static_cast<float>(value[(lane + 32 * i) * v_strides[3]]) : 0.0f;
      }
    }
    normalizer *= rescale;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      acc[i] *= rescale;
    }
#pragma unroll
    for (int j = 0; j < STEP; ++j) {
      normalizer += weights[j];
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) {
        acc[i] += weights[j] * values[j][i];
      }
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
  /*EPILOGUE*/
"#;

/// The end of [`SOURCE`] for one block per row and head: the attention's output.
const WHOLE: &str = r#"
  T* result = out + (row * heads + head) * D;
  /*SINK*/
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float numerator = 0.0f;
    float denominator = sink_weight;
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

/// The end of [`SOURCE`] for several blocks per row and head (the split variant): each block's
/// maximum score, normalizer and weighted sum of values relative to that maximum (float32),
/// combined by [`COMBINE`].
const PART: &str = r#"
  const long slot = ((long)row * heads + head) * gridDim.z + blockIdx.z;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float numerator = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      if (normalizers[w] > 0.0f) {
        numerator += expf(maxima[w] - overall) * sums[w][d];
      }
    }
    part_sums[slot * D + d] = numerator;
  }
  if (threadIdx.x == 0) {
    float denominator = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      if (normalizers[w] > 0.0f) {
        denominator += expf(maxima[w] - overall) * normalizers[w];
      }
    }
    part_maxima[slot] = overall;
    part_normalizers[slot] = denominator;
  }
"#;

/// The split variant's second kernel: one block per (row, query head) of `D` threads combines
/// the parts' results as the warps' are combined above.
const COMBINE: &str = r#"
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int heads = part_maxima_shape[1];
  const int parts = part_maxima_shape[2];
  const long first = ((long)row * heads + head) * parts;
  float overall = __int_as_float(0xff800000);
  for (int s = 0; s < parts; ++s) {
    if (part_normalizers[first + s] > 0.0f) {
      overall = fmaxf(overall, part_maxima[first + s]);
    }
  }
  /*SINK*/
  float denominator = sink_weight;
  for (int s = 0; s < parts; ++s) {
    if (part_normalizers[first + s] > 0.0f) {
      denominator += expf(part_maxima[first + s] - overall) * part_normalizers[first + s];
    }
  }
  const int d = threadIdx.x;
  float numerator = 0.0f;
  for (int s = 0; s < parts; ++s) {
    if (part_normalizers[first + s] > 0.0f) {
      numerator += expf(part_maxima[first + s] - overall) * part_sums[(first + s) * D + d];
    }
  }
  out[((long)row * heads + head) * D + d] =
      static_cast<T>(denominator > 0.0f ? numerator / denominator : 0.0f);
"#;

/// Whether [`masked_decode_attention`] computes this attention: one query per row, keys and
/// values of one head size (a multiple of 32 up to 256) in the queries' float dtype, a
/// boolean mask `[rows or 1, heads or 1, 1, positions]`, attention sinks (if any) `[heads]` in
/// the queries' dtype, and whole heads of queries per key head.
pub fn computes(
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
    float
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
        // Sinks in the queries' dtype: MLX keys a compiled kernel by its name and template
        // arguments, not its inputs' dtypes.
        && sinks.is_none_or(|s| s.shape() == [q[1]] && s.dtype() == queries.dtype())
}

/// [`computes`] up to [`max_positions`] positions: where the engine reads through the kernel.
pub fn applies(
    queries: &Array,
    keys: &Array,
    values: &Array,
    mask: &Array,
    sinks: Option<&Array>,
) -> bool {
    computes(queries, keys, values, mask, sinks) && keys.shape()[2] <= max_positions()
}

/// What replaces `/*SINK*/` without attention sinks: nothing joins the softmax.
const NO_SINK: &str = "const float sink_weight = 0.0f;";

/// What replaces `/*SINK*/` with attention sinks (`sinks`, `[heads]`, the queries' dtype): the
/// head's sink joins the softmax as one more score without a value, so it raises the maximum
/// and the denominator only (MLX's `scaled_dot_product_attention` with `sinks`: one more column
/// of scores, softmaxed with the others and dropped before the weighted sum).
const SINK: &str = r#"
  const float sink = static_cast<float>(sinks[head * sinks_strides[0]]);
  overall = fmaxf(overall, sink);
  const float sink_weight = expf(sink - overall);
"#;

/// The kernels, without and with attention sinks: [`WHOLE`]'s, [`PART`]'s and [`COMBINE`]
/// (the parts need no sinks: they join where the parts are combined).
struct Kernels {
    whole: [CustomKernel; 2],
    part: CustomKernel,
    combine: [CustomKernel; 2],
}

fn new_kernels() -> Kernels {
    let parts = ["part_sums", "part_maxima", "part_normalizers"];
    let with_sinks = |names: &[&'static str], sinks: bool| {
        let mut names = names.to_vec();
        if sinks {
            names.push("sinks");
        }
        names
    };
    let attention = |name, outputs: &[&str], epilogue: &str, sinks: bool| {
        let epilogue = epilogue.replace("/*SINK*/", if sinks { SINK } else { NO_SINK });
        let source = SOURCE.replace("/*EPILOGUE*/", &epilogue);
        CustomKernel::new(
            Backend::Cuda,
            name,
            &with_sinks(&["q", "k", "v", "mask"], sinks),
            outputs,
            &source,
            false,
        )
    };
    let combine = |name, sinks: bool| {
        CustomKernel::new(
            Backend::Cuda,
            name,
            &with_sinks(&parts, sinks),
            &["out"],
            &COMBINE.replace("/*SINK*/", if sinks { SINK } else { NO_SINK }),
            true,
        )
    };
    Kernels {
        whole: [
            attention(c"perch_masked_decode_attention", &["out"], WHOLE, false),
            attention(
                c"perch_masked_decode_attention_sinks",
                &["out"],
                WHOLE,
                true,
            ),
        ],
        part: attention(c"perch_masked_decode_attention_part", &parts, PART, false),
        combine: [
            combine(c"perch_masked_decode_attention_combine", false),
            combine(c"perch_masked_decode_attention_combine_sinks", true),
        ],
    }
}

/// Blocks per (row, query head): 1 where a step has many of those or reads few positions (a
/// second kernel would cost the host more than it saves the device), else enough parts of at
/// least [`MIN_PART`] positions for about [`TARGET_BLOCKS`] blocks, at most [`MAX_PARTS`].
/// One block walking thousands of positions leaves most of the GPU idle: one block per (row,
/// head), a position at a time, lost to MLX's unfused attention past about 2,000 positions.
fn parts(rows: i32, heads: i32, positions: i32) -> i32 {
    let blocks = rows * heads;
    if positions <= SPLIT_FROM || blocks >= TARGET_BLOCKS {
        return 1;
    }
    let wanted = (TARGET_BLOCKS + blocks - 1) / blocks;
    wanted.min(positions / MIN_PART).clamp(1, MAX_PARTS)
}

const SPLIT_FROM: i32 = 2048;
const TARGET_BLOCKS: i32 = 256;
const MIN_PART: i32 = 512;
const MAX_PARTS: i32 = 16;

/// `softmax(scale · q kᵀ, masked) v` for one query per row: `queries` `[rows, heads, 1, D]`,
/// `keys`/`values` `[rows, kv_heads, positions, D]`, `mask` bool `[rows or 1, heads or 1, 1,
/// positions]` (true where a row reads), `sinks` (attention sinks, `[heads]`: each head's joins
/// its softmax as a score without a value) → `[rows, 1, heads · D]` in the queries' dtype: the
/// heads side by side, as the output projection reads them (with one query a row, the same
/// memory as `[rows, heads, 1, D]`). Only where [`computes`] holds, and only on MLX's CUDA
/// backend (the kernel is CUDA source).
pub fn masked_decode_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    mask: &Array,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array, Exception> {
    thread_local! {
        static KERNELS: RefCell<Option<Kernels>> = const { RefCell::new(None) };
    }
    if !computes(queries, keys, values, mask, sinks) {
        return Err(Exception::custom(
            "masked_decode_attention: shapes or dtypes it does not take",
        ));
    }
    let (rows, heads, head_dim) = (queries.shape()[0], queries.shape()[1], queries.shape()[3]);
    let shape = [rows, 1, heads * head_dim];
    let positions = keys.shape()[2];
    let parts = parts(rows, heads, positions);
    let warps = warps(positions, parts);
    let dtype = queries.dtype();
    let template = [
        TemplateArg::Int(c"WARPS", warps),
        TemplateArg::Int(c"STEP", STEP),
        TemplateArg::Dtype(c"T", dtype),
        TemplateArg::Int(c"D", head_dim),
        TemplateArg::Int(c"SCALE_BITS", scale.to_bits() as i32),
    ];
    let with_sinks = usize::from(sinks.is_some());
    let grid = (heads * warps * 32, rows, parts);
    let block = (warps * 32, 1, 1);
    KERNELS.with(|kernels| {
        let mut kernels = kernels.borrow_mut();
        let kernels = kernels.get_or_insert_with(new_kernels);
        let mut inputs = vec![queries, keys, values, mask];
        if parts == 1 {
            inputs.extend(sinks);
            let whole = &kernels.whole[with_sinks];
            let mut out = whole.apply(&inputs, &[(&shape, dtype)], grid, block, &template)?;
            return Ok(out.remove(0));
        }
        let f32 = Dtype::Float32;
        let partials = kernels.part.apply(
            &inputs,
            &[
                (&[rows, heads, parts, head_dim], f32),
                (&[rows, heads, parts], f32),
                (&[rows, heads, parts], f32),
            ],
            grid,
            block,
            &template,
        )?;
        let mut inputs: Vec<&Array> = partials.iter().collect();
        inputs.extend(sinks);
        let mut out = kernels.combine[with_sinks].apply(
            &inputs,
            &[(&shape, dtype)],
            (heads * head_dim, rows, 1),
            (head_dim, 1, 1),
            &[
                TemplateArg::Dtype(c"T", dtype),
                TemplateArg::Int(c"D", head_dim),
            ],
        )?;
        Ok(out.remove(0))
    })
}

/// Whether decode steps over slot caches use [`masked_decode_attention`] on CUDA: yes unless
/// `PERCH_DECODE_KERNEL=0` (for benchmarks against MLX's own masked attention).
pub fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("PERCH_DECODE_KERNEL").as_deref() != Ok("0"))
}

/// The most positions (the slot cache's capacity) a step reads through the kernel; longer ones
/// go to MLX. 8,192: beyond it the kernel has not been compared with MLX.
/// `PERCH_DECODE_KERNEL_MAX_POSITIONS` overrides it (for benchmarks).
pub fn max_positions() -> i32 {
    static MAX: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("PERCH_DECODE_KERNEL_MAX_POSITIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(MAX_POSITIONS)
    })
}

const MAX_POSITIONS: i32 = 8192;

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
    // (rows, heads, kv_heads, head_dim, positions, dtype, mask kind); "… sinks": with
    // attention sinks
    let cases = [
        (1, 32, 8, 64, 384, Dtype::Bfloat16, "lengths"),
        (1, 32, 8, 64, 2048, Dtype::Bfloat16, "lengths"),
        (2, 8, 2, 128, 1536, Dtype::Float32, "ring"),
        (8, 32, 8, 64, 512, Dtype::Bfloat16, "lengths"),
        (128, 32, 8, 64, 512, Dtype::Bfloat16, "lengths"),
        (3, 8, 8, 128, 1000, Dtype::Float16, "lengths"),
        (2, 8, 1, 256, 700, Dtype::Bfloat16, "ring"),
        (1, 32, 8, 64, 7937, Dtype::Bfloat16, "lengths"),
        (2, 8, 1, 256, 3000, Dtype::Bfloat16, "ring"),
        (3, 16, 8, 128, 4096, Dtype::Float16, "lengths"),
        (4, 16, 4, 64, 256, Dtype::Float32, "per head"),
        (5, 4, 2, 128, 300, Dtype::Float32, "broadcast"),
        (4, 8, 2, 64, 512, Dtype::Bfloat16, "empty row"),
        (4, 8, 2, 64, 3000, Dtype::Bfloat16, "empty row"),
        (32, 64, 8, 64, 384, Dtype::Bfloat16, "ring sinks"),
        (8, 64, 8, 64, 300, Dtype::Float32, "lengths sinks"),
        (1, 64, 8, 64, 4096, Dtype::Bfloat16, "lengths sinks"),
        (4, 8, 2, 64, 3000, Dtype::Bfloat16, "empty row sinks"),
    ];
    for (rows, heads, kv_heads, head_dim, positions, dtype, case) in cases {
        let (kind, with_sinks) = match case.strip_suffix(" sinks") {
            Some(kind) => (kind, true),
            None => (case, false),
        };
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
        // Sinks of the size of scaled scores (gpt-oss's are learned logits of a few units).
        let sinks = match with_sinks {
            true => Some(ops::multiply(
                &normal(&[heads])?,
                Array::from_f32(2.0).as_dtype(dtype)?,
            )?),
            false => None,
        };
        let ours = masked_decode_attention(&q, &k, &v, &mask, scale, sinks.as_ref())?
            .as_dtype(Dtype::Float32)?;
        ours.eval()?;
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32);
        let reference = mlx_rs::fast::scaled_dot_product_attention(
            f32(&q)?,
            f32(&k)?,
            f32(&v)?,
            scale,
            mlx_rs::fast::ScaledDotProductAttentionMask::Array(&mask),
            sinks.as_ref().map(f32).transpose()?.as_ref(),
        )?;
        let tolerance = match dtype {
            Dtype::Float32 => 1e-4,
            Dtype::Float16 => 4e-3,
            _ => 3e-2,
        };
        // MLX gives NaN for a row that reads nothing; the kernel must give zeros. The kernel's
        // heads come side by side.
        let expected = ops::select(&reading, &reference, &ops::zeros_like(&reference)?)?;
        let expected = crate::attention::merge_heads(&expected)?;
        let error = max_abs_error(&ours, &expected)?;
        // A call of each alone, evaluated: the kernel against MLX's masked attention in the
        // inputs' dtype (what the engine runs without the kernel).
        let kernel_ms = time_call(&|| {
            Ok(masked_decode_attention(
                &q,
                &k,
                &v,
                &mask,
                scale,
                sinks.as_ref(),
            )?)
        })?;
        let mlx_ms = time_call(&|| {
            Ok(mlx_rs::fast::scaled_dot_product_attention(
                &q,
                &k,
                &v,
                scale,
                mlx_rs::fast::ScaledDotProductAttentionMask::Array(&mask),
                sinks.as_ref(),
            )?)
        })?;
        let line =
            format!(
            "rows {rows}, heads {heads}/{kv_heads}, head size {head_dim}, {positions} positions, \
             {dtype:?}, mask {case}: max |error| {error:.2e} (tolerance {tolerance:.0e}){}; \
             {kernel_ms:.3} ms a call against MLX's {mlx_ms:.3}",
            if empty_row { ", the empty row zeros" } else { "" }
        );
        lines.push(judged("decode attention kernel", line, error, tolerance)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::Dtype;

    use super::{applies, computes, parts};

    use crate::nn::custom_kernel::zeros;

    /// The kernel is only chosen for what it computes: one query a row, a boolean mask per row
    /// over every position, whole query heads per key head, a sink (if any) per query head.
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
        // Attention sinks, one per query head: taken.
        assert!(applies(&q, &kv, &kv, &mask, Some(&zeros(&[8], bf))));
        // Two queries a row (a prompt chunk), an additive mask, sinks not one per query head,
        // a short mask, an odd head size, mixed dtypes, key heads that do not divide the query
        // heads: not taken.
        let chunk = zeros(&[4, 8, 2, 64], bf);
        assert!(!applies(
            &chunk,
            &kv,
            &kv,
            &zeros(&[4, 1, 2, 512], Dtype::Bool),
            None
        ));
        assert!(!applies(&q, &kv, &kv, &zeros(&[4, 1, 1, 512], bf), None));
        assert!(!applies(&q, &kv, &kv, &mask, Some(&zeros(&[2], bf))));
        assert!(!applies(&q, &kv, &kv, &mask, Some(&zeros(&[1, 8], bf))));
        assert!(!applies(
            &q,
            &kv,
            &kv,
            &mask,
            Some(&zeros(&[8], Dtype::Float32))
        ));
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
        // Up to `max_positions` (read from the environment; unset in tests), computed past
        // them.
        let long = zeros(&[4, 2, 8192, 64], bf);
        let long_mask = zeros(&[4, 1, 1, 8192], Dtype::Bool);
        assert!(applies(&q, &long, &long, &long_mask, None));
        let longer = zeros(&[4, 2, 8704, 64], bf);
        let longer_mask = zeros(&[4, 1, 1, 8704], Dtype::Bool);
        assert!(!applies(&q, &longer, &longer, &longer_mask, None));
        assert!(computes(&q, &longer, &longer, &longer_mask, None));
    }

    /// Several blocks per row and head only where few of them would walk many positions: from
    /// 2,049 positions, fewer than 256 (row, head) pairs, parts of at least 512 positions, at
    /// most 16.
    #[test]
    fn parts_split_only_long_reads_of_few_rows() {
        assert_eq!(parts(1, 32, 2048), 1);
        assert_eq!(parts(1, 32, 2049), 4);
        assert_eq!(parts(1, 32, 7937), 8);
        assert_eq!(parts(2, 8, 3000), 5);
        assert_eq!(parts(3, 16, 4096), 6);
        assert_eq!(parts(8, 32, 8192), 1);
        assert_eq!(parts(1, 4, 100_000), 16);
    }
}
