//! The vision tower of Gemma 4 (`gemma4` checkpoints as mlx-community ships them: mlx-vlm's key
//! names under `vision_tower.` and `embed_vision.`). Reference: mlx-vlm 0.7.6
//! `models/gemma4/vision.py` and `gemma4.py` (`MultimodalEmbedder`).
//!
//! Shapes: one image's pixel values `[height, width, channels]` (channels last, in `[0, 1]`: the
//! processor rescales and does not normalize; sides multiples of `patch_size ·
//! pooling_kernel_size`) → features `[soft tokens, text hidden]`, a soft token per
//! `pooling_kernel_size²` patches, pooled blocks row by row.
//!
//! The computation:
//! - Patches of `patch × patch` pixels (each patch's pixels row by row, channels innermost), mapped
//!   to `2 (x - 0.5)` and embedded by one linear map without bias (`patch_embedder.input_proj`),
//!   plus a learned embedding of the patch's column and one of its row
//!   (`position_embedding_table` `[2, positions, hidden]`).
//! - `num_hidden_layers` blocks with norms on each sub-layer's input and output (RMSNorm weighted
//!   by `weight`): attention over all the image's patches (no mask, scores unscaled) whose queries
//!   and keys are RMS-normed per head in float32 (a learned scale) and values without a scale,
//!   then turned by a 2-D RoPE (each head's first half by the patch's column, its second by its
//!   row; within each half `x cos + rotate_half(x) sin` with frequencies `θ^(-2i / half)`, θ =
//!   `rope_parameters.rope_theta`); a GeGLU feed-forward block
//!   (`down(gelu_tanh(gate(x)) · up(x))`). Linear maps may clip their input and output to stored
//!   bounds (`use_clipped_linears`).
//! - Pooling: each `k × k` block of patches averaged (float32), times `sqrt(hidden)`; with
//!   `standardize`, `(x - std_bias) · std_scale`.
//! - The embedder: an RMSNorm without scale, then `embed_vision.embedding_projection` to the
//!   text model's width.

use mlx_rs::{fast, ops, Array, Dtype};
use serde::Deserialize;
use serde_json::Value;

use super::LoadContext;
use crate::error::{EngineError, Result};
use crate::nn::layers::{gelu_approx, Linear, Quantization, RmsNorm};

/// `vision_config`'s fields, mlx-vlm's `VisionConfig` defaults (Gemma 4's).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct Gemma4VisionArgs {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub patch_size: i32,
    pub position_embedding_size: i32,
    pub pooling_kernel_size: i32,
    pub default_output_length: i32,
    pub use_clipped_linears: bool,
    pub standardize: bool,
    pub rope_parameters: Option<Value>,
}

impl Default for Gemma4VisionArgs {
    fn default() -> Self {
        Self {
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 16,
            num_attention_heads: 12,
            num_key_value_heads: 12,
            head_dim: 64,
            rms_norm_eps: 1e-6,
            patch_size: 16,
            position_embedding_size: 10_240,
            pooling_kernel_size: 3,
            default_output_length: 280,
            use_clipped_linears: false,
            standardize: false,
            rope_parameters: None,
        }
    }
}

/// Far above any released tower, low enough that a hostile config cannot ask for absurd shapes.
const MAX_HIDDEN: i32 = 16_384;
const MAX_LAYERS: i32 = 256;
const MAX_POSITIONS: i32 = 1 << 16;

