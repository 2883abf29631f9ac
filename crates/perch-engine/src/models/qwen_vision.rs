//! The vision tower of Qwen3.5 and Qwen3.6 (`qwen3_5`, `qwen3_5_moe` checkpoints as mlx-community
//! ships them: mlx-vlm's key names under `vision_tower.`), Qwen3-VL's without its deepstack
//! mergers. Reference: mlx-vlm 0.7.6 `models/qwen3_vl/vision.py` (which `models/qwen3_5` reuses).
//!
//! Shapes: one image's pixel values `[height, width, channels]` (channels last, resized to
//! multiples of `patch_size · spatial_merge_size` and normalized as the model's processor does)
//! → features `[tokens, out_hidden_size]`, a token per `spatial_merge_size²` patches, in the
//! order the prompt's image tokens take them: merge blocks row by row, each block's patches row
//! by row inside it (Qwen's processor's order).
//!
//! The computation:
//! - Patches of `patch × patch` pixels, each a still image's frame repeated `temporal_patch_size`
//!   times (the processor's order `[channels, time, row, column]`), embedded by the 3-D
//!   convolution's weight `[hidden, time, patch, patch, channels]` as one product plus its bias.
//! - A learned position embedding from a `G × G` grid (`num_position_embeddings = G²`),
//!   bilinearly interpolated to the image's patch grid (`linspace(0, G - 1, n)` per side, corners
//!   aligned), added to each patch.
//! - `depth` pre-norm blocks: LayerNorm (ε 1e-6), attention over all the image's patches (no
//!   mask) with a fused biased `qkv` projection and a 2-D rotary embedding on queries and keys
//!   (each head's first half turned by the patch's row, its second by its column: frequencies
//!   `θ^(-2i / (head_dim / 2))`, θ = 10,000, applied as `x cos + rotate_half(x) sin` in float32),
//!   LayerNorm, `fc2(gelu_tanh(fc1(x)))`.
//! - The merger: LayerNorm (ε 1e-6) per patch, each merge block's patches side by side, `fc2(gelu(
//!   fc1(x)))` (exact GELU) to the text model's width.

use mlx_rs::{fast, ops, Array, Dtype};
use serde::Deserialize;

use super::LoadContext;
use crate::error::{EngineError, Result};
use crate::nn::layers::{gelu_approx, Embedding, LayerNorm, Linear, Quantization};

/// `vision_config`'s fields, mlx-vlm's `VisionConfig` defaults (Qwen3-VL's).
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct QwenVisionArgs {
    pub depth: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub out_hidden_size: i32,
    pub num_heads: i32,
    pub patch_size: i32,
    pub temporal_patch_size: i32,
    pub spatial_merge_size: i32,
    pub in_channels: i32,
    pub num_position_embeddings: i32,
    pub deepstack_visual_indexes: Vec<i32>,
}

impl Default for QwenVisionArgs {
    fn default() -> Self {
        Self {
            depth: 32,
            hidden_size: 1280,
            intermediate_size: 3420,
            out_hidden_size: 1536,
            num_heads: 16,
            patch_size: 14,
            temporal_patch_size: 2,
            spatial_merge_size: 2,
            in_channels: 3,
            num_position_embeddings: 2304,
            deepstack_visual_indexes: Vec::new(),
        }
    }
}

/// Bounds far above any released tower, low enough that a hostile config cannot ask for absurd
/// shapes.
const MAX_HIDDEN: i32 = 16_384;
const MAX_DEPTH: i32 = 256;
const MAX_PATCH: i32 = 64;
const MAX_POSITIONS: i32 = 1 << 20;

/// The rotary embedding's base (mlx-vlm's `VisionRotaryEmbedding` default).
const ROPE_THETA: f32 = 10_000.0;
const LAYER_NORM_EPS: f32 = 1e-6;

