//! Qwen3.5 and Qwen3.6 (dense): hybrid layers, every `full_attention_interval`-th one gated
//! attention (Qwen3-Next's: query and key norms, a sigmoid output gate from a doubled query
//! projection, RoPE on a `partial_rotary_factor` of each head) and the others Gated DeltaNet
//! linear attention ([`super::gated_delta`]). Multimodal checkpoints nest the text model's config
//! in `text_config` and its weights under `language_model.`; their vision tower
//! ([`super::qwen_vision`]) loads beside it, and a pass given each token's multimodal positions
//! (prompts with images) rotates by them ([`super::decoder::BlockStyle::mrope_sections`]).
//! The mixture-of-experts variant (`qwen3_5_moe`, or any config with `num_experts` > 0) has a
//! sparse block with a shared expert ([`super::moe`]) in every layer; its checkpoints keep the
//! router and shared-expert gates at 8 bits (mlx_lm's `quant_predicate`, written to the config's
//! `quantization` as per-layer overrides).
//! Reference: mlx-lm `models/qwen3_5.py`, `models/qwen3_next.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{DecoderConfig, LinearAttention};
use super::gated_delta::GatedDeltaConfig;
use super::moe::{MoeConfig, MoeStyle};
use super::vision::VisionTower;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// The text model's config (`text_config`, or the top level when there is none); unknown fields
/// are ignored. Defaults are mlx_lm's `TextModelArgs`'.
#[derive(Debug, Deserialize)]
pub struct Qwen35Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    /// The dense MLP's size; mixture-of-experts checkpoints, whose layers are all sparse, leave
    /// it out (mlx_lm's default then).
    #[serde(default = "default_intermediate_size")]
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub max_position_embeddings: usize,
    #[serde(default = "default_linear_value_heads")]
    pub linear_num_value_heads: i32,
    #[serde(default = "default_linear_key_heads")]
    pub linear_num_key_heads: i32,
    #[serde(default = "default_linear_key_head_dim")]
    pub linear_key_head_dim: i32,
    #[serde(default = "default_linear_value_head_dim")]
    pub linear_value_head_dim: i32,
    #[serde(default = "default_conv_kernel")]
    pub linear_conv_kernel_dim: i32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_full_attention_interval")]
    pub full_attention_interval: i32,
    #[serde(default)]
    pub num_experts: i32,
    #[serde(default)]
    pub num_experts_per_tok: i32,
    #[serde(default)]
    pub moe_intermediate_size: i32,
    #[serde(default)]
    pub shared_expert_intermediate_size: i32,
    #[serde(default = "super::default_true")]
    pub norm_topk_prob: bool,
    /// RoPE: `rope_theta` (default 100,000), `partial_rotary_factor` (0.25) and the scaling
    /// type (`type` or `rope_type`); mlx_lm reads these from here, not from top-level fields.
    pub rope_parameters: Option<Value>,
}

fn default_intermediate_size() -> i32 {
    14336
}
fn default_linear_value_heads() -> i32 {
    64
}
fn default_linear_key_heads() -> i32 {
    16
}
fn default_linear_key_head_dim() -> i32 {
    192
}
fn default_linear_value_head_dim() -> i32 {
    128
}
fn default_conv_kernel() -> i32 {
    4
}
fn default_full_attention_interval() -> i32 {
    4
}

/// Whether a `qwen3_5` config scales its RoPE (`rope_parameters`' `type` / `rope_type` other
/// than `default`), which images refuse (their multimodal RoPE is unscaled).
pub fn scales_rope(config: &Value) -> bool {
    let text = config.get("text_config").unwrap_or(config);
    text.get("rope_parameters")
        .and_then(|p| p.get("type").or_else(|| p.get("rope_type")))
        .and_then(Value::as_str)
        .is_some_and(|kind| kind != "default")
}

