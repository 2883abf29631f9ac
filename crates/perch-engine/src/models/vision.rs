//! Vision towers: an image's pixel values to the image features a vision-language model splices
//! into its prompt at its image tokens. Gemma 3 (`gemma3` checkpoints as mlx-community ships
//! them, mlx-vlm's key names): a SigLIP encoder (`vision_tower.vision_model.`) and Gemma 3's
//! multimodal projector (`multi_modal_projector.`), here; Qwen3.5's in [`super::qwen_vision`],
//! Gemma 4's in [`super::gemma4_vision`].
//!
//! Shapes: one image's pixel values `[height, width, channels]` (channels last, already resized
//! and normalized as the model's processor does) → features `[tokens, text hidden]`
//! ([`VisionTower::embed`]); Gemma 3's [`VisionTower::encode`] also takes `[images, side, side,
//! channels]` → `[images, tokens, text hidden]`.
//!
//! SigLIP (reference: mlx-vlm 0.7.6 `models/gemma3/vision.py`): non-overlapping `patch × patch`
//! patches embedded by one linear map (the convolution's weight `[hidden, patch, patch, channels]`
//! read as `[hidden, patch · patch · channels]`, plus its bias) and a learned position embedding per
//! patch; pre-norm encoder layers (LayerNorm, multi-head attention over all patches with biases and
//! no mask, LayerNorm, `fc2(gelu_tanh(fc1(x)))`), each adding to the residual; a final LayerNorm
//! (epsilon 1e-5, mlx-vlm's default). Gemma 3's projector (`Gemma3MultiModalProjector`): the patch
//! grid average-pooled to `mm_tokens_per_image` tokens (a square grid), an RMSNorm scaling by
//! `1 + weight`, then `x · mm_input_projection_weight` (`[vision hidden, text hidden]`).

use mlx_rs::{fast, ops, Array};
use serde::Deserialize;
use serde_json::Value;

use super::gemma4_vision::Gemma4VisionTower;
use super::qwen_vision::QwenVisionTower;
use super::LoadContext;
use crate::error::Result;
use crate::image_processor::Resize;
use crate::nn::layers::{gelu_approx, LayerNorm, Linear, Quantization, RmsNorm};

/// A vision config's fields (`vision_config`), mlx-vlm's `VisionConfig` defaults.
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct VisionArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub patch_size: i32,
    pub image_size: i32,
    pub num_channels: i32,
    pub layer_norm_eps: f32,
}

impl Default for VisionArgs {
    fn default() -> Self {
        // Gemma 3's SigLIP (so400m, 896 pixels).
        Self {
            hidden_size: 1152,
            num_hidden_layers: 27,
            intermediate_size: 4304,
            num_attention_heads: 16,
            patch_size: 14,
            image_size: 896,
            num_channels: 3,
            layer_norm_eps: 1e-6,
        }
    }
}

/// The largest image side, hidden size and layer count a vision config may name: far above any
/// released tower, low enough that a hostile config cannot ask for absurd shapes.
const MAX_IMAGE_SIZE: i32 = 8192;
const MAX_HIDDEN: i32 = 16_384;
const MAX_LAYERS: i32 = 256;

