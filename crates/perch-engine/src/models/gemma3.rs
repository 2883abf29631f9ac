//! Gemma 3 (`gemma3_text`, and `gemma3`, the multimodal checkpoints whose text model is nested in
//! `text_config` and whose weights sit under `language_model.`, with their vision tower and
//! projector: [`super::vision`]). Query and key norms, GeGLU feed-forward blocks, norms on each sub-layer's input
//! and output, RMSNorm weights stored as offsets from one, embeddings scaled by `sqrt(hidden)`
//! (rounded to bfloat16), scores scaled by `query_pre_attn_scalar^-0.5`, and sliding-window
//! attention on every layer but each `sliding_window_pattern`-th, with its own RoPE base
//! (`rope_local_base_freq`); the global layers read `rope_theta` and `rope_scaling`. The LM head
//! is tied to the embeddings when the checkpoint has no `lm_head.weight` (mlx_lm's `sanitize`).
//! Reference: mlx-lm `models/gemma3_text.py`, `models/gemma3.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{BlockStyle, DecoderConfig, SlidingWindow};
use super::vision::VisionTower;
use super::within;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::{Activation, Rope};

/// The text model's config; every field has mlx_lm's `ModelArgs` default, unknown fields are
/// ignored.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct Gemma3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub rope_theta: f32,
    pub rope_local_base_freq: f32,
    pub query_pre_attn_scalar: f32,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub max_position_embeddings: usize,
    pub rope_scaling: Option<Value>,
}

impl Default for Gemma3Args {
    fn default() -> Self {
        Self {
            hidden_size: 1152,
            num_hidden_layers: 26,
            intermediate_size: 6912,
            num_attention_heads: 4,
            head_dim: 256,
            rms_norm_eps: 1e-6,
            vocab_size: 262_144,
            num_key_value_heads: 1,
            rope_theta: 1_000_000.0,
            rope_local_base_freq: 10_000.0,
            query_pre_attn_scalar: 256.0,
            sliding_window: 512,
            sliding_window_pattern: 6,
            max_position_embeddings: 32_768,
            rope_scaling: None,
        }
    }
}

/// mlx_lm's `gemma3.ModelArgs`: the top-level `vocab_size` (default 262,208) replaces the text
/// config's, and the head counts default to 8 and 4 there.
const MULTIMODAL_VOCAB: i64 = 262_208;

pub fn load(mut cx: LoadContext<'_>) -> Result<Resolved> {
    let nested = cx.config.get("model_type").and_then(Value::as_str) == Some("gemma3");
    let text = if nested {
        super::gemma_text_config(&cx, MULTIMODAL_VOCAB, [8, 4])?
    } else {
        cx.config.clone()
    };
    let args = Gemma3Args::deserialize(&text).map_err(|e| cx.error(e.to_string()))?;
    let scalar = args.query_pre_attn_scalar;
    if !(scalar.is_finite() && scalar > 0.0) {
        return Err(cx.error(format!(
            "`query_pre_attn_scalar` must be a positive number, got {scalar}"
        )));
    }
    // Before the per-layer flags are built from them.
    within(
        "num_hidden_layers",
        args.num_hidden_layers,
        DecoderConfig::MAX_LAYERS,
    )
    .and_then(|()| {
        within(
            "sliding_window_pattern",
            args.sliding_window_pattern,
            DecoderConfig::MAX_LAYERS,
        )
    })
    .map_err(|m| cx.error(m))?;
    let prefix = if nested { "language_model." } else { "" };
    // mlx_lm's `mx.array(hidden_size**0.5, mx.bfloat16)`: the scale as bfloat16 holds it.
    let embedding_scale = mlx_rs::Array::from_f32((args.hidden_size.max(0) as f32).sqrt())
        .as_dtype(mlx_rs::Dtype::Bfloat16)?
        .as_dtype(mlx_rs::Dtype::Float32)?
        .item_exact::<f32>();
    let config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads,
        head_dim: args.head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: !cx.weights.contains(&format!("{prefix}lm_head.weight")),
        qk_norm: true,
        weight_prefix: prefix.into(),
        context_length: args.max_position_embeddings,
        style: BlockStyle {
            norm_unit_offset: true,
            activation: Activation::GeluApprox,
            sandwich_norms: true,
            clip_float16_residuals: true,
            embedding_scale: Some(embedding_scale),
            attention_scale: Some(scalar.powf(-0.5)),
            sliding_window: Some(SlidingWindow {
                window: args.sliding_window,
                layers: SlidingWindow::every_but_nth(
                    args.num_hidden_layers,
                    args.sliding_window_pattern,
                ),
                local_rope_theta: Some(args.rope_local_base_freq),
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let is_vision = |name: &str| {
        name.starts_with("vision_tower.") || name.starts_with("multi_modal_projector.")
    };
    let mut vision = None;
    if nested
        && cx
            .weights
            .contains("vision_tower.vision_model.embeddings.patch_embedding.weight")
    {
        vision = Some(super::vision::load_checked(
            &mut cx,
            VisionTower::load_gemma3,
            is_vision,
        ));
    }
    if nested {
        // Whatever the text model does not read (mlx_lm's sanitize drops them too).
        cx.weights.discard_where(is_vision);
    }
    let rope = Rope::new(
        args.head_dim,
        args.rope_theta,
        false,
        args.rope_scaling.as_ref(),
    );
    let model_type = if nested { "gemma3" } else { "gemma3_text" };
    let mut resolved = cx.decoder(config, rope, model_type)?;
    resolved.vision = vision;
    Ok(resolved)
}
