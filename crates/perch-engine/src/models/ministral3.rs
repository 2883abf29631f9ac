//! Ministral 3 (`ministral3`) and the multimodal Mistral 3 checkpoints (`mistral3`: Ministral 3,
//! Mistral Small 3.1 / 3.2), whose text model is nested in `text_config` and whose weights sit
//! under `language_model.`; their vision tower and projector are left unread. Ministral 3 is
//! Llama's block with RoPE from `rope_parameters` (YaRN in the published models), queries scaled
//! by position after RoPE (Llama 4's attention scaling, [`QueryPositionScale`]) and optional
//! sliding-window layers (`layer_types`); a `mistral3` checkpoint whose text model is not
//! `ministral3` is Llama's (as mlx_lm runs it; `mistral4` text models are not supported yet).
//! Reference: mlx-lm `models/ministral3.py`, `models/mistral3.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{QueryPositionScale, SlidingWindow};
use super::llama::{self, LlamaArgs};
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// Ministral 3's own fields of its text config (Llama's are read by [`LlamaArgs`] from the same
/// object, their RoPE ones unused); unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub struct Ministral3Args {
    /// `rope_theta`, the scaling type and its parameters, `llama_4_scaling_beta` and
    /// `original_max_position_embeddings` (all required, as mlx_lm reads them).
    pub rope_parameters: Value,
    /// Per layer, `full_attention` or `sliding_attention`; `None`: all full.
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<i32>,
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let config = cx.config.clone();
    load_text(cx, &config, "", "ministral3")
}

/// `mistral3`: the text model of `text_config` (its `tie_word_embeddings` false unless it says
/// otherwise, as mlx_lm's `mistral3.ModelArgs` sets it), weights under `language_model.`
/// (mlx-community's layout; Hugging Face's `model.language_model.` and top-level `lm_head.` are
/// read as the same tensors).
pub fn load_mistral3(cx: LoadContext<'_>) -> Result<Resolved> {
    let mut text = match cx.config.get("text_config") {
        Some(text @ Value::Object(_)) => text.clone(),
        _ => return Err(cx.error("`text_config` must be an object".into())),
    };
    if let Some(fields) = text.as_object_mut() {
        fields
            .entry("tie_word_embeddings")
            .or_insert(Value::Bool(false));
    }
    let prefix = "language_model.";
    if !cx
        .weights
        .contains("language_model.model.embed_tokens.weight")
    {
        cx.weights
            .rename_prefix("model.language_model.", "language_model.model.");
        cx.weights
            .rename_prefix("lm_head.", "language_model.lm_head.");
    }
    cx.weights.discard_where(|name| {
        [
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ]
        .iter()
        .any(|p| name.starts_with(p))
    });
    match text.get("model_type").and_then(Value::as_str) {
        Some("ministral3") => load_text(cx, &text, prefix, "mistral3"),
        Some("mistral4") => Err(cx.error(
            "the `mistral4` text model of this Mistral 3 checkpoint is not supported yet".into(),
        )),
        _ => llama::load_nested(cx, &text, prefix, "mistral3"),
    }
}

fn load_text(
    cx: LoadContext<'_>,
    text: &Value,
    prefix: &str,
    model_type: &str,
) -> Result<Resolved> {
    let (llama, args): (LlamaArgs, Ministral3Args) = if prefix.is_empty() {
        (cx.parse()?, cx.parse()?)
    } else {
        (
            cx.parse_value(text, "text_config")?,
            cx.parse_value(text, "text_config")?,
        )
    };
    let rope_parameters = &args.rope_parameters;
    let number = |key: &str| -> Result<f64> {
        rope_parameters
            .get(key)
            .and_then(Value::as_f64)
            .ok_or_else(|| cx.error(format!("`rope_parameters` needs a numeric `{key}`")))
    };
    let rope_theta = number("rope_theta")?;
    let beta = number("llama_4_scaling_beta")?;
    let original = number("original_max_position_embeddings")?;
    if !(beta.is_finite() && original.is_finite() && original >= 1.0) {
        return Err(cx.error(
            "`rope_parameters` needs a finite `llama_4_scaling_beta` and \
             `original_max_position_embeddings` of at least 1"
                .into(),
        ));
    }
    let sliding_window = match &args.layer_types {
        Some(types) => {
            let layers = SlidingWindow::layers_from_types(types).map_err(|m| cx.error(m))?;
            if layers.iter().any(|&s| s) {
                let window = args.sliding_window.ok_or_else(|| {
                    cx.error("sliding_attention layers need a `sliding_window`".into())
                })?;
                Some(SlidingWindow {
                    window,
                    layers,
                    local_rope_theta: None,
                })
            } else {
                None
            }
        }
        None => None,
    };
    // Llama's sizes and block; Ministral 3 has no biases.
    let mut config = llama::decoder_config(&cx, &llama, prefix)?;
    (config.qkv_bias, config.o_bias, config.mlp_bias) = (false, false, false);
    config.style.sliding_window = sliding_window;
    config.style.query_position_scale = Some(QueryPositionScale {
        beta: beta as f32,
        original: original as f32,
    });
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        config.head_dim,
        rope_theta as f32,
        false,
        Some(rope_parameters),
    );
    cx.decoder(config, rope, model_type)
}
