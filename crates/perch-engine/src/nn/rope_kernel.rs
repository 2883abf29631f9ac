//! A decode step's queries and keys, normed and rotated, in one CUDA kernel ([`norm_rope`]),
//! written with MLX's custom-kernel API ([`crate::nn::custom_kernel`]): from the fused query,
//! key and value projection's output, each query and key head's RMS norm (when the model has
//! query and key norms per head, as Qwen3 and Qwen3-MoE do) and its rotary embedding at its row's
//! position — what MLX runs as four launches a layer (two `fast::rms_norm`, two
//! `fast::rope`), or two without norms (Llama) — and the values copied out in the heads-first
//! layout the cache takes (which would otherwise be a slice and a transpose in the graph). With
//! an output gate (Qwen3.5's attention: the query projection's output holds each
//! head's query then its gate), the gates are copied out contiguous too (otherwise a slice and
//! a copy before the gate's product).
//!
//! Why: a decode step of a small model on a GPU is bound by the host launching its kernels
//! (see docs/benchmarks.md), so launches saved in every attention layer shorten it. On Metal
//! and the CPU the engine keeps MLX's operations.
//!
//! The computation, as MLX 0.32's CUDA `rms_norm` and `rope` do it
//! (`mlx/backend/cuda/rms_norm.cu`, `rope.cu`): one block per (row, head) of `head_dim`
//! threads; the norm's sum of squares in float32, each normed feature `weight · T(x ·
//! rsqrt(mean + eps))` in the dtype `T`; RoPE (Su et al. 2021) in the non-interleaved layout
//! over the first `dims` features, feature `i` of each half turned by `position · scale ·
//! inv_freq(i)` with `inv_freq(i) = base^(−i / (dims / 2))`, or `1 / freqs[i]` when the model
//! gives its periods; the rest of the features passed through. With an attention factor (YaRN's:
//! gpt-oss; LongRoPE's: Phi-3.5), the rotated features are first multiplied by it in the dtype
//! `T`, as mlx_lm's `YarnRoPE` and `SuScaledRoPE` do.

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{
    judged, max_abs_error, time_call, unit_in_last_place, CustomKernel, TemplateArg,
};

const SOURCE: &str = r#"
  const int head = blockIdx.x;
  const int row = blockIdx.y;
  const int d = threadIdx.x;
  const bool is_query = head < NQ;
  // A query head's features (then its gate's with GATED), key heads, then value heads.
  constexpr int QW = GATED ? 2 : 1;
  const T* source = qkv + (long)row * (NQ * QW + 2 * NKV) * D
      + (is_query ? head * QW : NQ * QW + head - NQ) * D;
  /*GATE*/
  if (head >= NQ + NKV) {
    // A value head: copied (the whole block returns here, before any barrier).
    values[((long)row * NKV + head - NQ - NKV) * D + d] = source[d];
    return;
  }
  float value = static_cast<float>(source[d]);
  /*NORM*/
  if (MSCALE_BITS != 0x3f800000 && d < DIMS) {
    // YaRN's attention factor on the rotated features, in T (a product of two T values is
    // exact in float32, so this is T's rounded product).
    const float mscale = static_cast<float>(static_cast<T>(__int_as_float(MSCALE_BITS)));
    value = static_cast<float>(static_cast<T>(value * mscale));
  }
  __shared__ float features[D];
  features[d] = value;
  __syncthreads();
  constexpr int HALF = DIMS / 2;
  float result = value;
  if (d < DIMS) {
    const int i = d < HALF ? d : d - HALF;
    /*INV_FREQ*/
    const float position = __int_as_float(SCALE_BITS) * static_cast<float>(offsets[row]);
    const float theta = position * inv_freq;
    const float c = cos(theta);
    const float s = sin(theta);
    const float x1 = features[i];
    const float x2 = features[i + HALF];
    result = d < HALF ? x1 * c - x2 * s : x1 * s + x2 * c;
  }
  if (is_query) {
    queries[((long)row * NQ + head) * D + d] = static_cast<T>(result);
  } else {
    keys[((long)row * NKV + head - NQ) * D + d] = static_cast<T>(result);
  }
"#;

