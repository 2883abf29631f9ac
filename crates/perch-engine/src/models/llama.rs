//! Llama (1/2/3.x, incl. Llama 3.1's `rope_scaling: llama3`), SmolLM2, Mistral-style models,
//! SmolLM3 (Llama with RoPE left out of every `no_rope_layer_interval`-th layer) and OLMo 2
//! (Llama with output norms and query / key norms).
//! Reference: mlx-lm `models/llama.py`, `models/smollm3.py`, `models/olmo2.py`.

use serde::Deserialize;
use serde_json::Value;

use super::decoder::DecoderConfig;
use super::{LoadContext, Resolved};
use crate::error::Result;
use crate::nn::layers::Rope;

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

/// SmolLM3's own fields of its `config.json`: which layers use RoPE (Llama's are read by
/// [`LlamaArgs`] from the same object; two parses rather than `serde(flatten)`, under which
/// errors no longer name the field).
#[derive(Debug, Deserialize)]
pub struct SmolLm3Args {
    /// Without `no_rope_layers`: every `no_rope_layer_interval`-th layer has no RoPE.
    #[serde(default = "default_no_rope_layer_interval")]
    pub no_rope_layer_interval: i32,
    /// Per layer, 1 to apply RoPE and 0 not to.
    pub no_rope_layers: Option<Vec<i32>>,
}

fn default_no_rope_layer_interval() -> i32 {
    4
}

pub fn load(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: LlamaArgs = cx.parse()?;
    load_with(cx, args, Vec::new(), "llama")
}

pub fn load_smollm3(cx: LoadContext<'_>) -> Result<Resolved> {
    let (llama, args): (LlamaArgs, SmolLm3Args) = (cx.parse()?, cx.parse()?);
    let layers = llama.num_hidden_layers;
    let uses_rope: Vec<i32> = match args.no_rope_layers {
        Some(flags) => {
            if flags.len() as i64 != layers as i64 {
                return Err(cx.error(format!(
                    "`no_rope_layers` has {} entries for {layers} layers",
                    flags.len()
                )));
            }
            flags
        }
        None => {
            let interval = args.no_rope_layer_interval;
            if interval < 1 {
                return Err(cx.error(format!(
                    "`no_rope_layer_interval` must be at least 1, got {interval}"
                )));
            }
            (0..layers.max(0))
                .map(|i| i32::from((i + 1) % interval != 0))
                .collect()
        }
    };
    let no_rope = (0..layers.max(0))
        .filter(|&i| uses_rope[i as usize] == 0)
        .collect();
    load_with(cx, llama, no_rope, "smollm3")
}

/// Llama's decoder config for `args` (not yet validated), nested under `weight_prefix`.
pub(super) fn decoder_config(
    cx: &LoadContext<'_>,
    args: &LlamaArgs,
    weight_prefix: &str,
) -> Result<DecoderConfig> {
    if args.num_attention_heads <= 0
        || args.hidden_size % args.num_attention_heads != 0 && args.head_dim.is_none()
    {
        return Err(cx.error("`hidden_size` must be a multiple of `num_attention_heads`".into()));
    }
    Ok(DecoderConfig {
        hidden_size: args.hidden_size,
        intermediate_size: args.intermediate_size,
        num_layers: args.num_hidden_layers,
        num_heads: args.num_attention_heads,
        num_kv_heads: args.num_key_value_heads.unwrap_or(args.num_attention_heads),
        head_dim: args
            .head_dim
            .unwrap_or(args.hidden_size / args.num_attention_heads),
        vocab_size: args.vocab_size,
        rms_norm_eps: args.rms_norm_eps,
        tie_word_embeddings: args.tie_word_embeddings,
        qkv_bias: args.attention_bias,
        o_bias: args.attention_bias,
        mlp_bias: args.mlp_bias,
        weight_prefix: weight_prefix.into(),
        context_length: args.max_position_embeddings.unwrap_or(4096),
        ..Default::default()
    })
}

fn load_with(
    cx: LoadContext<'_>,
    args: LlamaArgs,
    no_rope_layers: Vec<i32>,
    model_type: &str,
) -> Result<Resolved> {
    let mut config = decoder_config(&cx, &args, "")?;
    config.style.no_rope_layers = no_rope_layers;
    finish(cx, config, &args, model_type)
}

/// Validates `config`, builds `args`' RoPE and the decoder.
fn finish(
    cx: LoadContext<'_>,
    config: DecoderConfig,
    args: &LlamaArgs,
    model_type: &str,
) -> Result<Resolved> {
    config.validate().map_err(|m| cx.error(m))?;
    let rope = Rope::new(
        config.head_dim,
        args.rope_theta,
        args.rope_traditional,
        args.rope_scaling.as_ref(),
    );
    let prefix = &config.weight_prefix;
    for i in 0..args.num_hidden_layers {
        cx.weights.discard(&format!(
            "{prefix}model.layers.{i}.self_attn.rotary_emb.inv_freq"
        ));
    }
    cx.decoder(config, rope, model_type)
}

/// OLMo 2 (`olmo2`): Llama's config and layers with the norms moved to each sub-layer's output
/// (no input norms) and query / key RMSNorms over all heads' features before RoPE.
/// Reference: mlx-lm `models/olmo2.py`.
pub fn load_olmo2(cx: LoadContext<'_>) -> Result<Resolved> {
    let args: LlamaArgs = cx.parse()?;
    let mut config = decoder_config(&cx, &args, "")?;
    config.qk_norm = true;
    config.style.qk_norm_across_heads = true;
    config.style.output_norms_only = true;
    finish(cx, config, &args, "olmo2")
}

/// A multimodal Mistral 3 checkpoint's text model when it is Llama's (Mistral Small 3.1 / 3.2:
/// `text_config.model_type` `mistral`), its weights under `weight_prefix`.
pub(super) fn load_nested(
    cx: LoadContext<'_>,
    text_config: &Value,
    weight_prefix: &str,
    model_type: &str,
) -> Result<Resolved> {
    let args: LlamaArgs = cx.parse_value(text_config, "text_config")?;
    let config = decoder_config(&cx, &args, weight_prefix)?;
    finish(cx, config, &args, model_type)
}