impl VisionArgs {
    /// `Err` names the first field that cannot describe a SigLIP tower.
    fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            ("intermediate_size", self.intermediate_size, 4 * MAX_HIDDEN),
            ("num_attention_heads", self.num_attention_heads, MAX_HIDDEN),
            ("patch_size", self.patch_size, MAX_IMAGE_SIZE),
            ("image_size", self.image_size, MAX_IMAGE_SIZE),
            ("num_channels", self.num_channels, 4),
        ];
        for (name, value, most) in positive {
            if !(1..=most).contains(&value) {
                return Err(format!(
                    "vision_config.{name} must be between 1 and {most}, got {value}"
                ));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(format!(
                "vision_config.hidden_size ({}) is not a multiple of num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.image_size % self.patch_size != 0 {
            return Err(format!(
                "vision_config.image_size ({}) is not a multiple of patch_size ({})",
                self.image_size, self.patch_size
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return Err(format!(
                "vision_config.layer_norm_eps must be a positive number, got {}",
                self.layer_norm_eps
            ));
        }
        Ok(())
    }

    fn patches_per_side(&self) -> i32 {
        self.image_size / self.patch_size
    }
}

/// One pre-norm SigLIP encoder layer.
#[derive(Clone)]
struct EncoderLayer {
    layer_norm1: LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    layer_norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl EncoderLayer {
    fn forward(&self, x: &Array, heads: i32) -> Result<Array> {
        let (n, len, dims) = (x.shape()[0], x.shape()[1], x.shape()[2]);
        let head_dim = dims / heads;
        let h = self.layer_norm1.forward(x)?;
        let split = |a: Array| -> Result<Array> {
            Ok(a.reshape(&[n, len, heads, head_dim])?
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        let q = split(self.q_proj.forward(&h)?)?;
        let k = split(self.k_proj.forward(&h)?)?;
        let v = split(self.v_proj.forward(&h)?)?;
        let scale = (head_dim as f32).powf(-0.5);
        let attended = fast::scaled_dot_product_attention(&q, &k, &v, scale, None, None)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[n, len, dims])?;
        let h = ops::add(x, &self.out_proj.forward(&attended)?)?;
        let r = self.fc2.forward(&gelu_approx(
            &self.fc1.forward(&self.layer_norm2.forward(&h)?)?,
        )?)?;
        Ok(ops::add(&h, &r)?)
    }
}

/// The SigLIP encoder.
#[derive(Clone)]
struct Siglip {
    args: VisionArgs,
    /// The patch embedding's weight as `[patch · patch · channels, hidden]`.
    patch_weight: Array,
    patch_bias: Array,
    /// `[patches, hidden]`.
    position_embedding: Array,
    layers: Vec<EncoderLayer>,
    post_layernorm: LayerNorm,
}

impl Siglip {
    fn load(cx: &mut LoadContext<'_>, args: VisionArgs, prefix: &str) -> Result<Self> {
        let (d, p, c) = (args.hidden_size, args.patch_size, args.num_channels);
        let patches = args.patches_per_side() * args.patches_per_side();
        let quantization = Quantization::from_config(cx.config).map_err(|m| cx.error(m))?;
        let embeddings = format!("{prefix}embeddings");
        let patch_weight = cx
            .weights
            .take_shaped(
                &format!("{embeddings}.patch_embedding.weight"),
                &[d, p, p, c],
            )?
            .reshape(&[d, p * p * c])?
            .transpose()?;
        let patch_bias = cx
            .weights
            .take_shaped(&format!("{embeddings}.patch_embedding.bias"), &[d])?;
        let position_embedding = cx.weights.take_shaped(
            &format!("{embeddings}.position_embedding.weight"),
            &[patches, d],
        )?;
        let eps = args.layer_norm_eps;
        let mut layers = Vec::with_capacity(args.num_hidden_layers as usize);
        for i in 0..args.num_hidden_layers {
            let path = format!("{prefix}encoder.layers.{i}");
            let mut linear = |name: &str, input: i32, output: i32| {
                Linear::load(
                    cx.weights,
                    &quantization,
                    &format!("{path}.{name}"),
                    input,
                    output,
                    true,
                )
            };
            let (q_proj, k_proj, v_proj, out_proj) = (
                linear("self_attn.q_proj", d, d)?,
                linear("self_attn.k_proj", d, d)?,
                linear("self_attn.v_proj", d, d)?,
                linear("self_attn.out_proj", d, d)?,
            );
            let fc1 = linear("mlp.fc1", d, args.intermediate_size)?;
            let fc2 = linear("mlp.fc2", args.intermediate_size, d)?;
            layers.push(EncoderLayer {
                layer_norm1: LayerNorm::load(cx.weights, &format!("{path}.layer_norm1"), d, eps)?,
                q_proj,
                k_proj,
                v_proj,
                out_proj,
                layer_norm2: LayerNorm::load(cx.weights, &format!("{path}.layer_norm2"), d, eps)?,
                fc1,
                fc2,
            });
        }
        let post_layernorm =
            LayerNorm::load(cx.weights, &format!("{prefix}post_layernorm"), d, 1e-5)?;
        Ok(Self {
            args,
            patch_weight,
            patch_bias,
            position_embedding,
            layers,
            post_layernorm,
        })
    }

    /// `[images, side, side, channels]` → `[images, patches, hidden]` (patches row-major).
    fn forward(&self, pixels: &Array) -> Result<Array> {
        let a = &self.args;
        let (n, p, grid) = (pixels.shape()[0], a.patch_size, a.patches_per_side());
        // [n, grid, p, grid, p, c] → [n, grid, grid, p, p, c]: each patch's values in the
        // convolution weight's order.
        let patches = pixels
            .reshape(&[n, grid, p, grid, p, a.num_channels])?
            .transpose_axes(&[0, 1, 3, 2, 4, 5])?
            .reshape(&[n, grid * grid, p * p * a.num_channels])?;
        let embedded = ops::add(
            &ops::matmul(&patches, &self.patch_weight)?,
            &self.patch_bias,
        )?;
        let mut h = ops::add(&embedded, &self.position_embedding)?;
        for layer in &self.layers {
            h = layer.forward(&h, a.num_attention_heads)?;
        }
        self.post_layernorm.forward(&h)
    }
}

/// Gemma 3's multimodal projector.
#[derive(Clone)]
struct Gemma3Projector {
    norm: RmsNorm,
    /// `[vision hidden, text hidden]`.
    weight: Array,
    /// Patches pooled into one token along each side.
    kernel: i32,
    tokens_per_side: i32,
}

/// A vision-language model's vision tower: Gemma 3's SigLIP and projector, Qwen3.5's
/// ([`QwenVisionTower`]) or Gemma 4's ([`Gemma4VisionTower`]).
#[derive(Clone)]
enum Tower {
    Gemma3 {
        siglip: Siglip,
        projector: Gemma3Projector,
    },
    Qwen(QwenVisionTower),
    Gemma4(Gemma4VisionTower),
}

/// A vision-language model's vision tower, with what the engine needs around it: the image
/// token its features replace and how they enter the embeddings.
#[derive(Clone)]
pub struct VisionTower {
    tower: Tower,
    /// The token a prompt holds at each image feature's place (`image_token_index`,
    /// `image_token_id`).
    image_token_id: u32,
    /// What the features are divided by before they replace their tokens' embeddings: Gemma's
    /// text model scales every embedding by `sqrt(hidden)`, so mlx-vlm divides the image
    /// features by it first. `None`: taken as they are (Qwen).
    splice_divisor: Option<f32>,
    /// Images encoded so far ([`VisionTower::passes`]), shared by the tower's copies.
    passes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// An image's tokens attend to each other in both directions ([`Self::attends_both_ways`]).
    both_ways: bool,
}

impl VisionTower {
    /// Qwen3.5's tower (see [`QwenVisionTower::load`]), its image token `image_token_id`
    /// (mlx-vlm's default 248,056).
    pub fn load_qwen(cx: &mut LoadContext<'_>) -> Result<Self> {
        let image_token_id = token_id(cx, "image_token_id", 248_056)?;
        Ok(Self {
            tower: Tower::Qwen(QwenVisionTower::load(cx)?),
            image_token_id,
            splice_divisor: None,
            passes: Default::default(),
            both_ways: false,
        })
    }

    /// Gemma 4's tower (see [`Gemma4VisionTower::load`]), its image token `image_token_id`
    /// (mlx-vlm's default 258,880). Its features replace their tokens' embeddings after the
    /// text model's embedding scale ([`super::decoder::BlockStyle::features_after_scale`]).
    pub fn load_gemma4(cx: &mut LoadContext<'_>) -> Result<Self> {
        let image_token_id = token_id(cx, "image_token_id", 258_880)?;
        Ok(Self {
            tower: Tower::Gemma4(Gemma4VisionTower::load(cx)?),
            image_token_id,
            splice_divisor: None,
            passes: Default::default(),
            both_ways: false,
        })
    }

    /// Gemma 3's tower from a `gemma3` config (its `vision_config`, `mm_tokens_per_image` and
    /// `text_config.hidden_size`) and the checkpoint's `vision_tower.` and
    /// `multi_modal_projector.` weights (taken from `cx.weights`).
    pub fn load_gemma3(cx: &mut LoadContext<'_>) -> Result<Self> {
        let vision = cx
            .config
            .get("vision_config")
            .ok_or_else(|| cx.error("a gemma3 config without `vision_config`".into()))?;
        let args: VisionArgs = cx.parse_value(vision, "vision_config")?;
        args.validate().map_err(|m| cx.error(m))?;
        let text = cx.config.get("text_config");
        let field = |name: &str| {
            cx.config
                .get(name)
                .or_else(|| text.and_then(|t| t.get(name)))
                .and_then(Value::as_i64)
        };
        // mlx-vlm's TextConfig default.
        let tokens = field("mm_tokens_per_image").unwrap_or(256);
        let text_hidden = text
            .and_then(|t| t.get("hidden_size"))
            .and_then(Value::as_i64)
            .ok_or_else(|| cx.error("text_config.hidden_size is missing".into()))?;
        let tokens_per_side = (tokens.max(0) as f64).sqrt() as i64;
        let grid = i64::from(args.patches_per_side());
        if tokens_per_side < 1 || tokens_per_side * tokens_per_side != tokens {
            return Err(cx.error(format!(
                "mm_tokens_per_image must be a positive square number, got {tokens}"
            )));
        }
        if grid % tokens_per_side != 0 {
            return Err(cx.error(format!(
                "the vision tower's {grid} × {grid} patches do not pool evenly into \
                 {tokens_per_side} × {tokens_per_side} image tokens"
            )));
        }
        if !(1..=i64::from(MAX_HIDDEN)).contains(&text_hidden) {
            return Err(cx.error(format!(
                "text_config.hidden_size must be between 1 and {MAX_HIDDEN}, got {text_hidden}"
            )));
        }
        // mlx-vlm's ModelConfig default.
        let image_token_id = token_id(cx, "image_token_index", 262_144)?;
        let (vision_hidden, eps) = (args.hidden_size, args.layer_norm_eps);
        let siglip = Siglip::load(cx, args, "vision_tower.vision_model.")?;
        let norm = RmsNorm::load_with_offset(
            cx.weights,
            "multi_modal_projector.mm_soft_emb_norm",
            vision_hidden,
            eps,
            true,
        )?;
        let weight = cx.weights.take_shaped(
            "multi_modal_projector.mm_input_projection_weight",
            &[vision_hidden, text_hidden as i32],
        )?;
        Ok(Self {
            tower: Tower::Gemma3 {
                siglip,
                projector: Gemma3Projector {
                    norm,
                    weight,
                    kernel: (grid / tokens_per_side) as i32,
                    tokens_per_side: tokens_per_side as i32,
                },
            },
            image_token_id,
            splice_divisor: Some((text_hidden as f32).sqrt()),
            passes: Default::default(),
            both_ways: false,
        })
    }

    /// Whether an image's tokens attend to each other in both directions, not causally (Gemma 4
    /// checkpoints with `use_bidirectional_attention: "vision"`): the batch computes each image's
    /// tokens in one prefill pass, with [`super::Spliced::both_ways`].
    pub fn attends_both_ways(&self) -> bool {
        self.both_ways
    }

    /// This tower with its images' tokens attending both ways ([`Self::attends_both_ways`]).
    pub(super) fn with_both_ways(mut self) -> Self {
        self.both_ways = true;
        self
    }

    /// The token id a prompt holds at each of an image's places.
    pub fn image_token_id(&self) -> u32 {
        self.image_token_id
    }

    /// Images this tower has encoded ([`VisionTower::embed`] calls) since it loaded.
    pub fn passes(&self) -> usize {
        self.passes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How images are sized for this tower (the image processor's policy; for Qwen's the pixel
    /// bounds are mlx-vlm's defaults, which the model's processor config replaces,
    /// [`crate::image_processor::ImageProcessor::load_qwen`]).
    pub fn resize(&self) -> Resize {
        match &self.tower {
            Tower::Gemma3 { siglip, projector } => Resize::Square {
                side: siglip.args.image_size as u32,
                tokens: (projector.tokens_per_side * projector.tokens_per_side) as usize,
            },
            Tower::Qwen(qwen) => Resize::Smart {
                factor: qwen.args().factor() as u32,
                min_pixels: 56 * 56,
                max_pixels: 14 * 14 * 4 * 1280,
            },
            Tower::Gemma4(gemma4) => Resize::Aspect {
                patch: gemma4.args().patch_size as u32,
                pool: gemma4.args().pooling_kernel_size as u32,
                max_tokens: gemma4.args().default_output_length as u32,
            },
        }
    }

    /// The image tokens an image of `[height, width, channels]` pixel values fills, and its
    /// token grid (rows, columns) where the model's positions follow it (Qwen's multimodal
    /// RoPE); `Err` (a sentence) for a shape this tower does not take.
    pub fn tokens(&self, shape: [usize; 3]) -> Result<(usize, Option<(usize, usize)>)> {
        let refuse = |takes: String| {
            crate::EngineError::Request(format!(
                "an image of shape {shape:?}; this model's vision tower takes {takes}"
            ))
        };
        match &self.tower {
            Tower::Gemma3 { siglip, projector } => {
                let (side, c) = (siglip.args.image_size as usize, siglip.args.num_channels);
                if shape != [side, side, c as usize] {
                    return Err(refuse(format!("[{side}, {side}, {c}]")));
                }
                let n = projector.tokens_per_side * projector.tokens_per_side;
                Ok((n as usize, None))
            }
            Tower::Qwen(qwen) => match qwen.grid(&shape) {
                Some((rows, cols)) => Ok((rows * cols, Some((rows, cols)))),
                None => Err(refuse(format!(
                    "[height, width, {}] with sides multiples of {}",
                    qwen.args().in_channels,
                    qwen.args().factor()
                ))),
            },
            Tower::Gemma4(gemma4) => match gemma4.soft_tokens(&shape) {
                Some(n) => Ok((n, None)),
                None => Err(refuse(format!(
                    "[height, width, 3] with sides multiples of {} and at most {} patches a side",
                    gemma4.args().factor(),
                    gemma4.args().position_embedding_size
                ))),
            },
        }
    }

    /// One image's features as the text model's embedding layer holds them at its image tokens
    /// (before its embedding scale): pixel values `[height, width, channels]` (a shape
    /// [`tokens`](Self::tokens) takes) → `[tokens, text hidden]`, what [`super::Spliced`]
    /// carries.
    pub fn embed(&self, pixels: &Array) -> Result<Array> {
        self.passes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shape = pixels.shape();
        let features = match &self.tower {
            Tower::Gemma3 { .. } => {
                let one = pixels.reshape(&[1, shape[0], shape[1], shape[2]])?;
                let features = self.encode(&one)?;
                let d = features.shape()[2];
                features.reshape(&[-1, d])?
            }
            Tower::Qwen(qwen) => qwen.encode(pixels)?,
            Tower::Gemma4(gemma4) => gemma4.encode(pixels)?,
        };
        match self.splice_divisor {
            // mlx-vlm divides by the Python float `hidden ** 0.5`: in the features' dtype.
            Some(divisor) => {
                let divisor = Array::from_f32(divisor).as_dtype(features.dtype())?;
                Ok(ops::divide(&features, &divisor)?)
            }
            None => Ok(features),
        }
    }

    /// Gemma 3's features of each image: pixel values `[images, side, side, channels]` (float,
    /// any dtype; computed in the weights' dtype) → `[images, tokens, text hidden]`. `Err` for
    /// other shapes, and for Qwen's tower (one image at a time: [`VisionTower::embed`]).
    pub fn encode(&self, pixels: &Array) -> Result<Array> {
        let Tower::Gemma3 { siglip, projector } = &self.tower else {
            return Err(crate::EngineError::Request(
                "this vision tower takes one image at a time (embed)".into(),
            ));
        };
        let a = &siglip.args;
        let shape = pixels.shape();
        if shape.len() != 4 || shape[1..] != [a.image_size, a.image_size, a.num_channels] {
            return Err(crate::EngineError::Request(format!(
                "pixel values of shape {shape:?}, the vision tower takes [images, {0}, {0}, {1}]",
                a.image_size, a.num_channels
            )));
        }
        let pixels = pixels.as_dtype(siglip.patch_weight.dtype())?;
        let h = siglip.forward(&pixels)?;
        // Average-pool the [grid, grid] patches into [side, side] tokens.
        let (n, d) = (h.shape()[0], h.shape()[2]);
        let (k, side) = (projector.kernel, projector.tokens_per_side);
        let pooled = h
            .reshape(&[n, side, k, side, k, d])?
            .mean_axes(&[2, 4], false)?
            .reshape(&[n, side * side, d])?;
        let normed = projector.norm.forward(&pooled)?;
        Ok(ops::matmul(&normed, &projector.weight)?.as_dtype(h.dtype())?)
    }
}

/// A vision-language checkpoint's tower through `load` (the loader's result as a sentence on
/// failure), refused when the checkpoint holds tower weights (`is_vision` names them) that the
/// tower did not read: what a loader keeps beside its text model ([`super::Resolved::vision`]).
pub(super) fn load_checked(
    cx: &mut LoadContext<'_>,
    load: fn(&mut LoadContext<'_>) -> Result<VisionTower>,
    is_vision: impl Fn(&str) -> bool,
) -> std::result::Result<VisionTower, String> {
    let tower = load(cx).map_err(|e| e.to_string())?;
    let left: Vec<String> = cx
        .weights
        .remaining()
        .into_iter()
        .filter(|name| is_vision(name))
        .collect();
    match left.first() {
        Some(name) => Err(format!(
            "the checkpoint's vision tower has weights Perch does not read, e.g. {name}"
        )),
        None => Ok(tower),
    }
}

/// The token id in `name` of a vision-language config (`default` when absent).
fn token_id(cx: &LoadContext<'_>, name: &str, default: u32) -> Result<u32> {
    match cx.config.get(name) {
        None => Ok(default),
        Some(id) => id
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| cx.error(format!("{name} must be a token id, got {id}"))),
    }
}
