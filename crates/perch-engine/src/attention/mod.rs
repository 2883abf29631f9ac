//! Scaled dot-product attention over what a KV cache holds: MLX's fused kernel, and the
//! explicit forms (scores by `matmul` or `quantized_matmul`, a mask, a precise softmax) that
//! quantized caches and some batched reads need, as mlx_lm's `models/base.py` computes them.
//! The caches decide which form reads them ([`crate::kv::cache::KvCache::attend`],
//! [`crate::kv::slot_cache::SlotKvCache::attend`]); models only project and rotate.

pub mod decode_kernel;
pub mod gated_delta_kernel;

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array, Dtype};

use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::nn::mlx_ext::slice;

/// KV cache quantization (MLX affine, as mlx_lm's `--kv-bits` / `--kv-group-size`): keys and
/// values are stored with `bits` per element plus a float scale and bias per `group_size`
/// elements of each head vector. 8 bits is close to lossless; 4 bits halves the memory again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvQuantization {
    pub bits: i32,
    pub group_size: i32,
}

impl KvQuantization {
    /// mlx_lm's default group size.
    pub const DEFAULT_GROUP_SIZE: i32 = 64;

    /// Checks `bits` (2, 3, 4, 5, 6 or 8) and `group_size` (32, 64 or 128), and that the group
    /// size divides `head_dim`.
    pub fn new(bits: i32, group_size: i32, head_dim: i32) -> Result<Self> {
        let invalid = |message: String| EngineError::InvalidKvQuantization(message);
        if ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(invalid(format!(
                "{bits} bits is not an MLX quantization width (2, 3, 4, 5, 6 or 8)"
            )));
        }
        if ![32, 64, 128].contains(&group_size) {
            return Err(invalid(format!(
                "group size {group_size} is not 32, 64 or 128"
            )));
        }
        if head_dim % group_size != 0 {
            return Err(invalid(format!(
                "group size {group_size} does not divide the model's head dimension {head_dim}"
            )));
        }
        Ok(Self { bits, group_size })
    }

    /// Bytes one head vector of `head_dim` elements takes: packed values plus a scale and a bias
    /// per group in the compute dtype (`dtype_bytes`).
    pub fn bytes_per_vector(&self, head_dim: usize, dtype_bytes: usize) -> usize {
        head_dim * self.bits as usize / 8 + 2 * (head_dim / self.group_size as usize) * dtype_bytes
    }
}

/// What attention reads after an update: every cached position, float or quantized.
pub enum CachedKv {
    /// Keys and values `[batch, kv_heads, positions, head_dim]`.
    Dense { keys: Array, values: Array },
    /// Packed values, scales and biases of keys and of values (see the module docs).
    Quantized {
        keys: [Array; 3],
        values: [Array; 3],
        quantization: KvQuantization,
    },
}

impl CachedKv {
    /// Parts in the order [`kv_parts`] makes them (2, or 6 when `quantization` is set).
    pub(crate) fn from_parts(quantization: Option<KvQuantization>, parts: Vec<Array>) -> Self {
        let mut all = parts.into_iter();
        let mut next = || all.next().expect("one part per buffer");
        match quantization {
            None => CachedKv::Dense {
                keys: next(),
                values: next(),
            },
            Some(quantization) => CachedKv::Quantized {
                keys: [next(), next(), next()],
                values: [next(), next(), next()],
                quantization,
            },
        }
    }

    /// Each array (keys and values, or each of their quantized parts) through `f`.
    pub(crate) fn map(self, f: impl Fn(Array) -> Result<Array>) -> Result<Self> {
        Ok(match self {
            CachedKv::Dense { keys, values } => CachedKv::Dense {
                keys: f(keys)?,
                values: f(values)?,
            },
            CachedKv::Quantized {
                keys: [kw, ks, kb],
                values: [vw, vs, vb],
                quantization,
            } => CachedKv::Quantized {
                keys: [f(kw)?, f(ks)?, f(kb)?],
                values: [f(vw)?, f(vs)?, f(vb)?],
                quantization,
            },
        })
    }
}

