//! Qwen3 (dense): RMSNorm on every query and key head before RoPE, explicit `head_dim`, no biases.
//! Reference: mlx-lm `models/qwen3.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// `config.json` of `Qwen3ForCausalLM`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub struct Qwen3Args {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: i32,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Value>,
    pub tie_word_embeddings: bool,
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: Qwen3Args = cx.parse()?;
    let config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads,
        head_dim: args.head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: args.tie_word_embeddings,
        qk_norm: true,
        context_length: args.max_position_embeddings,
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        args.head_dim,
        args.rope_theta,
        false,
        args.rope_scaling.as_ref(),
    );
    cx.decoder(config, rope, "qwen3")
}