pub fn load(mut cx: LoadContext<'_>) -> Result<Resolved> {
    let text = cx.config.get("text_config").unwrap_or(cx.config);
    let args: Qwen35Args =
        serde_path_to_error::deserialize(text).map_err(|e| cx.error(e.to_string()))?;
    // mlx_lm reads `qwen3_5_moe`'s text model from the top level when there is no
    // `text_config`, but its weights are still the wrapper's `language_model.`.
    let model_type = cx
        .config
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("qwen3_5");
    let moe_wrapper = model_type == "qwen3_5_moe";
    // mlx_lm makes every layer sparse when `num_experts` > 0 (`decoder_sparse_step` is not read).
    let moe = (args.num_experts > 0).then(|| MoeConfig {
        num_experts: args.num_experts,
        top_k: args.num_experts_per_tok,
        intermediate_size: args.moe_intermediate_size,
        norm_topk_prob: args.norm_topk_prob,
        decoder_sparse_step: 1,
        mlp_only_layers: Vec::new(),
        shared_expert_intermediate_size: Some(args.shared_expert_intermediate_size),
        style: MoeStyle::Qwen,
    });
    let head_dim = match args.head_dim {
        Some(d) => d,
        None if args.num_attention_heads > 0 => args.hidden_size / args.num_attention_heads,
        None => 0,
    };
    let mut config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads,
        head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: args.tie_word_embeddings,
        qkv_bias: args.attention_bias,
        o_bias: args.attention_bias,
        qk_norm: true,
        attn_output_gate: true,
        linear_attention: Some(LinearAttention {
            full_attention_interval: args.full_attention_interval,
            layer: GatedDeltaConfig {
                num_value_heads: args.linear_num_value_heads,
                num_key_heads: args.linear_num_key_heads,
                key_head_dim: args.linear_key_head_dim,
                value_head_dim: args.linear_value_head_dim,
                conv_kernel: args.linear_conv_kernel_dim,
            },
        }),
        weight_prefix: if moe_wrapper || cx.config.get("text_config").is_some() {
            "language_model.".into()
        } else {
            String::new()
        },
        context_length: args.max_position_embeddings,
        moe,
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    // A vision-language checkpoint's tower (mlx-vlm's names), or why it was not loaded.
    let is_vision =
        |name: &str| name.starts_with("vision_tower") || name.starts_with("model.visual");
    let mut vision = None;
    if cx.config.get("vision_config").is_some()
        && cx.weights.contains("vision_tower.patch_embed.proj.weight")
    {
        vision = Some(super::vision::load_checked(
            &mut cx,
            VisionTower::load_qwen,
            is_vision,
        ));
    }
    // Whatever the text model does not read, and the multi-token-prediction head (mlx_lm's
    // sanitize drops them too).
    cx.weights
        .discard_where(|name| is_vision(name) || name.contains("mtp."));
    let rope_parameters = args.rope_parameters.unwrap_or(Value::Null);
    let number = |key: &str, default: f64| {
        rope_parameters
            .get(key)
            .and_then(Value::as_f64)
            .unwrap_or(default)
    };
    let factor = number("partial_rotary_factor", 0.25);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(cx.error(format!(
            "`partial_rotary_factor` must be in (0, 1], got {factor}"
        )));
    }
    // mlx_lm's int(head_dim * partial_rotary_factor).
    let rope_dims = (head_dim as f64 * factor) as i32;
    if rope_dims < 2 || rope_dims % 2 != 0 {
        return Err(cx.error(format!(
            "RoPE covers {rope_dims} features of each head (`head_dim` {head_dim} × \
             `partial_rotary_factor` {factor}): it must be even and at least 2"
        )));
    }
    // Multimodal RoPE's sections, for prompts with images (mlx-vlm's default [11, 11, 10]; a
    // section may name more frequencies than RoPE has, as mlx-vlm's selector allows). A config
    // whose sections cannot be read keeps its text model and refuses images.
    let sections = match rope_parameters.get("mrope_section") {
        None | Some(Value::Null) => Ok([11, 11, 10]),
        Some(value) => {
            let parsed: Option<Vec<i32>> = value.as_array().and_then(|v| {
                v.iter()
                    .map(|n| n.as_i64().and_then(|n| i32::try_from(n).ok()))
                    .collect()
            });
            match parsed.as_deref() {
                Some(&[t, h, w]) if [t, h, w].iter().all(|n| (0..=1 << 16).contains(n)) => {
                    Ok([t, h, w])
                }
                _ => Err(format!(
                    "`mrope_section` must be three whole numbers from 0, got {value}"
                )),
            }
        }
    };
    let sections = match sections {
        Ok(sections) => sections,
        Err(why) => {
            if vision.is_some() {
                vision = Some(Err(format!("images cannot be placed: {why}")));
            }
            [11, 11, 10]
        }
    };
    config.style.mrope_sections = Some(sections);
    let rope = Rope::new(
        rope_dims,
        number("rope_theta", 100_000.0) as f32,
        false,
        (!rope_parameters.is_null()).then_some(&rope_parameters),
    );
    // Images' positions rotate by the unscaled frequencies (mlx-vlm's MRoPE): a scaled RoPE
    // would turn a prompt's image tokens and its later tokens by different rules.
    if let (Ok(rope), Some(Ok(_))) = (&rope, &vision) {
        if rope.freqs.is_some() || rope.scale != 1.0 || rope.mscale != 1.0 {
            vision = Some(Err(
                "images need Qwen's unscaled multimodal RoPE; this checkpoint scales its RoPE"
                    .into(),
            ));
        }
    }
    let mut resolved = cx.decoder(
        config,
        rope,
        if moe_wrapper {
            "qwen3_5_moe"
        } else {
            "qwen3_5"
        },
    )?;
    resolved.vision = vision;
    Ok(resolved)
}