/// Attention of `queries` over what a cache holds, in its format: MLX's fused attention for dense
/// keys and values, [`quantized_scaled_dot_product_attention`] for quantized ones. Inputs and
/// `sinks` as [`masked_attention`]'s; returns `[batch, heads, seq, head_dim]` (heads not merged).
pub fn cached_attention(
    queries: &Array,
    cached: CachedKv,
    scale: f32,
    mask: KvMask,
    sinks: Option<&Array>,
) -> Result<Array> {
    match cached {
        CachedKv::Dense { keys, values } => {
            let mask = match mask {
                KvMask::None => None,
                KvMask::Causal => Some(ScaledDotProductAttentionMask::Causal),
                KvMask::Array(mask) => Some(ScaledDotProductAttentionMask::Array(mask)),
            };
            Ok(scaled_dot_product_attention(
                queries, &keys, &values, scale, mask, sinks,
            )?)
        }
        CachedKv::Quantized {
            keys,
            values,
            quantization,
        } => quantized_scaled_dot_product_attention(
            queries,
            &keys,
            &values,
            scale,
            quantization,
            mask,
            sinks,
        ),
    }
}

/// What one attention layer reads besides its queries, keys and values.
#[derive(Clone, Copy)]
pub struct AttentionSpec<'a> {
    /// The scores' scale (`head_dim^-0.5`, or the model's own).
    pub scale: f32,
    /// Attention sinks: a learned logit per query head `[heads]` that joins each query's softmax
    /// as a key without a value (gpt-oss).
    pub sinks: Option<&'a Array>,
    /// A sliding layer's window: each query sees its last `window` positions only.
    pub window: Option<i32>,
}

/// The sliding-window causal mask `[1, 1, seq, positions]` of `seq` queries at positions
/// `offset..offset + seq` over keys at positions `start..offset + seq`: true where the key is
/// at most the query's position and less than `window` before it (mlx_lm's
/// `create_causal_mask(window_size=window)`).
pub(crate) fn window_mask(offset: i32, seq: i32, start: i32, window: i32) -> Result<Array> {
    let q = ops::arange::<_, i32>(offset, offset + seq, None)?.reshape(&[1, 1, seq, 1])?;
    let k = ops::arange::<_, i32>(start, offset + seq, None)?.reshape(&[1, 1, 1, -1])?;
    let window = Array::from_int(window);
    Ok(ops::logical_and(
        &ops::ge(&q, &k)?,
        &ops::lt(&q, &ops::add(&k, &window)?)?,
    )?)
}

/// Attention over a quantized KV cache, as mlx_lm's `quantized_scaled_dot_product_attention`
/// (`mlx_lm/models/base.py`) computes it: queries scaled by `scale`, scores by `quantized_matmul`
/// against the packed keys, a mask (causal for more than one query, as
/// `where(q_pos >= k_pos, scores, finfo(dtype).min)`, or a boolean array), a precise softmax, and `quantized_matmul`
/// against the packed values. The query heads that share a KV head are stacked along the rows,
/// `[batch, kv_heads, repeats * seq, head_dim]`, where mlx_lm broadcasts the keys over a repeats
/// axis instead: every score is the same dot product (bit for bit on CPU, tested), and MLX's CUDA
/// quantized_matmul (v0.32) has no kernel for packed matrices broadcast over a batch axis.
///
/// `queries`: `[batch, heads, seq, head_dim]`; `keys`/`values`: packed values, scales and biases
/// `[batch, kv_heads, positions, …]` as [`crate::kv::cache::KvCache::update_and_fetch`] returns them.
/// `sinks`: attention sinks `[heads]` (see [`AttentionSpec::sinks`]; mlx_lm has none
/// for quantized caches). Returns `[batch, heads, seq, head_dim]`. Errors: MLX's, for shapes
/// that do not fit together.
pub fn quantized_scaled_dot_product_attention(
    queries: &Array,
    keys: &[Array; 3],
    values: &[Array; 3],
    scale: f32,
    q: KvQuantization,
    mask: KvMask,
    sinks: Option<&Array>,
) -> Result<Array> {
    // MLX's CUDA quantized_matmul (v0.32) also takes only whole-contiguous packed matrices, and
    // the cache hands out views of its larger buffers: copy them there (Metal and CPU read views).
    let contiguous = Backend::current() == Backend::Cuda;
    let packed = |parts: &[Array; 3]| -> Result<Vec<Array>> {
        parts
            .iter()
            .map(|p| {
                Ok(if contiguous {
                    p.contiguous()?
                } else {
                    p.clone()
                })
            })
            .collect()
    };
    let (keys, values) = (packed(keys)?, packed(values)?);
    let qmm = |x: &Array, parts: &[Array], transpose: bool| {
        ops::quantized_matmul(
            x,
            &parts[0],
            &parts[1],
            &parts[2],
            transpose,
            q.group_size,
            q.bits,
        )
    };
    let kv_heads = keys[0].shape()[1];
    stacked_attention(
        queries,
        kv_heads,
        (scale, sinks),
        mask,
        |q| Ok(qmm(q, &keys, true)?),
        |p| Ok(qmm(p, &values, false)?),
    )
}