impl QwenVisionArgs {
    /// `Err` names the first field that cannot describe this tower.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let ranges = [
            ("depth", self.depth, MAX_DEPTH),
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("intermediate_size", self.intermediate_size, 4 * MAX_HIDDEN),
            ("out_hidden_size", self.out_hidden_size, MAX_HIDDEN),
            ("num_heads", self.num_heads, MAX_HIDDEN),
            ("patch_size", self.patch_size, MAX_PATCH),
            ("temporal_patch_size", self.temporal_patch_size, 8),
            ("spatial_merge_size", self.spatial_merge_size, 8),
            ("in_channels", self.in_channels, 4),
            (
                "num_position_embeddings",
                self.num_position_embeddings,
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
        if self.hidden_size % self.num_heads != 0 || (self.hidden_size / self.num_heads) % 4 != 0 {
            return Err(format!(
                "vision_config.hidden_size ({}) must be num_heads ({}) heads of a multiple of 4 \
                 features (the 2-D rotary embedding turns a quarter of each head per axis)",
                self.hidden_size, self.num_heads
            ));
        }
        let side = self.grid_side();
        if side * side != self.num_position_embeddings {
            return Err(format!(
                "vision_config.num_position_embeddings must be a square number, got {}",
                self.num_position_embeddings
            ));
        }
        if !self.deepstack_visual_indexes.is_empty() {
            return Err(
                "vision_config.deepstack_visual_indexes: deepstack features (Qwen3-VL) are not \
                 supported; Qwen3.5 has none"
                    .into(),
            );
        }
        Ok(())
    }

    /// The side of the learned position embeddings' square grid.
    fn grid_side(&self) -> i32 {
        (f64::from(self.num_position_embeddings.max(0))
            .sqrt()
            .round()) as i32
    }

    /// Pixels an image side must be a multiple of: a merge block's.
    pub fn factor(&self) -> i32 {
        self.patch_size * self.spatial_merge_size
    }
}

/// One pre-norm block.
#[derive(Clone)]
struct Block {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// Qwen3.5's vision tower (see the module docs).
#[derive(Clone)]
pub struct QwenVisionTower {
    args: QwenVisionArgs,
    /// The convolution's weight as `[time · patch · patch · channels, hidden]`.
    patch_weight: Array,
    patch_bias: Array,
    pos_embed: Embedding,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    /// `1 / θ^(2i / (head_dim / 2))` for `i < head_dim / 4`, float32.
    inv_freq: Array,
}

impl QwenVisionTower {
    /// The tower from a config's `vision_config` and the checkpoint's `vision_tower.` weights
    /// (taken from `cx.weights`; quantized linears where the checkpoint has them).
    pub fn load(cx: &mut LoadContext<'_>) -> Result<Self> {
        let vision = cx
            .config
            .get("vision_config")
            .ok_or_else(|| cx.error("a vision-language config without `vision_config`".into()))?;
        let args: QwenVisionArgs = cx.parse_value(vision, "vision_config")?;
        args.validate().map_err(|m| cx.error(m))?;
        let quantization = Quantization::from_config(cx.config).map_err(|m| cx.error(m))?;
        let (d, p, t, c) = (
            args.hidden_size,
            args.patch_size,
            args.temporal_patch_size,
            args.in_channels,
        );
        let patch_weight = cx
            .weights
            .take_shaped("vision_tower.patch_embed.proj.weight", &[d, t, p, p, c])?
            .reshape(&[d, t * p * p * c])?
            .transpose()?;
        let patch_bias = cx
            .weights
            .take_shaped("vision_tower.patch_embed.proj.bias", &[d])?;
        let pos_embed = Embedding::load_lookup_only(
            cx.weights,
            &quantization,
            "vision_tower.pos_embed",
            args.num_position_embeddings,
            d,
        )?;
        let linear = |cx: &mut LoadContext<'_>, path: &str, input: i32, output: i32| {
            Linear::load(cx.weights, &quantization, path, input, output, true)
        };
        let mut blocks = Vec::with_capacity(args.depth as usize);
        for i in 0..args.depth {
            let path = format!("vision_tower.blocks.{i}");
            blocks.push(Block {
                norm1: LayerNorm::load(cx.weights, &format!("{path}.norm1"), d, LAYER_NORM_EPS)?,
                qkv: linear(cx, &format!("{path}.attn.qkv"), d, 3 * d)?,
                proj: linear(cx, &format!("{path}.attn.proj"), d, d)?,
                norm2: LayerNorm::load(cx.weights, &format!("{path}.norm2"), d, LAYER_NORM_EPS)?,
                fc1: linear(
                    cx,
                    &format!("{path}.mlp.linear_fc1"),
                    d,
                    args.intermediate_size,
                )?,
                fc2: linear(
                    cx,
                    &format!("{path}.mlp.linear_fc2"),
                    args.intermediate_size,
                    d,
                )?,
            });
        }
        let merged = d * args.spatial_merge_size * args.spatial_merge_size;
        let merger_norm =
            LayerNorm::load(cx.weights, "vision_tower.merger.norm", d, LAYER_NORM_EPS)?;
        let merger_fc1 = linear(cx, "vision_tower.merger.linear_fc1", merged, merged)?;
        let merger_fc2 = linear(
            cx,
            "vision_tower.merger.linear_fc2",
            merged,
            args.out_hidden_size,
        )?;
        // mlx-vlm: `1 / θ ** (arange(0, dim, 2) / dim)` with `dim = head_dim / 2`, float32.
        let dim = d / args.num_heads / 2;
        let steps: Vec<f32> = (0..dim).step_by(2).map(|i| i as f32).collect();
        let exponents = ops::divide(
            Array::from_slice(&steps, &[steps.len() as i32]),
            Array::from_f32(dim as f32),
        )?;
        let inv_freq = ops::divide(
            Array::from_f32(1.0),
            &ops::power(Array::from_f32(ROPE_THETA), &exponents)?,
        )?;
        Ok(Self {
            args,
            patch_weight,
            patch_bias,
            pos_embed,
            blocks,
            merger_norm,
            merger_fc1,
            merger_fc2,
            inv_freq,
        })
    }

