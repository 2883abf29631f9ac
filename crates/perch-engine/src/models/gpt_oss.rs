//! gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): Llama's pre-norm block with biases on every
//! attention projection, attention sinks (a learned logit per query head that joins each
//! query's softmax as a key without a value), sliding-window layers alternating with global ones
//! (`layer_types`), YaRN RoPE, and a sparse block of experts on every layer: the router (with a
//! bias) keeps each token's top k logits and softmaxes them among themselves; each expert is a
//! clamped SwiGLU (`swiglu_oai`) with biases. The LM head is never tied.
//! Reference: mlx-lm `models/gpt_oss.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::{BlockStyle, DecoderConfig, SlidingWindow};
use super::moe::{MoeConfig, MoeStyle};
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

/// The config's fields, with mlx_lm's `ModelArgs` defaults; unknown fields are ignored.
#[derive(Debug, Deserialize)]
#[serde(default)]
pub struct GptOssArgs {
    pub num_hidden_layers: i32,
    pub num_local_experts: i32,
    pub num_experts_per_tok: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub head_dim: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: i32,
    pub sliding_window: i32,
    pub rope_theta: f32,
    pub rope_scaling: Option<Value>,
    /// Per layer, `sliding_attention` or `full_attention`; `None`: alternating, sliding first.
    pub layer_types: Option<Vec<String>>,
    pub max_position_embeddings: usize,
}

impl Default for GptOssArgs {
    fn default() -> Self {
        Self {
            num_hidden_layers: 36,
            num_local_experts: 128,
            num_experts_per_tok: 4,
            vocab_size: 201_088,
            rms_norm_eps: 1e-5,
            hidden_size: 2880,
            intermediate_size: 2880,
            head_dim: 64,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            sliding_window: 128,
            rope_theta: 150_000.0,
            rope_scaling: None,
            layer_types: None,
            max_position_embeddings: 131_072,
        }
    }
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: GptOssArgs = cx.parse()?;
    let layers = match &args.layer_types {
        Some(types) => SlidingWindow::layers_from_types(types).map_err(|m| cx.error(m))?,
        // mlx_lm's default: `[sliding, full] * (layers // 2)` (an odd count leaves the last
        // layer without a type, which it then cannot run; refused below by the length check).
        None => (0..args.num_hidden_layers / 2 * 2)
            .map(|i| i % 2 == 0)
            .collect(),
    };
    if !(args.rope_theta.is_finite() && args.rope_theta > 0.0) {
        return Err(cx.error(format!(
            "`rope_theta` must be a positive number, got {}",
            args.rope_theta
        )));
    }
    let config = DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads,
        head_dim: args.head_dim,
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: true,
        context_length: args.max_position_embeddings,
        style: BlockStyle {
            sliding_window: Some(SlidingWindow {
                window: args.sliding_window,
                layers,
                local_rope_theta: None,
            }),
            attention_sinks: true,
            ..Default::default()
        },
        moe: Some(MoeConfig {
            num_experts: args.num_local_experts,
            top_k: args.num_experts_per_tok,
            intermediate_size: args.intermediate_size,
            norm_topk_prob: false,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            shared_expert_intermediate_size: None,
            style: MoeStyle::GptOss,
        }),
        ..Default::default()
    };
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        args.head_dim,
        args.rope_theta,
        false,
        args.rope_scaling.as_ref(),
    );
    cx.decoder(config, rope, "gpt_oss")
}
