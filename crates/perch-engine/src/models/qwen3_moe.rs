//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention (query and key
//! norms) with sparse mixture-of-experts feed-forward blocks ([`super::moe`]) on every
//! `decoder_sparse_step`-th layer not listed in `mlp_only_layers`.
//! Reference: mlx-lm `models/qwen3_moe.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::moe::{MoeConfig, MoeStyle};
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// `config.json` of `Qwen3MoeForCausalLM`; unknown fields are ignored. mlx_lm requires every
/// field but `rope_scaling`.
#[derive(Debug, Deserialize)]
pub struct Qwen3MoeArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    pub decoder_sparse_step: i32,
    pub mlp_only_layers: Vec<i32>,
    pub moe_intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub num_key_value_heads: i32,
    pub head_dim: i32,
    pub rope_theta: f32,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub norm_topk_prob: bool,
    pub rope_scaling: Option<Value>,
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: Qwen3MoeArgs = cx.parse()?;
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
        moe: Some(MoeConfig {
            num_experts: args.num_experts,
            top_k: args.num_experts_per_tok,
            intermediate_size: args.moe_intermediate_size,
            norm_topk_prob: args.norm_topk_prob,
            decoder_sparse_step: args.decoder_sparse_step,
            mlp_only_layers: args.mlp_only_layers,
            shared_expert_intermediate_size: None,
            style: MoeStyle::Qwen,
        }),
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    // mlx_lm's rope for this model is plain `nn.RoPE(head_dim, base=rope_theta)`: it ignores
    // `rope_scaling` (published configs have none); so does Perch, to stay equal to it.
    let rope = Rope::new(args.head_dim, args.rope_theta, false, None);
    cx.decoder(config, rope, "qwen3_moe")
}