    pub fn args(&self) -> &QwenVisionArgs {
        &self.args
    }

    /// The token grid (rows, columns: a token per merge block) of an image of `[height, width,
    /// channels]` pixel values; `None` for a shape the tower does not take (other channels, a
    /// side that is not a positive multiple of [`QwenVisionArgs::factor`]).
    pub fn grid(&self, shape: &[usize]) -> Option<(usize, usize)> {
        let f = self.args.factor() as usize;
        let fits = shape.len() == 3
            && shape[2] == self.args.in_channels as usize
            && shape[0] > 0
            && shape[1] > 0
            && shape[0].is_multiple_of(f)
            && shape[1].is_multiple_of(f);
        fits.then(|| (shape[0] / f, shape[1] / f))
    }

    /// Features of one image: pixel values `[height, width, channels]` (float, any dtype; computed
    /// in the weights' dtype), both sides multiples of [`QwenVisionArgs::factor`] →
    /// `[tokens, out_hidden_size]`. `Err` for other shapes.
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let a = &self.args;
        let shape = pixels.shape();
        let factor = a.factor();
        let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if self.grid(&dims).is_none() {
            return Err(EngineError::Request(format!(
                "pixel values of shape {shape:?}; the vision tower takes [height, width, {}] with \
                 both sides multiples of {factor}",
                a.in_channels
            )));
        }
        let (p, m, t, c) = (
            a.patch_size,
            a.spatial_merge_size,
            a.temporal_patch_size,
            a.in_channels,
        );
        let (rows, cols) = (shape[0] / p, shape[1] / p);
        let n = rows * cols;
        let dtype = self.patch_weight.dtype();
        // [rows/m, m, p, cols/m, m, p, c] → [rows/m, cols/m, m, m, p, p, c]: each patch's pixels
        // in merge-block order, then its frame repeated along time.
        let patches = pixels
            .as_dtype(dtype)?
            .reshape(&[rows / m, m, p, cols / m, m, p, c])?
            .transpose_axes(&[0, 3, 1, 4, 2, 5, 6])?
            .reshape(&[n, 1, p * p * c])?;
        let patches =
            ops::broadcast_to(&patches, &[n, t, p * p * c])?.reshape(&[n, t * p * p * c])?;
        let mut h = ops::add(
            &ops::matmul(&patches, &self.patch_weight)?,
            &self.patch_bias,
        )?;
        h = ops::add(&h, &self.position_embeddings(rows, cols)?)?;
        let (cos, sin) = self.rotary(rows, cols)?;
        for block in &self.blocks {
            h = self.block(block, &h, &cos, &sin)?;
        }
        let merged = a.hidden_size * m * m;
        let x = self.merger_norm.forward(&h)?.reshape(&[-1, merged])?;
        self.merger_fc2
            .forward(&gelu(&self.merger_fc1.forward(&x)?)?)
    }

    /// The learned position embeddings interpolated to a `rows × cols` patch grid, in
    /// merge-block order: `[rows · cols, hidden]` (mlx-vlm's `fast_pos_embed_interpolate`).
    fn position_embeddings(&self, rows: i32, cols: i32) -> Result<Array> {
        let g = self.args.grid_side();
        let last = (g - 1) as f32;
        let side = |count: i32| -> Result<(Array, Array, Array)> {
            let at = ops::linspace::<f32, f32>(
                0.0,
                last,
                ops::LinspaceOptions {
                    count,
                    endpoint: true,
                },
            )?;
            let floor = at.as_dtype(Dtype::Int32)?;
            let ceil = ops::minimum(
                &ops::add(&floor, Array::from_int(1))?,
                Array::from_int(g - 1),
            )?;
            let fraction = ops::subtract(&at, &floor.as_dtype(Dtype::Float32)?)?;
            Ok((floor, ceil, fraction))
        };
        let (h_floor, h_ceil, dh) = side(rows)?;
        let (w_floor, w_ceil, dw) = side(cols)?;
        let column = |a: &Array| a.reshape(&[-1, 1]);
        let row = |a: &Array| a.reshape(&[1, -1]);
        let index = |h: &Array, w: &Array| -> Result<Array> {
            let base = ops::multiply(h, Array::from_int(g))?;
            Ok(ops::add(&column(&base)?, &row(w)?)?.reshape(&[-1])?)
        };
        let one = Array::from_f32(1.0);
        let (rh, rw) = (ops::subtract(&one, &dh)?, ops::subtract(&one, &dw)?);
        let weight = |a: &Array, b: &Array| -> Result<Array> {
            Ok(ops::multiply(&column(a)?, &row(b)?)?.reshape(&[-1])?)
        };
        let corners = [
            (index(&h_floor, &w_floor)?, weight(&rh, &rw)?),
            (index(&h_floor, &w_ceil)?, weight(&rh, &dw)?),
            (index(&h_ceil, &w_floor)?, weight(&dh, &rw)?),
            (index(&h_ceil, &w_ceil)?, weight(&dh, &dw)?),
        ];
        let mut sum: Option<Array> = None;
        for (index, weight) in &corners {
            let rows_of = self.pos_embed.forward(index)?;
            let weighted = ops::multiply(
                &rows_of,
                &weight.as_dtype(rows_of.dtype())?.reshape(&[-1, 1])?,
            )?;
            sum = Some(match sum {
                Some(s) => ops::add(&s, &weighted)?,
                None => weighted,
            });
        }
        let sum = sum.expect("four corners");
        let (m, d) = (self.args.spatial_merge_size, self.args.hidden_size);
        Ok(sum
            .reshape(&[rows / m, m, cols / m, m, d])?
            .transpose_axes(&[0, 2, 1, 3, 4])?
            .reshape(&[-1, d])?)
    }

    /// The 2-D rotary embedding's cosines and sines `[rows · cols, head_dim]` (float32), each
    /// patch's row turning the first half of a head's frequencies and its column the second, in
    /// merge-block order (mlx-vlm's `rot_pos_emb` and `apply_rotary_pos_emb_vision`).
    fn rotary(&self, rows: i32, cols: i32) -> Result<(Array, Array)> {
        let m = self.args.spatial_merge_size;
        let (mut row_ids, mut col_ids) = (Vec::new(), Vec::new());
        for br in 0..rows / m {
            for bc in 0..cols / m {
                for ir in 0..m {
                    for ic in 0..m {
                        row_ids.push(br * m + ir);
                        col_ids.push(bc * m + ic);
                    }
                }
            }
        }
        let longest = rows.max(cols);
        let positions = Array::from_iter((0..longest).map(|i| i as f32), &[longest, 1]);
        let table = ops::multiply(&positions, &self.inv_freq.reshape(&[1, -1])?)?;
        let n = row_ids.len() as i32;
        let freqs = ops::concatenate(
            &[
                table.take_axis(Array::from_slice(&row_ids, &[n]), 0)?,
                table.take_axis(Array::from_slice(&col_ids, &[n]), 0)?,
            ],
            -1,
        )?;
        let twice = |a: Array| ops::concatenate(&[a.clone(), a], -1);
        Ok((twice(ops::cos(&freqs)?)?, twice(ops::sin(&freqs)?)?))
    }

    fn block(&self, block: &Block, x: &Array, cos: &Array, sin: &Array) -> Result<Array> {
        let a = &self.args;
        let (n, d, heads) = (x.shape()[0], a.hidden_size, a.num_heads);
        let head_dim = d / heads;
        let qkv = block
            .qkv
            .forward(&block.norm1.forward(x)?)?
            .reshape(&[n, 3, heads, head_dim])?;
        let part = |i: i32| -> Result<Array> {
            Ok(
                crate::nn::mlx_ext::slice(&qkv, &[0, i, 0, 0], &[n, i + 1, heads, head_dim])?
                    .reshape(&[n, heads, head_dim])?,
            )
        };
        // `[n, heads, head_dim]` turned by each patch's angles (`[n, 1, head_dim]`), in float32,
        // back in the input's dtype.
        let (cos, sin) = (
            cos.reshape(&[n, 1, head_dim])?,
            sin.reshape(&[n, 1, head_dim])?,
        );
        let rotate = |v: &Array| -> Result<Array> {
            let half = head_dim / 2;
            let first = crate::nn::mlx_ext::slice(v, &[0, 0, 0], &[n, heads, half])?;
            let second = crate::nn::mlx_ext::slice(v, &[0, 0, half], &[n, heads, head_dim])?;
            let rotated = ops::concatenate(&[ops::negative(&second)?, first], -1)?;
            Ok(
                ops::add(&ops::multiply(v, &cos)?, &ops::multiply(&rotated, &sin)?)?
                    .as_dtype(v.dtype())?,
            )
        };
        let heads_first = |v: Array| {
            v.reshape(&[1, n, heads, head_dim])?
                .transpose_axes(&[0, 2, 1, 3])
        };
        let q = heads_first(rotate(&part(0)?)?)?;
        let k = heads_first(rotate(&part(1)?)?)?;
        let v = heads_first(part(2)?)?;
        let scale = (head_dim as f32).powf(-0.5);
        let attended = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[n, d])?;
        let h = ops::add(x, &block.proj.forward(&attended)?)?;
        let r = block.fc2.forward(&gelu_approx(
            &block.fc1.forward(&block.norm2.forward(&h)?)?,
        )?)?;
        Ok(ops::add(&h, &r)?)
    }
}