/// Attention over dense keys and values `[batch, kv_heads, positions, head_dim]` by explicit
/// operations, as [`quantized_scaled_dot_product_attention`] computes it with `matmul` in place
/// of `quantized_matmul`: scores, mask, precise softmax, weighted values. What a batched decode
/// step on CUDA reads its slot cache with (see [`SlotRead`]). `sinks`: attention sinks
/// `[heads]`. Returns `[batch, heads, seq, head_dim]`.
pub fn explicit_scaled_dot_product_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: KvMask,
    sinks: Option<&Array>,
) -> Result<Array> {
    let kv_heads = keys.shape()[1];
    let keys_t = keys.transpose_axes(&[0, 1, 3, 2])?;
    stacked_attention(
        queries,
        kv_heads,
        (scale, sinks),
        mask,
        |q| Ok(ops::matmul(q, &keys_t)?),
        |p| Ok(ops::matmul(p, values)?),
    )
}

/// The attention both explicit forms share. The query heads that share a KV head are stacked
/// along the rows, `[batch, kv_heads, repeats * seq, head_dim]` (scaled by `scale` in their own
/// dtype), `scores_of` turns them into scores `[batch, kv_heads, repeats * seq, positions]`, the
/// mask puts the dtype's lowest value where a query may not look (as mlx_lm's
/// `where(mask, scores, finfo(dtype).min)`), a precise softmax (float32 inside) gives the
/// weights and `weigh` turns them into `[batch, kv_heads, repeats * seq, head_dim]`. Attention
/// sinks (`[heads]`, when given) join the softmax as one more column of scores, dropped after
/// it, as MLX's fused attention takes them.
fn stacked_attention(
    queries: &Array,
    kv_heads: i32,
    (scale, sinks): (f32, Option<&Array>),
    mask: KvMask,
    scores_of: impl FnOnce(&Array) -> Result<Array>,
    weigh: impl FnOnce(&Array) -> Result<Array>,
) -> Result<Array> {
    let s = queries.shape();
    let (batch, heads, seq, head_dim) = (s[0], s[1], s[2], s[3]);
    let repeats = heads / kv_heads;
    // Scalars in the activations' dtype: a float32 one would promote bfloat16 activations to
    // float32, for which MLX's CUDA quantized_matmul has no kernel (mlx_lm's Python scalars are
    // weakly typed and never promote).
    let dtype = queries.dtype();
    let queries = ops::multiply(queries, &Array::from_f32(scale).as_dtype(dtype)?)?.reshape(&[
        batch,
        kv_heads,
        repeats * seq,
        head_dim,
    ])?;
    let mut scores = scores_of(&queries)?;
    let positions = *scores.shape().last().expect("scores have a key axis");
    let mask = match mask {
        KvMask::None => None,
        // [batch, 1 or heads, seq, positions] → broadcast over the heads stacked per KV head.
        KvMask::Array(mask) => {
            let m = mask.shape();
            Some(if m[1] == 1 {
                mask.reshape(&[m[0], 1, 1, m[2], m[3]])?
            } else {
                mask.reshape(&[m[0], kv_heads, repeats, m[2], m[3]])?
            })
        }
        KvMask::Causal => {
            let q_positions = ops::arange::<_, i32>(positions - seq, positions, None)?;
            let k_positions = ops::arange::<_, i32>(0, positions, None)?;
            Some(ops::ge(
                &q_positions.expand_dims(1)?,
                &k_positions.expand_dims(0)?,
            )?)
        }
    };
    if let Some(mask) = mask {
        let by_head = scores.reshape(&[batch, kv_heads, repeats, seq, positions])?;
        scores = ops::select(&mask, &by_head, &lowest(scores.dtype())?)?.reshape(&[
            batch,
            kv_heads,
            repeats * seq,
            positions,
        ])?;
    }
    let weights = match sinks {
        None => ops::softmax_axis(&scores, -1, true)?,
        Some(sinks) => {
            // Head `k * repeats + r`'s sink beside each of its queries' rows.
            let column = ops::broadcast_to(
                sinks
                    .as_dtype(scores.dtype())?
                    .reshape(&[1, kv_heads, repeats, 1, 1])?,
                &[batch, kv_heads, repeats, seq, 1],
            )?
            .reshape(&[batch, kv_heads, repeats * seq, 1])?;
            let all = ops::softmax_axis(&ops::concatenate(&[scores, column], -1)?, -1, true)?;
            slice(
                &all,
                &[0, 0, 0, 0],
                &[batch, kv_heads, repeats * seq, positions],
            )?
        }
    };
    Ok(weigh(&weights)?.reshape(&[batch, heads, seq, head_dim])?)
}