/// The norm, for models with query and key norms (`q_weight`, `k_weight` `[D]`).
const NORM: &str = r#"
  float squares = value * value;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    squares += __shfl_xor_sync(0xffffffff, squares, offset);
  }
  __shared__ float partial[D / 32];
  if (d % 32 == 0) {
    partial[d / 32] = squares;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < D / 32; ++w) {
    total += partial[w];
  }
  const float normalizer = rsqrtf(total / D + __int_as_float(EPS_BITS));
  const T* weight = is_query ? q_weight : k_weight;
  value = static_cast<float>(weight[d] * static_cast<T>(value * normalizer));
"#;

/// The gate of a query head, copied out (with `GATED`).
const GATE: &str = r#"
  if (is_query) {
    gates[((long)row * NQ + head) * D + d] = source[D + d];
  }
"#;

/// Frequencies from the base (`LOG2_BASE_BITS`: log2 of it), as MLX's `rope` kernel.
const FROM_BASE: &str = r#"
    const float inv_freq =
        exp2(-(static_cast<float>(i) / static_cast<float>(HALF)) * __int_as_float(LOG2_BASE_BITS));
"#;

/// Frequencies from the model's periods (`freqs` `[DIMS / 2]` float32), as MLX's `rope_freqs`.
const FROM_FREQS: &str = r#"
    const float inv_freq = 1.0 / freqs[i];
"#;

/// What a layer's RoPE is, as far as the kernel is concerned.
#[derive(Clone, Copy)]
pub struct RopeSpec<'a> {
    /// Rotated features (even, at most the head size).
    pub dims: i32,
    pub base: f32,
    pub scale: f32,
    /// The periods `[dims / 2]` float32 replacing `base`, for scaled variants.
    pub freqs: Option<&'a Array>,
    /// A factor on the rotated features before the rotation, in the features' dtype (YaRN's or
    /// LongRoPE's attention factor, [`crate::nn::layers::Rope::mscale`]); 1 for none.
    pub mscale: f32,
}

/// A layer's attention heads, as the fused projection's output holds them.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    /// Query heads.
    pub queries: i32,
    /// Key heads (and as many value heads).
    pub kv: i32,
    /// Features a head.
    pub size: i32,
    /// Each query head's features followed by its output gate's (`size` more).
    pub gated: bool,
}

impl Heads {
    /// Heads of `size` features in a token's projection output: queries (and gates), keys,
    /// values.
    fn stored(&self) -> i32 {
        self.queries * (1 + i32::from(self.gated)) + 2 * self.kv
    }

    /// Features of a token's projection output.
    pub fn width(&self) -> i32 {
        self.stored() * self.size
    }
}

/// The outputs of [`norm_rope`].
pub struct NormRope {
    /// `[rows, heads, 1, head_dim]`, normed and rotated.
    pub queries: Array,
    /// `[rows, kv_heads, 1, head_dim]`, normed and rotated.
    pub keys: Array,
    /// `[rows, kv_heads, 1, head_dim]`, as projected.
    pub values: Array,
    /// `[rows, 1, heads * head_dim]`, as projected, when the heads are gated.
    pub gates: Option<Array>,
}

/// Whether [`norm_rope`] computes this: `qkv` `[rows, 1, heads.width()]` (the fused
/// projection's output) or `[rows, 1, stored heads, head_dim]` of a float dtype (one token a
/// row), the head size a multiple of 32 up to 1,024, norms (if any) `[head_dim]` of that dtype,
/// `offsets` `[rows]` int32, RoPE over an even number of features up to the head size, `freqs`
/// (if any) `[dims / 2]` float32.
pub fn computes(
    qkv: &Array,
    heads: Heads,
    norms: Option<(&Array, &Array)>,
    offsets: &Array,
    rope: &RopeSpec,
) -> bool {
    takes((qkv.shape(), qkv.dtype()), heads, norms, offsets, rope)
}

/// [`computes`] for a `qkv` of this shape and dtype, before it is built.
pub fn takes(
    (s, dtype): (&[i32], Dtype),
    heads: Heads,
    norms: Option<(&Array, &Array)>,
    offsets: &Array,
    rope: &RopeSpec,
) -> bool {
    let Heads {
        queries: nq,
        kv: nkv,
        size: head_dim,
        ..
    } = heads;
    let float = matches!(dtype, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32);
    let layout = match s {
        [_, 1, features] => *features == heads.width(),
        [_, 1, n, d] => *n == heads.stored() && *d == head_dim,
        _ => false,
    };
    float
        && layout
        && nq > 0
        && nkv > 0
        && head_dim % 32 == 0
        && (32..=1024).contains(&head_dim)
        && offsets.shape() == [s[0]]
        && offsets.dtype() == Dtype::Int32
        && rope.dims > 0
        && rope.dims % 2 == 0
        && rope.dims <= head_dim
        && rope.mscale.is_finite()
        && norms.is_none_or(|(q, k)| {
            q.shape() == [head_dim]
                && k.shape() == [head_dim]
                && q.dtype() == dtype
                && k.dtype() == dtype
        })
        && rope
            .freqs
            .is_none_or(|f| f.shape() == [rope.dims / 2] && f.dtype() == Dtype::Float32)
}