/// The exact GELU, `x (1 + erf(x / √2)) / 2`, each constant in `x`'s dtype (MLX's `nn.gelu`).
fn gelu(x: &Array) -> Result<Array> {
    let c = |v: f32| Array::from_f32(v).as_dtype(x.dtype());
    let erf = ops::erf(&ops::divide(x, &c(std::f32::consts::SQRT_2)?)?)?;
    Ok(ops::divide(
        &ops::multiply(x, &ops::add(&c(1.0)?, &erf)?)?,
        &c(2.0)?,
    )?)
}

/// An image's place in a prompt for [`mrope_positions`]: its first token's index and its token
/// grid (`rows · cols` tokens, row by row: the tower's patch grid divided by the merge size).
#[derive(Clone, Copy, Debug)]
pub struct ImagePlace {
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Qwen's multimodal RoPE positions of a prompt of `len` tokens holding `images` (in order, not
/// overlapping): per token `[time, row, column]`, returned as three rows `[3][len]`, and the
/// delta every later position takes (`positions after the prompt = index + delta`). Text tokens
/// count on from the last position before them on all three axes; an image's tokens at base `b`
/// (the next position) take `(b, b + row, b + column)`, and the text after it resumes at `b +
/// max(rows, cols)` (the language model's `get_rope_index` in mlx-vlm 0.7.6, still images:
/// one temporal step). `Err` for images outside the prompt, overlapping or out of order.
pub fn mrope_positions(len: usize, images: &[ImagePlace]) -> Result<([Vec<i32>; 3], i32)> {
    let mut positions: [Vec<i32>; 3] = Default::default();
    for axis in &mut positions {
        axis.reserve(len);
    }
    let mut next = 0i64;
    let mut at = 0usize;
    let text = |positions: &mut [Vec<i32>; 3], next: &mut i64, count: usize| {
        for i in 0..count as i64 {
            for axis in positions.iter_mut() {
                axis.push((*next + i) as i32);
            }
        }
        *next += count as i64;
    };
    for image in images {
        let tokens = image.rows.checked_mul(image.cols);
        let end = tokens.and_then(|t| image.start.checked_add(t));
        let fits =
            image.start >= at && end.is_some_and(|e| e <= len) && image.rows > 0 && image.cols > 0;
        if !fits {
            return Err(EngineError::Request(format!(
                "an image of {} × {} tokens at {} does not fit a prompt of {len} tokens after the \
                 one before it (ending at {at})",
                image.rows, image.cols, image.start
            )));
        }
        text(&mut positions, &mut next, image.start - at);
        for row in 0..image.rows as i64 {
            for col in 0..image.cols as i64 {
                positions[0].push(next as i32);
                positions[1].push((next + row) as i32);
                positions[2].push((next + col) as i32);
            }
        }
        next += image.rows.max(image.cols) as i64;
        at = end.unwrap_or(len);
    }
    text(&mut positions, &mut next, len - at);
    if next > i64::from(i32::MAX) {
        return Err(EngineError::Request(format!(
            "a prompt of {len} tokens has positions past what RoPE takes"
        )));
    }
    Ok((positions, (next - len as i64) as i32))
}