impl Gemma4VisionArgs {
    /// `Err` names the first field that cannot describe the tower.
    fn validate(&self) -> std::result::Result<(), String> {
        let ranges = [
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("intermediate_size", self.intermediate_size, 4 * MAX_HIDDEN),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", self.num_attention_heads, MAX_HIDDEN),
            ("num_key_value_heads", self.num_key_value_heads, MAX_HIDDEN),
            ("head_dim", self.head_dim, MAX_HIDDEN),
            ("patch_size", self.patch_size, 1024),
            (
                "position_embedding_size",
                self.position_embedding_size,
                MAX_POSITIONS,
            ),
            ("pooling_kernel_size", self.pooling_kernel_size, 64),
            (
                "default_output_length",
                self.default_output_length,
                MAX_POSITIONS,
            ),
        ];
        for (name, value, most) in ranges {
            if !(1..=most).contains(&value) {
                return Err(format!(
                    "vision_config.{name} must be between 1 and {most}, got {value}"
                ));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "vision_config: {} attention heads do not share {} KV heads evenly",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim % 4 != 0 {
            return Err(format!(
                "vision_config.head_dim must be a multiple of 4 (two rotated halves), got {}",
                self.head_dim
            ));
        }
        if i64::from(self.num_attention_heads) * i64::from(self.head_dim) > i64::from(MAX_HIDDEN) {
            return Err("vision_config: the attention heads are too wide".into());
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(format!(
                "vision_config.rms_norm_eps must be a positive number, got {}",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// `rope_parameters.rope_theta` (mlx-vlm's default 100).
    fn rope_theta(&self) -> std::result::Result<f32, String> {
        match self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
        {
            None | Some(Value::Null) => Ok(100.0),
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite() && *t > 0.0)
                .map(|t| t as f32)
                .ok_or_else(|| {
                    format!("vision_config.rope_parameters.rope_theta must be positive, got {v}")
                }),
        }
    }

    /// Pixels an image side must be a multiple of: a pooled block's.
    pub fn factor(&self) -> i32 {
        self.patch_size * self.pooling_kernel_size
    }
}

/// A linear map without bias that may clip its input and its output (`ClippableLinear`).
#[derive(Clone)]
struct ClippedLinear {
    linear: Linear,
    /// Input min and max, output min and max (scalars), when the tower clips.
    bounds: Option<[Array; 4]>,
}

impl ClippedLinear {
    fn load(
        cx: &mut LoadContext<'_>,
        quantization: &Quantization,
        path: &str,
        input: i32,
        output: i32,
        clipped: bool,
    ) -> Result<Self> {
        let linear = Linear::load(
            cx.weights,
            quantization,
            &format!("{path}.linear"),
            input,
            output,
            false,
        )?;
        let bounds = match clipped {
            false => None,
            true => {
                let mut take = |name: &str| cx.weights.take_shaped(&format!("{path}.{name}"), &[]);
                Some([
                    take("input_min")?,
                    take("input_max")?,
                    take("output_min")?,
                    take("output_max")?,
                ])
            }
        };
        Ok(Self { linear, bounds })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        match &self.bounds {
            None => self.linear.forward(x),
            Some([in_min, in_max, out_min, out_max]) => {
                let x = ops::clip(x, (in_min, in_max))?;
                let y = self.linear.forward(&x)?;
                Ok(ops::clip(&y, (out_min, out_max))?)
            }
        }
    }
}

/// One encoder block.
#[derive(Clone)]
struct Block {
    input_layernorm: RmsNorm,
    q_proj: ClippedLinear,
    k_proj: ClippedLinear,
    v_proj: ClippedLinear,
    o_proj: ClippedLinear,
    /// The per-head query and key norms' scales `[head_dim]`.
    q_norm: Array,
    k_norm: Array,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    gate_proj: ClippedLinear,
    up_proj: ClippedLinear,
    down_proj: ClippedLinear,
    post_feedforward_layernorm: RmsNorm,
}

/// Gemma 4's vision tower and its embedder (see the module docs).
#[derive(Clone)]
pub struct Gemma4VisionTower {
    args: Gemma4VisionArgs,
    input_proj: Linear,
    /// `[2 · positions, hidden]`: the columns' embeddings, then the rows'.
    position_table: Array,
    blocks: Vec<Block>,
    /// `std_bias` and `std_scale` `[hidden]`, with `standardize`.
    standardize: Option<(Array, Array)>,
    projection: Linear,
    theta: f32,
}

impl Gemma4VisionTower {
    /// The tower from a config's `vision_config` (and `text_config.hidden_size`, the embedder's
    /// width) and the checkpoint's `vision_tower.` and `embed_vision.` weights (taken from
    /// `cx.weights`; quantized linears where the checkpoint has them).
    pub fn load(cx: &mut LoadContext<'_>) -> Result<Self> {
        let vision = cx
            .config
            .get("vision_config")
            .ok_or_else(|| cx.error("a gemma4 config without `vision_config`".into()))?;
        let args: Gemma4VisionArgs = cx.parse_value(vision, "vision_config")?;
        args.validate().map_err(|m| cx.error(m))?;
        if !args.use_clipped_linears {
            // Bounds a checkpoint may carry unused (mlx-vlm's `sanitize` drops them too).
            cx.weights.discard_where(|name| {
                name.starts_with("vision_tower.")
                    && ["input_min", "input_max", "output_min", "output_max"]
                        .iter()
                        .any(|s| name.ends_with(s))
            });
        }
        let theta = args.rope_theta().map_err(|m| cx.error(m))?;
        let text_hidden = cx
            .config
            .get("text_config")
            .and_then(|t| t.get("hidden_size"))
            .and_then(Value::as_i64)
            .filter(|&h| (1..=i64::from(MAX_HIDDEN)).contains(&h))
            .ok_or_else(|| {
                cx.error(format!(
                    "text_config.hidden_size must be between 1 and {MAX_HIDDEN}"
                ))
            })? as i32;
        let quantization = Quantization::from_config(cx.config).map_err(|m| cx.error(m))?;
        let (d, p, n) = (
            args.hidden_size,
            args.patch_size,
            args.position_embedding_size,
        );
        let input_proj = Linear::load(
            cx.weights,
            &quantization,
            "vision_tower.patch_embedder.input_proj",
            3 * p * p,
            d,
            false,
        )?;
        let position_table = cx
            .weights
            .take_shaped(
                "vision_tower.patch_embedder.position_embedding_table",
                &[2, n, d],
            )?
            .reshape(&[2 * n, d])?;
        let (heads, kv_heads, hd) = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        );
        let (eps, clipped, inter) = (
            args.rms_norm_eps,
            args.use_clipped_linears,
            args.intermediate_size,
        );
        let mut blocks = Vec::with_capacity(args.num_hidden_layers as usize);
        for i in 0..args.num_hidden_layers {
            let path = format!("vision_tower.encoder.layers.{i}");
            let mut linear = |name: &str, input: i32, output: i32| {
                ClippedLinear::load(
                    cx,
                    &quantization,
                    &format!("{path}.{name}"),
                    input,
                    output,
                    clipped,
                )
            };
            let q_proj = linear("self_attn.q_proj", d, heads * hd)?;
            let k_proj = linear("self_attn.k_proj", d, kv_heads * hd)?;
            let v_proj = linear("self_attn.v_proj", d, kv_heads * hd)?;
            let o_proj = linear("self_attn.o_proj", heads * hd, d)?;
            let gate_proj = linear("mlp.gate_proj", d, inter)?;
            let up_proj = linear("mlp.up_proj", d, inter)?;
            let down_proj = linear("mlp.down_proj", inter, d)?;
            let w = &mut *cx.weights;
            let norm = |w: &mut crate::nn::weights::Weights, name: &str| {
                RmsNorm::load(w, &format!("{path}.{name}"), d, eps)
            };
            blocks.push(Block {
                input_layernorm: norm(w, "input_layernorm")?,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm: w.take_shaped(&format!("{path}.self_attn.q_norm.weight"), &[hd])?,
                k_norm: w.take_shaped(&format!("{path}.self_attn.k_norm.weight"), &[hd])?,
                post_attention_layernorm: norm(w, "post_attention_layernorm")?,
                pre_feedforward_layernorm: norm(w, "pre_feedforward_layernorm")?,
                gate_proj,
                up_proj,
                down_proj,
                post_feedforward_layernorm: norm(w, "post_feedforward_layernorm")?,
            });
        }
        let standardize = match args.standardize {
            false => None,
            true => Some((
                cx.weights.take_shaped("vision_tower.std_bias", &[d])?,
                cx.weights.take_shaped("vision_tower.std_scale", &[d])?,
            )),
        };
        let projection = Linear::load(
            cx.weights,
            &quantization,
            "embed_vision.embedding_projection",
            d,
            text_hidden,
            false,
        )?;
        Ok(Self {
            args,
            input_proj,
            position_table,
            blocks,
            standardize,
            projection,
            theta,
        })
    }

    pub fn args(&self) -> &Gemma4VisionArgs {
        &self.args
    }

    /// The soft tokens of an image of `[height, width, channels]` pixel values; `None` for a
    /// shape the tower does not take (not three channels, a side that is not a positive
    /// multiple of [`Gemma4VisionArgs::factor`], more patches on a side than it has position
    /// embeddings).
    pub fn soft_tokens(&self, shape: &[usize]) -> Option<usize> {
        let (f, p) = (self.args.factor() as usize, self.args.patch_size as usize);
        let most = self.args.position_embedding_size as usize;
        let fits = shape.len() == 3
            && shape[2] == 3
            && shape[0] > 0
            && shape[1] > 0
            && shape[0].is_multiple_of(f)
            && shape[1].is_multiple_of(f)
            && shape[0] / p <= most
            && shape[1] / p <= most;
        fits.then(|| (shape[0] / f) * (shape[1] / f))
    }

    /// Features of one image: pixel values `[height, width, 3]` (float, any dtype) in a shape
    /// [`soft_tokens`](Self::soft_tokens) takes → `[soft tokens, text hidden]`. `Err` for other
    /// shapes.
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let a = &self.args;
        let shape = pixels.shape();
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if self.soft_tokens(&dims).is_none() {
            return Err(EngineError::Request(format!(
                "pixel values of shape {shape:?}; the vision tower takes [height, width, 3] with \
                 both sides multiples of {} and at most {} patches a side",
                a.factor(),
                a.position_embedding_size
            )));
        }
        let p = a.patch_size;
        let (rows, cols) = (shape[0] / p, shape[1] / p);
        let n = rows * cols;
        let f32_scalar = |v: f32| Array::from_f32(v);
        // [rows, p, cols, p, 3] → [rows, cols, p, p, 3]: each patch's pixels row by row.
        let patches = pixels
            .as_dtype(Dtype::Float32)?
            .reshape(&[rows, p, cols, p, 3])?
            .transpose_axes(&[0, 2, 1, 3, 4])?
            .reshape(&[n, p * p * 3])?;
        let patches = ops::multiply(f32_scalar(2.0), &ops::subtract(&patches, f32_scalar(0.5))?)?;
        let dtype = self.position_table.dtype();
        let h = self.input_proj.forward(&patches.as_dtype(dtype)?)?;
        // Patch i sits at row i / cols, column i % cols.
        let columns: Vec<i32> = (0..n).map(|i| i % cols).collect();
        let rows_of: Vec<i32> = (0..n)
            .map(|i| a.position_embedding_size + i / cols)
            .collect();
        let table = |at: Vec<i32>| {
            self.position_table
                .take_axis(Array::from_slice(&at, &[n]), 0)
        };
        let positions = ops::add(&table(columns)?, &table(rows_of)?)?;
        let mut h = ops::add(&h, &positions)?.reshape(&[1, n, a.hidden_size])?;
        let rotary = self.rotary(rows, cols)?;
        for block in &self.blocks {
            h = self.block(block, &h, &rotary)?;
        }
        // Average each k × k block of patches (float32), blocks row by row.
        let k = a.pooling_kernel_size;
        let d = a.hidden_size;
        let pooled = if k == 1 {
            h.reshape(&[n, d])?
        } else {
            let weighted = ops::multiply(
                &h.as_dtype(Dtype::Float32)?,
                f32_scalar(1.0 / (k * k) as f32),
            )?;
            weighted
                .reshape(&[rows / k, k, cols / k, k, d])?
                .sum_axes(&[1, 3], false)?
                .reshape(&[-1, d])?
                .as_dtype(h.dtype())?
        };
        let root = Array::from_f32((d as f32).sqrt()).as_dtype(pooled.dtype())?;
        let mut x = ops::multiply(&pooled, &root)?;
        if let Some((bias, scale)) = &self.standardize {
            x = ops::multiply(&ops::subtract(&x, bias)?, scale)?;
        }
        let normed = fast::rms_norm(&x, None, a.rms_norm_eps)?;
        self.projection.forward(&normed)
    }

    /// The 2-D RoPE's cosines and sines for a `rows × cols` patch grid, each `[1, patches, 1,
    /// half]` float32 (`half = head_dim / 2`): the columns' for a head's first half, the rows'
    /// for its second (mlx-vlm's `apply_multidimensional_rope`).
    fn rotary(&self, rows: i32, cols: i32) -> Result<[(Array, Array); 2]> {
        let n = rows * cols;
        let half = self.args.head_dim / 2;
        let quarter = half / 2;
        let exponents = ops::multiply(
            Array::from_f32(2.0 / half as f32),
            &ops::arange::<_, f32>(0, quarter, None)?,
        )?;
        let timescale = ops::power(Array::from_f32(self.theta), &exponents)?;
        let axis = |values: Vec<i32>| -> Result<(Array, Array)> {
            let positions = Array::from_slice(&values, &[n, 1]).as_dtype(Dtype::Float32)?;
            let angles = ops::divide(&positions, &timescale)?;
            let both = |a: Array| -> Result<Array> {
                Ok(ops::concatenate(&[&a, &a], -1)?.reshape(&[1, n, 1, half])?)
            };
            Ok((both(ops::cos(&angles)?)?, both(ops::sin(&angles)?)?))
        };
        Ok([
            axis((0..n).map(|i| i % cols).collect())?,
            axis((0..n).map(|i| i / cols).collect())?,
        ])
    }

    fn block(&self, b: &Block, x: &Array, rotary: &[(Array, Array); 2]) -> Result<Array> {
        let a = &self.args;
        let (len, hd) = (x.shape()[1], a.head_dim);
        let eps = a.rms_norm_eps;
        let normed = b.input_layernorm.forward(x)?;
        let heads = |proj: &ClippedLinear, norm: Option<&Array>, count: i32| -> Result<Array> {
            let y = proj.forward(&normed)?.reshape(&[1, len, count, hd])?;
            float32_rms_norm(&y, norm, eps)
        };
        let q = rotate_2d(
            &heads(&b.q_proj, Some(&b.q_norm), a.num_attention_heads)?,
            rotary,
        )?;
        let k = rotate_2d(
            &heads(&b.k_proj, Some(&b.k_norm), a.num_key_value_heads)?,
            rotary,
        )?;
        let v = heads(&b.v_proj, None, a.num_key_value_heads)?;
        let t = |y: &Array| y.transpose_axes(&[0, 2, 1, 3]);
        let attended =
            fast::scaled_dot_product_attention(&t(&q)?, &t(&k)?, &t(&v)?, 1.0, None, None)?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[1, len, a.num_attention_heads * hd])?;
        let r = b
            .post_attention_layernorm
            .forward(&b.o_proj.forward(&attended)?)?;
        let h = ops::add(x, &r)?;
        let y = b.pre_feedforward_layernorm.forward(&h)?;
        let gated = ops::multiply(
            &gelu_approx(&b.gate_proj.forward(&y)?)?,
            &b.up_proj.forward(&y)?,
        )?;
        let r = b
            .post_feedforward_layernorm
            .forward(&b.down_proj.forward(&gated)?)?;
        Ok(ops::add(&h, &r)?)
    }
}

/// RMSNorm over the last axis computed in float32 (mlx-vlm's `VisionRMSNorm`, or without a scale
/// its `VisionRMSNormNoScale`), the result in `x`'s dtype.
fn float32_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    let xf = x.as_dtype(Dtype::Float32)?;
    let mean = ops::square(&xf)?.mean_axes(&[-1], true)?;
    let normed = ops::multiply(&xf, &ops::rsqrt(&ops::add(&mean, Array::from_f32(eps))?)?)?;
    let scaled = match weight {
        Some(w) => ops::multiply(&normed, &w.as_dtype(Dtype::Float32)?)?,
        None => normed,
    };
    Ok(scaled.as_dtype(x.dtype())?)
}

/// Each head's halves `[1, patches, heads, head_dim]` turned by their own positions
/// (`rotary[0]` the first half, `rotary[1]` the second), `x cos + rotate_half(x) sin` within
/// each half, the cosines and sines in `x`'s dtype.
fn rotate_2d(x: &Array, rotary: &[(Array, Array); 2]) -> Result<Array> {
    let s = x.shape();
    let half = s[3] / 2;
    let quarter = half / 2;
    let part = |from: i32, width: i32| {
        crate::nn::mlx_ext::slice(x, &[0, 0, 0, from], &[s[0], s[1], s[2], from + width])
    };
    let mut parts = Vec::with_capacity(2);
    for (i, (cos, sin)) in rotary.iter().enumerate() {
        let start = i as i32 * half;
        let (x1, x2) = (part(start, quarter)?, part(start + quarter, quarter)?);
        let rotated = ops::concatenate(&[&ops::negative(&x2)?, &x1], -1)?;
        let whole = ops::concatenate(&[&x1, &x2], -1)?;
        let (cos, sin) = (cos.as_dtype(x.dtype())?, sin.as_dtype(x.dtype())?);
        parts.push(ops::add(
            &ops::multiply(&whole, &cos)?,
            &ops::multiply(&rotated, &sin)?,
        )?);
    }
    Ok(ops::concatenate(&parts, -1)?)
}
