//! Gemma 4 (`gemma4_text`, and `gemma4` / `gemma4_unified`, the multimodal checkpoints whose text
//! model is nested in `text_config` and whose weights sit under `language_model.`; a `gemma4`
//! checkpoint's vision tower loads beside it ([`super::gemma4_vision`]), audio towers and
//! `gemma4_unified`'s vision are left unread). Gemma 3's block (query and key norms, GeGLU, norms on each sub-layer's
//! input and output, scaled embeddings, sliding-window layers listed in `layer_types`) with:
//! plain RMSNorm weights (not offsets from one); an unweighted norm on values; scores unscaled
//! (the norms set the scale); global layers with heads of their own size (`global_head_dim`),
//! "proportional" RoPE over a quarter of their features, and optionally values taken from the
//! key projection (`attention_k_eq_v`, with `num_global_key_value_heads`); the last
//! `num_kv_shared_layers` layers reading the caches of earlier layers of their kind, with MLPs
//! twice as wide (`use_double_wide_mlp`); per-layer inputs (`hidden_size_per_layer_input`, the
//! E2B / E4B models); experts beside every layer's MLP (`enable_moe_block`, the 26B-A4B model);
//! a scalar weight per layer; logits soft-capped (`final_logit_softcapping`).
//! Reference: mlx-lm `models/gemma4_text.py`, `models/gemma4.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{BlockStyle, DecoderConfig, GlobalAttention, PerLayerInputs, SlidingWindow};
use super::moe::{MoeConfig, MoeStyle};
use super::vision::VisionTower;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::{Activation, Rope};

/// The text model's config; every field has mlx_lm's `ModelArgs` default, unknown fields are
/// ignored.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct Gemma4Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub head_dim: i32,
    /// 0 or absent: the global layers' heads are `head_dim` wide too.
    pub global_head_dim: Option<i32>,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub vocab_size_per_layer_input: i32,
    pub num_key_value_heads: i32,
    pub num_global_key_value_heads: Option<i32>,
    pub num_kv_shared_layers: i32,
    /// 0: no per-layer inputs.
    pub hidden_size_per_layer_input: i32,
    pub rope_traditional: bool,
    /// Per layer kind (`full_attention`, `sliding_attention`): `rope_theta`, `rope_type`,
    /// `partial_rotary_factor`; absent: mlx_lm's defaults (proportional over a quarter of the
    /// features with base 10^6 for global layers, default RoPE with base 10^4 for sliding ones).
    pub rope_parameters: Option<Value>,
    pub sliding_window: i32,
    pub sliding_window_pattern: i32,
    pub max_position_embeddings: usize,
    pub attention_k_eq_v: bool,
    pub final_logit_softcapping: Option<f32>,
    pub use_double_wide_mlp: bool,
    pub enable_moe_block: bool,
    pub num_experts: Option<i32>,
    pub top_k_experts: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    pub layer_types: Option<Vec<String>>,
    pub tie_word_embeddings: bool,
}

impl Default for Gemma4Args {
    fn default() -> Self {
        Self {
            hidden_size: 1536,
            num_hidden_layers: 35,
            intermediate_size: 6144,
            num_attention_heads: 8,
            head_dim: 256,
            global_head_dim: Some(512),
            rms_norm_eps: 1e-6,
            vocab_size: 262_144,
            vocab_size_per_layer_input: 262_144,
            num_key_value_heads: 1,
            num_global_key_value_heads: None,
            num_kv_shared_layers: 20,
            hidden_size_per_layer_input: 256,
            rope_traditional: false,
            rope_parameters: None,
            sliding_window: 512,
            sliding_window_pattern: 5,
            max_position_embeddings: 131_072,
            attention_k_eq_v: false,
            final_logit_softcapping: Some(30.0),
            use_double_wide_mlp: true,
            enable_moe_block: false,
            num_experts: None,
            top_k_experts: None,
            moe_intermediate_size: None,
            layer_types: None,
            tie_word_embeddings: true,
        }
    }
}

/// mlx_lm's `gemma4.ModelArgs`: the top-level `vocab_size` (default 262,144) replaces the text
/// config's, and the head counts default to 8 and 1 there.
const MULTIMODAL_VOCAB: i64 = 262_144;

/// The `rope_parameters` mlx_lm assumes when a config has none.
fn default_rope_parameters() -> Value {
    serde_json::json!({
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                              "rope_type": "default"},
    })
}