/// How one batched step's attention reads its slot cache (see
/// [`crate::kv::slot_cache::SlotAttention`] for the choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRead {
    /// Dense keys and values are read by [`explicit_scaled_dot_product_attention`] instead of
    /// MLX's fused attention.
    pub explicit: bool,
    /// A quantized cache is dequantized (one layer at a time) and read as a dense one, instead
    /// of by [`quantized_scaled_dot_product_attention`] (see [`masked_attention`]).
    pub dequantize: bool,
    /// MLX's fused attention takes the mask as an additive one in the queries' dtype
    /// ([`additive_mask`]) instead of a boolean one: on CUDA, MLX 0.32.2 turns a boolean mask
    /// into cuDNN's bias by broadcasting it to every head first, `[batch, heads, seq,
    /// positions]` in the compute dtype, while an additive `[batch, 1, seq, positions]` mask goes
    /// to cuDNN as it is (4 rows of 2,048 queries over 8,192 positions at head size 128: 8 MB
    /// transient instead of 1 GB); the additive mask is also faster at head size 64, where
    /// neither copies. Head sizes above 128 have no fused kernel on CUDA and cost the same
    /// either way. Metal's kernels read boolean masks natively.
    pub additive_mask: bool,
    /// One query per row on CUDA is read by [`crate::attention::decode_kernel`] (one fused kernel with the
    /// mask) where it applies, instead of MLX's unfused fallback for masked single queries.
    pub decode_kernel: bool,
}

/// `mask` (boolean, true where a query may attend) as an additive mask of `dtype`: 0 where
/// true, half the dtype's lowest value where false (finite, so a query that may attend to
/// nothing, a padding row, gets finite weights instead of NaN, and adding a score cannot
/// overflow to -inf).
pub fn additive_mask(mask: &Array, dtype: Dtype) -> Result<Array> {
    let blocked = crate::nn::mlx_ext::scalar(lowest_value(dtype) / 2.0, dtype)?;
    let open = crate::nn::mlx_ext::scalar(0.0, dtype)?;
    Ok(ops::select(mask, &open, &blocked)?)
}