/// Whether decode steps use [`norm_rope`]: on MLX's CUDA backend unless `PERCH_ROPE_KERNEL=0`
/// (for benchmarks against MLX's operations).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("PERCH_ROPE_KERNEL").as_deref() != Ok("0"))
        && Backend::current() == Backend::Cuda
}

/// The queries, keys and values of `qkv` (queries and their gates, keys, then values, a row's
/// one token at position `offsets[row]`; see [`computes`]), each query and key head normed by
/// `norms` (query, key weights; `eps`) when given and rotated by `rope`, the values (and gates)
/// as they are ([`NormRope`]). Only where [`computes`] holds, on MLX's CUDA backend.
pub fn norm_rope(
    qkv: &Array,
    shape: Heads,
    norms: Option<(&Array, &Array, f32)>,
    offsets: &Array,
    rope: &RopeSpec,
) -> Result<NormRope, Exception> {
    thread_local! {
        // By (norms, freqs, gates): their inputs or outputs differ.
        static KERNELS: RefCell<[[[Option<CustomKernel>; 2]; 2]; 2]> =
            const { RefCell::new([[[None, None], [None, None]], [[None, None], [None, None]]]) };
    }
    let Heads {
        queries: heads,
        kv: kv_heads,
        size: head_dim,
        gated,
    } = shape;
    let weights = norms.map(|(q, k, _)| (q, k));
    if !computes(qkv, shape, weights, offsets, rope) {
        return Err(Exception::custom(
            "norm_rope: shapes or dtypes it does not take",
        ));
    }
    let rows = qkv.shape()[0];
    let dtype = qkv.dtype();
    let mut inputs = vec![qkv, offsets];
    if let Some((q, k)) = weights {
        inputs.extend([q, k]);
    }
    inputs.extend(rope.freqs);
    let template = [
        TemplateArg::Dtype(c"T", dtype),
        TemplateArg::Int(c"D", head_dim),
        TemplateArg::Int(c"NQ", heads),
        TemplateArg::Int(c"NKV", kv_heads),
        TemplateArg::Int(c"GATED", i32::from(gated)),
        TemplateArg::Int(c"DIMS", rope.dims),
        TemplateArg::Int(
            c"EPS_BITS",
            norms.map_or(0.0f32, |(_, _, eps)| eps).to_bits() as i32,
        ),
        TemplateArg::Int(c"LOG2_BASE_BITS", rope.base.log2().to_bits() as i32),
        TemplateArg::Int(c"SCALE_BITS", rope.scale.to_bits() as i32),
        TemplateArg::Int(c"MSCALE_BITS", rope.mscale.to_bits() as i32),
    ];
    let (with_norms, with_freqs) = (norms.is_some(), rope.freqs.is_some());
    KERNELS.with(|kernels| {
        let mut kernels = kernels.borrow_mut();
        let kernel = kernels[usize::from(with_norms)][usize::from(with_freqs)][usize::from(gated)]
            .get_or_insert_with(|| new_kernel(with_norms, with_freqs, gated));
        let (query_shape, kv_shape) = ([rows, heads, 1, head_dim], [rows, kv_heads, 1, head_dim]);
        let gates_shape = [rows, 1, heads * head_dim];
        let mut outputs: Vec<(&[i32], Dtype)> = vec![
            (&query_shape, dtype),
            (&kv_shape, dtype),
            (&kv_shape, dtype),
        ];
        if gated {
            outputs.push((&gates_shape, dtype));
        }
        let mut out = kernel
            .apply(
                &inputs,
                &outputs,
                ((heads + 2 * kv_heads) * head_dim, rows, 1),
                (head_dim, 1, 1),
                &template,
            )?
            .into_iter();
        let mut next = || out.next().expect("an output each");
        Ok(NormRope {
            queries: next(),
            keys: next(),
            values: next(),
            gates: gated.then(next),
        })
    })
}

