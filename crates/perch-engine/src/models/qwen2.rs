//! Qwen2 / Qwen2.5: Llama's layout with biases on the q/k/v projections.
//! Reference: mlx-lm `models/qwen2.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// `config.json` of `Qwen2ForCausalLM`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub struct Qwen2Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: Option<i32>,
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<Value>,
    #[serde(default = "super::default_true")]
    pub tie_word_embeddings: bool,
}

fn default_context() -> usize {
    32768
}

fn default_rope_theta() -> f32 {
    1_000_000.0
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: Qwen2Args = cx.parse()?;
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
        qkv_bias: true,
        context_length: args.max_position_embeddings,
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        head_dim,
        args.rope_theta,
        args.rope_traditional,
        args.rope_scaling.as_ref(),
    );
    cx.decoder(config, rope, "qwen2")
}
