//! Llama (1/2/3.x, incl. Llama 3.1's `rope_scaling: llama3`), SmolLM2 and Mistral-style models.
//! Reference: mlx-lm `models/llama.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::{LoadContext, Model};
use crate::error::Result;
use crate::layers::Rope;

/// `config.json` as Hugging Face writes it for `LlamaForCausalLM`; unknown fields are ignored.
#[derive(Debug, Deserialize)]
pub struct LlamaArgs {
    pub hidden_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    pub rms_norm_eps: f32,
    pub vocab_size: i32,
    pub head_dim: Option<i32>,
    pub max_position_embeddings: Option<usize>,
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_traditional: bool,
    pub rope_scaling: Option<Value>,
    #[serde(default = "super::default_true")]
    pub tie_word_embeddings: bool,
}

fn default_rope_theta() -> f32 {
    10000.0
}

pub fn load(cx: LoadContext<'_>) -> Result<Box<dyn Model>> {
    let args: LlamaArgs = cx.parse()?;
    if args.num_attention_heads <= 0
        || args.hidden_size % args.num_attention_heads != 0 && args.head_dim.is_none()
    {
        return Err(cx.error("`hidden_size` must be a multiple of `num_attention_heads`".into()));
    }
    let head_dim = args
        .head_dim
        .unwrap_or(args.hidden_size / args.num_attention_heads);
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
        qkv_bias: args.attention_bias,
        o_bias: args.attention_bias,
        mlp_bias: args.mlp_bias,
        qk_norm: false,
        attn_output_gate: false,
        linear_attention: None,
        weight_prefix: String::new(),
        context_length: args.max_position_embeddings.unwrap_or(4096),
        style: Default::default(),
        moe: None,
    };
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        head_dim,
        args.rope_theta,
        args.rope_traditional,
        args.rope_scaling.as_ref(),
    );
    for i in 0..args.num_hidden_layers {
        cx.weights
            .discard(&format!("model.layers.{i}.self_attn.rotary_emb.inv_freq"));
    }
    cx.decoder(config, rope, "llama")
}