fn new_kernel(norms: bool, freqs: bool, gated: bool) -> CustomKernel {
    let source = SOURCE
        .replace("/*NORM*/", if norms { NORM } else { "" })
        .replace("/*GATE*/", if gated { GATE } else { "" })
        .replace("/*INV_FREQ*/", if freqs { FROM_FREQS } else { FROM_BASE });
    let mut inputs = vec!["qkv", "offsets"];
    if norms {
        inputs.extend(["q_weight", "k_weight"]);
    }
    if freqs {
        inputs.push("freqs");
    }
    let name = match (norms, freqs, gated) {
        (true, true, false) => c"perch_norm_rope_freqs",
        (true, false, false) => c"perch_norm_rope",
        (false, true, false) => c"perch_rope_freqs",
        (false, false, false) => c"perch_rope",
        (true, true, true) => c"perch_norm_rope_freqs_gated",
        (true, false, true) => c"perch_norm_rope_gated",
        (false, true, true) => c"perch_rope_freqs_gated",
        (false, false, true) => c"perch_rope_gated",
    };
    let mut outputs = vec!["queries", "keys", "values"];
    if gated {
        outputs.push("gates");
    }
    CustomKernel::new(Backend::Cuda, name, &inputs, &outputs, &source, true)
}

/// Checks [`norm_rope`] against MLX's `fast::rms_norm` and `fast::rope_dynamic` on random inputs:
/// with and without norms, periods from the base and given, partial rotation, several head
/// sizes, dtypes and row counts. One line per case; an error at the first case outside its
/// tolerance. MLX's CUDA backend only (`perch check-kernels` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    use crate::nn::mlx_ext::slice;
    use mlx_rs::{fast, ops};
    if Backend::current() != Backend::Cuda {
        return Err(crate::EngineError::Request(
            "the norm and RoPE kernel is CUDA source: run this where MLX has its CUDA backend"
                .into(),
        ));
    }
    mlx_rs::random::seed(13)?;
    let mut lines = Vec::new();
    // (rows, heads, kv_heads, head_dim, rotated dims, norms, freqs, mscale, dtype, gated)
    #[rustfmt::skip]
    let cases = [
        (1, 16, 8, 128, 128, true, false, 1.0, Dtype::Bfloat16, false),
        (32, 16, 4, 128, 128, true, false, 1.0, Dtype::Bfloat16, false),
        (8, 32, 8, 64, 64, false, false, 1.0, Dtype::Bfloat16, false),
        (4, 8, 2, 256, 64, true, false, 1.0, Dtype::Bfloat16, false),
        (5, 8, 2, 64, 64, false, true, 1.0, Dtype::Float16, false),
        (3, 4, 4, 128, 128, true, true, 1.0, Dtype::Float32, false),
        (128, 16, 8, 128, 128, true, false, 1.0, Dtype::Bfloat16, false),
        // gpt-oss: YaRN's periods and attention factor (0.1 ln 32 + 1).
        (32, 64, 8, 64, 64, false, true, 1.346_574, Dtype::Bfloat16, false),
        (4, 8, 2, 128, 64, true, true, 1.2, Dtype::Float32, false),
        // Qwen3.5's gated attention (a quarter of each head rotated), and gates elsewhere.
        (32, 8, 2, 256, 64, true, false, 1.0, Dtype::Bfloat16, true),
        (1, 16, 2, 256, 64, true, false, 1.0, Dtype::Bfloat16, true),
        (3, 4, 2, 128, 64, false, true, 1.0, Dtype::Float32, true),
    ];
    for (rows, heads, kv_heads, head_dim, dims, with_norms, with_freqs, mscale, dtype, gated) in
        cases
    {
        let shape = Heads {
            queries: heads,
            kv: kv_heads,
            size: head_dim,
            gated,
        };
        let normal = |shape: &[i32], std: f32| -> crate::Result<Array> {
            Ok(mlx_rs::random::normal::<f32>(shape, None, Some(std), None)?.as_dtype(dtype)?)
        };
        // The projection's output as it comes: `[rows, 1, width]`.
        let qkv = normal(&[rows, 1, shape.width()], 3.0)?;
        let q_weight = normal(&[head_dim], 0.5)?;
        let k_weight = normal(&[head_dim], 0.5)?;
        let eps = 1e-6;
        let offsets: Vec<i32> = (0..rows).map(|r| (r * 997 + 13) % 40_000).collect();
        let offsets = Array::from_slice(&offsets, &[rows]);
        let freqs = match with_freqs {
            true => {
                let periods: Vec<f32> = (0..dims / 2)
                    .map(|i| 10_000f32.powf(2.0 * i as f32 / dims as f32) * (1.0 + i as f32 / 7.0))
                    .collect();
                Some(Array::from_slice(&periods, &[dims / 2]))
            }
            false => None,
        };
        let rope = RopeSpec {
            dims,
            base: 1_000_000.0,
            scale: 1.0,
            freqs: freqs.as_ref(),
            mscale,
        };
        let norms = with_norms.then_some((&q_weight, &k_weight, eps));
        let run = || norm_rope(&qkv, shape, norms, &offsets, &rope);
        let out = run()?;
        // MLX's operations, as the engine runs them without the kernel.
        let stored = shape.stored();
        let heads_of = qkv.reshape(&[rows, 1, stored, head_dim])?;
        let part = |from: i32, to: i32| -> crate::Result<Array> {
            Ok(slice(
                &heads_of,
                &[0, 0, from, 0],
                &[rows, 1, to, head_dim],
            )?)
        };
        let kv_from = stored - 2 * kv_heads;
        // Queries, and with gates each head's gate after its query (`[rows, 1, heads, 2 · D]`).
        let (query_heads, expected_gates) = match gated {
            true => {
                let both = part(0, kv_from)?.reshape(&[rows, 1, heads, 2 * head_dim])?;
                let half =
                    |from: i32| slice(&both, &[0, 0, 0, from], &[rows, 1, heads, from + head_dim]);
                (half(0)?, Some(half(head_dim)?.reshape(&[rows, 1, -1])?))
            }
            false => (part(0, heads)?, None),
        };
        let expected_values = part(kv_from + kv_heads, stored)?.transpose_axes(&[0, 2, 1, 3])?;
        // Copied: exact.
        let mut copied = vec![("values", &out.values, &expected_values)];
        match (&out.gates, &expected_gates) {
            (Some(gates), Some(expected)) => copied.push(("gates", gates, expected)),
            (None, None) => {}
            _ => {
                return Err(crate::EngineError::Request(
                    "norm and RoPE kernel: gates where none were asked, or none where they were"
                        .into(),
                ))
            }
        }
        for (what, got, expected) in copied {
            let error = max_abs_error(got, expected)?;
            if error != 0.0 {
                return Err(crate::EngineError::Request(format!(
                    "norm and RoPE kernel: {what} differ from the projection's by {error:e}"
                )));
            }
        }
        let reference = |x: Array, weight: &Array| -> crate::Result<Array> {
            let x = match with_norms {
                true => fast::rms_norm(&x, Some(weight), eps)?,
                false => x,
            };
            let x = x.transpose_axes(&[0, 2, 1, 3])?;
            // mlx_lm's YaRN: the first `dims` features times the factor, in x's dtype.
            let x = match mscale == 1.0 {
                true => x,
                false => {
                    let shape = x.shape().to_vec();
                    let rotated = slice(&x, &[0, 0, 0, 0], &[shape[0], shape[1], shape[2], dims])?;
                    let rotated =
                        ops::multiply(&rotated, &Array::from_f32(mscale).as_dtype(dtype)?)?;
                    let rest = slice(&x, &[0, 0, 0, dims], &shape)?;
                    ops::concatenate(&[rotated, rest], 3)?
                }
            };
            Ok(fast::rope_dynamic(
                &x,
                dims,
                false,
                rope.freqs.is_none().then_some(rope.base),
                rope.scale,
                &offsets,
                rope.freqs,
            )?)
        };
        let expected_queries = reference(query_heads.clone(), &q_weight)?;
        let expected_keys = reference(part(kv_from, kv_from + kv_heads)?, &k_weight)?;
        let error = max_abs_error(&out.queries, &expected_queries)?
            .max(max_abs_error(&out.keys, &expected_keys)?);
        // A unit or two in the last place of the largest output (cos and sin of large angles
        // may round differently).
        let largest = ops::abs(&expected_queries.as_dtype(Dtype::Float32)?)?
            .max(None)?
            .item_exact::<f32>();
        let tolerance = 2.0 * largest * unit_in_last_place(dtype);
        let kernel_ms = time_call(&|| Ok(run()?.queries))?;
        let mlx_ms = time_call(&|| {
            let q = reference(query_heads.clone(), &q_weight)?;
            let k = reference(part(kv_from, kv_from + kv_heads)?, &k_weight)?;
            Ok(ops::add(&q.sum(None)?, &k.sum(None)?)?)
        })?;
        let line = format!(
            "rows {rows}, heads {heads}/{kv_heads}, head size {head_dim}, {dims} rotated, norms \
             {with_norms}, periods given {with_freqs}, factor {mscale}, gated {gated}, \
             {dtype:?}: max |error| \
             {error:.2e} \
             (tolerance {tolerance:.1e}); {kernel_ms:.3} ms a call against MLX's {mlx_ms:.3} \
             (with two sums)"
        );
        lines.push(judged("norm and RoPE kernel", line, error, tolerance)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::Dtype;

    use super::{computes, Heads, RopeSpec};

    use crate::nn::custom_kernel::zeros;

    /// Taken only for one token a row of the fused projection's layout, whole warps of
    /// features, matching norms and int32 positions.
    #[test]
    fn computes_only_what_the_kernel_takes() {
        let h = |queries, kv, size| Heads {
            queries,
            kv,
            size,
            gated: false,
        };
        let bf = Dtype::Bfloat16;
        let qkv = zeros(&[4, 1, 16 + 2 * 8, 128], bf);
        let flat = zeros(&[4, 1, (16 + 2 * 8) * 128], bf);
        let offsets = zeros(&[4], Dtype::Int32);
        let w = zeros(&[128], bf);
        let rope = RopeSpec {
            dims: 128,
            base: 1e6,
            scale: 1.0,
            freqs: None,
            mscale: 1.0,
        };
        assert!(computes(
            &qkv,
            h(16, 8, 128),
            Some((&w, &w)),
            &offsets,
            &rope
        ));
        assert!(computes(&qkv, h(16, 8, 128), None, &offsets, &rope));
        assert!(computes(&flat, h(16, 8, 128), None, &offsets, &rope));
        assert!(!computes(&flat, h(16, 8, 64), None, &offsets, &rope));
        // Two tokens a row, heads that do not add up, float32 norms on bfloat16, positions
        // not per row, an odd rotation, periods of the wrong length: not taken.
        let chunk = zeros(&[4, 2, 32, 128], bf);
        assert!(!computes(&chunk, h(16, 8, 128), None, &offsets, &rope));
        assert!(!computes(&qkv, h(16, 4, 128), None, &offsets, &rope));
        let w32 = zeros(&[128], Dtype::Float32);
        assert!(!computes(
            &qkv,
            h(16, 8, 128),
            Some((&w32, &w32)),
            &offsets,
            &rope
        ));
        assert!(!computes(
            &qkv,
            h(16, 8, 128),
            None,
            &zeros(&[1], Dtype::Int32),
            &rope
        ));
        let odd = RopeSpec { dims: 63, ..rope };
        assert!(!computes(&qkv, h(16, 8, 128), None, &offsets, &odd));
        let periods = zeros(&[32], Dtype::Float32);
        let short = RopeSpec {
            freqs: Some(&periods),
            ..rope
        };
        assert!(!computes(&qkv, h(16, 8, 128), None, &offsets, &short));
        let unbounded = RopeSpec {
            mscale: f32::INFINITY,
            ..rope
        };
        assert!(!computes(&qkv, h(16, 8, 128), None, &offsets, &unbounded));
        let yarn = RopeSpec {
            mscale: 1.35,
            ..rope
        };
        assert!(computes(&qkv, h(16, 8, 128), None, &offsets, &yarn));
        // Gated queries: each query head's gate beside it, so twice the query heads stored.
        let gated = Heads {
            gated: true,
            ..h(16, 8, 128)
        };
        assert_eq!(gated.width(), (2 * 16 + 2 * 8) * 128);
        let gated_flat = zeros(&[4, 1, gated.width()], bf);
        assert!(computes(
            &gated_flat,
            gated,
            Some((&w, &w)),
            &offsets,
            &rope
        ));
        assert!(computes(
            &zeros(&[4, 1, 48, 128], bf),
            gated,
            None,
            &offsets,
            &rope
        ));
        assert!(!computes(&flat, gated, None, &offsets, &rope));
        assert!(!computes(&gated_flat, h(16, 8, 128), None, &offsets, &rope));
        let head_80 = zeros(&[4, 1, 32, 80], bf);
        assert!(!computes(&head_80, h(16, 8, 80), None, &offsets, &rope));
    }
}
