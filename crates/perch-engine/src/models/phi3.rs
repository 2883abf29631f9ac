//! Phi-3, Phi-3.5 and Phi-4-mini: Llama's layers with the query, key and value projections stored
//! fused (`qkv_proj`), the gate and up projections too (`gate_up_proj`), RoPE over a
//! `partial_rotary_factor` of each head, and LongRoPE (`rope_scaling` type `longrope` or `su`).
//! Reference: mlx-lm `models/phi3.py`, `models/rope_utils.py` (`SuScaledRoPE`).

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// `config.json` of `Phi3ForCausalLM`; unknown fields are ignored. Defaults are mlx_lm's.
#[derive(Debug, Deserialize)]
pub struct Phi3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<Value>,
    #[serde(default = "default_partial_rotary_factor")]
    pub partial_rotary_factor: f64,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_original_max_position_embeddings")]
    pub original_max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f32 {
    10000.0
}
fn default_partial_rotary_factor() -> f64 {
    1.0
}
fn default_max_position_embeddings() -> usize {
    131072
}
fn default_original_max_position_embeddings() -> usize {
    4096
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: Phi3Args = cx.parse()?;
    // mlx_lm's head size is always hidden_size / heads (a config's `head_dim` is not read).
    if args.num_attention_heads <= 0 || args.hidden_size % args.num_attention_heads != 0 {
        return Err(cx.error("`hidden_size` must be a multiple of `num_attention_heads`".into()));
    }
    let head_dim = args.hidden_size / args.num_attention_heads;
    let config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads.unwrap_or(args.num_attention_heads),
        head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: args.tie_word_embeddings,
        context_length: args.max_position_embeddings,
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let factor = args.partial_rotary_factor;
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(cx.error(format!(
            "`partial_rotary_factor` must be in (0, 1], got {factor}"
        )));
    }
    // mlx_lm's int(head_dim * partial_rotary_factor).
    let rope_dims = (head_dim as f64 * factor) as i32;
    if rope_dims < 2 || rope_dims % 2 != 0 {
        return Err(cx.error(format!(
            "RoPE covers {rope_dims} features of each head (head size {head_dim} × \
             `partial_rotary_factor` {factor}): it must be even and at least 2"
        )));
    }
    let rope = rope(&args, rope_dims).map_err(|m| cx.error(m))?;
    cx.decoder(config, Ok(rope), "phi3")
}

/// Phi-3's RoPE as mlx_lm builds it: LongRoPE for `longrope` / `su` scaling, a linear scale for
/// `linear`, and for any other type a plain RoPE (mlx_lm warns and drops the scaling).
fn rope(args: &Phi3Args, dims: i32) -> std::result::Result<Rope, String> {
    let scaling = args.rope_scaling.as_ref().filter(|v| !v.is_null());
    let Some(scaling) = scaling else {
        return Rope::new(dims, args.rope_theta, args.rope_traditional, None);
    };
    let kind = scaling.get("type").and_then(Value::as_str);
    let (Some(kind), Some(_)) = (kind, scaling.get("long_factor")) else {
        return Err("rope_scaling must contain `long_factor` and `type`".into());
    };
    match kind {
        "longrope" | "su" => {
            let long_factor: Vec<f32> = match &scaling["long_factor"] {
                Value::Number(n) => vec![n.as_f64().unwrap_or(f64::NAN) as f32],
                Value::Array(values) => values
                    .iter()
                    .map(|v| v.as_f64().map(|f| f as f32))
                    .collect::<Option<_>>()
                    .ok_or("rope_scaling `long_factor` must hold numbers")?,
                _ => return Err("rope_scaling `long_factor` must be a number or a list".into()),
            };
            if long_factor.iter().any(|f| !f.is_finite() || *f <= 0.0) {
                return Err("rope_scaling `long_factor` values must be positive".into());
            }
            Rope::su_scaled(
                dims,
                args.rope_theta,
                &long_factor,
                args.max_position_embeddings as f64,
                args.original_max_position_embeddings as f64,
                None,
            )
        }
        "linear" => {
            let factor = scaling.get("factor").and_then(Value::as_f64);
            match factor {
                Some(f) if f > 0.0 => {}
                _ => return Err("rope_scaling `linear` needs a positive `factor`".into()),
            }
            Rope::new(dims, args.rope_theta, args.rope_traditional, Some(scaling))
        }
        // mlx_lm warns that it supports only these and drops the scaling.
        _ => Rope::new(dims, args.rope_theta, args.rope_traditional, None),
    }
}