/// Attention of `queries` `[batch, heads, seq, head_dim]` over `cached` positions where `mask`
/// (boolean, `[batch, 1 or heads, seq, positions]`) is true, read as `read` says; with
/// `read.additive_mask`, `mask` is that mask made additive ([`additive_mask`], in the queries'
/// dtype), read by MLX's fused attention. A quantized
/// cache is read by [`quantized_scaled_dot_product_attention`], or, when `read.dequantize`,
/// dequantized and read as a dense one, one layer's slots at a time: MLX 0.32.2's CUDA
/// quantized_matmul over a batch of `rows * kv_heads` packed matrices did not finish 32
/// sequences' generation in 120 s. The cache keeps its size; the transient copy is one layer's.
/// `sinks`: attention sinks `[heads]`. Returns `[batch, seq, heads * head_dim]`, the heads merged
/// as the output projection reads them ([`merge_heads`]; the decode kernel writes that layout
/// directly, which saves the graph a transpose and a reshape a layer).
pub fn masked_attention(
    queries: &Array,
    cached: CachedKv,
    scale: f32,
    mask: &Array,
    read: SlotRead,
    sinks: Option<&Array>,
) -> Result<Array> {
    let dense = |keys: &Array, values: &Array| -> Result<Array> {
        Ok(if read.explicit {
            explicit_scaled_dot_product_attention(
                queries,
                keys,
                values,
                scale,
                KvMask::Array(mask),
                sinks,
            )?
        } else if read.decode_kernel
            && crate::attention::decode_kernel::applies(queries, keys, values, mask, sinks)
        {
            return Ok(crate::attention::decode_kernel::masked_decode_attention(
                queries, keys, values, mask, scale, sinks,
            )?);
        } else {
            let mask = ScaledDotProductAttentionMask::Array(mask);
            scaled_dot_product_attention(queries, keys, values, scale, mask, sinks)?
        })
        .and_then(|out| merge_heads(&out))
    };
    match cached {
        CachedKv::Dense { keys, values } => dense(&keys, &values),
        CachedKv::Quantized {
            keys,
            values,
            quantization: q,
        } if read.dequantize => {
            let dequantized =
                |[w, s, b]: [Array; 3]| ops::dequantize(&w, &s, &b, q.group_size, q.bits);
            dense(&dequantized(keys)?, &dequantized(values)?)
        }
        quantized => merge_heads(&cached_attention(
            queries,
            quantized,
            scale,
            KvMask::Array(mask),
            sinks,
        )?),
    }
}

/// Attention's output `[batch, heads, seq, head_dim]` → `[batch, seq, heads * head_dim]`, each
/// position's heads side by side (what the output projection reads).
pub fn merge_heads(out: &Array) -> Result<Array> {
    let s = out.shape();
    let (batch, seq) = (s[0], s[2]);
    Ok(out
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[batch, seq, -1])?)
}

/// Which positions a query of [`quantized_scaled_dot_product_attention`] may attend to.
#[derive(Clone, Copy)]
pub enum KvMask<'a> {
    /// All of them (one new token attends to everything cached).
    None,
    /// Those up to its own position (a prompt chunk at the end of the cache).
    Causal,
    /// Where the boolean array `[batch, 1 or heads, seq, positions]` is true.
    Array(&'a Array),
}

/// The lowest finite value of a float dtype (`mx.finfo(dtype).min`).
fn lowest_value(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        // bfloat16 keeps float32's exponent with 8 bits of significand: (2 - 2^-7) * 2^127.
        Dtype::Bfloat16 => -3.389_531_4e38,
        _ => f32::MIN,
    }
}

/// [`lowest_value`] as a scalar of `dtype`.
fn lowest(dtype: Dtype) -> Result<Array> {
    Ok(crate::nn::mlx_ext::scalar(lowest_value(dtype), dtype)?)
}