pub fn load(mut cx: LoadContext<'_>) -> Result<Resolved> {
    let model_type = cx
        .config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("gemma4_text")
        .to_string();
    // `gemma4_unified` (the 12B) is read as `gemma4`, as mlx_lm remaps it.
    let nested = model_type != "gemma4_text";
    let text = if nested {
        super::gemma_text_config(&cx, MULTIMODAL_VOCAB, [8, 1])?
    } else {
        cx.config.clone()
    };
    let args: Gemma4Args = cx.parse_value(&text, if nested { "text_config" } else { "config" })?;
    let layers = args.num_hidden_layers;
    super::within("num_hidden_layers", layers, DecoderConfig::MAX_LAYERS)
        .map_err(|m| cx.error(m))?;
    let sliding = match &args.layer_types {
        Some(types) => SlidingWindow::layers_from_types(types).map_err(|m| cx.error(m))?,
        None => {
            super::within(
                "sliding_window_pattern",
                args.sliding_window_pattern,
                DecoderConfig::MAX_LAYERS,
            )
            .map_err(|m| cx.error(m))?;
            SlidingWindow::every_but_nth(layers, args.sliding_window_pattern)
        }
    };

    let rope_parameters = args
        .rope_parameters
        .clone()
        .unwrap_or_else(default_rope_parameters);
    let kind = |name: &str| -> Result<Value> {
        match rope_parameters.get(name) {
            None | Some(Value::Null) => Ok(Value::Object(Default::default())),
            Some(params @ Value::Object(_)) => Ok(params.clone()),
            Some(_) => Err(cx.error(format!("`rope_parameters.{name}` must be an object"))),
        }
    };
    let theta = |params: &Value| -> Result<f32> {
        match params.get("rope_theta") {
            None => Ok(10_000.0),
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite() && *t > 0.0)
                .map(|t| t as f32)
                .ok_or_else(|| {
                    cx.error(format!("`rope_theta` must be a positive number, got {v}"))
                }),
        }
    };
    let (global_params, sliding_params) = (kind("full_attention")?, kind("sliding_attention")?);
    // mlx_lm builds the sliding layers' RoPE from their parameters too; every published model's
    // is the default one.
    match sliding_params.get("rope_type").and_then(Value::as_str) {
        None | Some("default") => {}
        Some(other) => {
            return Err(cx.error(format!(
                "sliding layers' RoPE type `{other}` is not supported (default)"
            )))
        }
    }
    let global_head_dim = args
        .global_head_dim
        .filter(|&d| d != 0)
        .unwrap_or(args.head_dim);
    let values_from_keys = args.attention_k_eq_v;
    let global_kv_heads = match args.num_global_key_value_heads {
        Some(heads) if values_from_keys => heads,
        _ => args.num_key_value_heads,
    };
    let moe = if args.enable_moe_block {
        let need = |name: &str, value: Option<i32>| {
            value.ok_or_else(|| cx.error(format!("`enable_moe_block` needs `{name}`")))
        };
        Some(MoeConfig {
            num_experts: need("num_experts", args.num_experts)?,
            top_k: need("top_k_experts", args.top_k_experts)?,
            intermediate_size: need("moe_intermediate_size", args.moe_intermediate_size)?,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            shared_expert_intermediate_size: None,
            style: MoeStyle::Gemma4,
        })
    } else {
        None
    };
    let prefix = if nested { "language_model." } else { "" };
    let (global_theta, local_theta) = (theta(&global_params)?, theta(&sliding_params)?);
    let config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads,
        head_dim: args.head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: args.tie_word_embeddings,
        qk_norm: true,
        weight_prefix: prefix.into(),
        context_length: args.max_position_embeddings,
        style: BlockStyle {
            activation: Activation::GeluApprox,
            sandwich_norms: true,
            // mlx_lm multiplies by the Python float `hidden_size**0.5` (cast to the
            // activations' dtype, unlike Gemma 3's bfloat16 constant).
            embedding_scale: Some((args.hidden_size.max(0) as f32).sqrt()),
            attention_scale: Some(1.0),
            sliding_window: Some(SlidingWindow {
                window: args.sliding_window,
                layers: sliding,
                local_rope_theta: Some(local_theta),
            }),
            value_norm: true,
            layer_scalar: true,
            final_logit_softcap: args.final_logit_softcapping,
            double_wide_shared_mlp: args.use_double_wide_mlp,
            features_after_scale: true,
            ..Default::default()
        },
        moe,
        global_attention: Some(GlobalAttention {
            head_dim: global_head_dim,
            num_kv_heads: global_kv_heads,
            values_from_keys,
        }),
        kv_shared_layers: args.num_kv_shared_layers,
        per_layer_inputs: (args.hidden_size_per_layer_input != 0).then_some(PerLayerInputs {
            hidden: args.hidden_size_per_layer_input,
            vocab_size: args.vocab_size_per_layer_input,
        }),
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let mut vision = None;
    if nested {
        // Hugging Face's names for the tower, as mlx-vlm's `sanitize` renames them.
        cx.weights
            .rename_prefix("model.vision_tower.", "vision_tower.");
        cx.weights
            .rename_prefix("model.embed_vision.", "embed_vision.");
        if model_type == "gemma4"
            && cx.config.get("vision_config").is_some()
            && cx
                .weights
                .contains("vision_tower.patch_embedder.input_proj.weight")
        {
            let is_vision =
                |name: &str| name.starts_with("vision_tower.") || name.starts_with("embed_vision.");
            let tower = super::vision::load_checked(&mut cx, VisionTower::load_gemma4, is_vision);
            // The larger Gemma 4 models let an image's tokens attend to each other both ways.
            let both_ways = text
                .get("use_bidirectional_attention")
                .and_then(Value::as_str)
                == Some("vision");
            vision = Some(match both_ways {
                true => tower.map(VisionTower::with_both_ways),
                false => tower,
            });
        }
        // Hugging Face's layout, as mlx_lm's `sanitize` renames it.
        if !cx
            .weights
            .contains("language_model.model.embed_tokens.weight")
        {
            cx.weights
                .rename_prefix("model.language_model.", "language_model.model.");
        }
        // Not the text model's (mlx_lm's sanitize drops them too).
        cx.weights.discard_where(|name| {
            let name = name.strip_prefix("model.").unwrap_or(name);
            [
                "vision_tower",
                "multi_modal_projector",
                "audio_tower",
                "embed_audio",
                "embed_vision",
                "vision_embedder",
            ]
            .iter()
            .any(|p| name.starts_with(p))
        });
    }
    // Tensors mlx_lm's sanitize drops: rotary tables and activation clipping bounds.
    cx.weights.discard_where(|name| {
        name.contains("self_attn.rotary_emb")
            || ["input_max", "input_min", "output_max", "output_min"]
                .iter()
                .any(|s| name.contains(s))
    });
    let rope = Rope::new(
        global_head_dim,
        global_theta,
        args.rope_traditional,
        Some(&global_params),
    );
    let mut resolved = cx.decoder(config, rope, &model_type)?;
    resolved.vision = vision;
    Ok(resolved)
}
