//! The llama architecture: GGUF metadata → Hugging Face `config.json` fields, and GGUF tensor
//! names → Hugging Face names (`transformers` `LlamaForCausalLM`, as mlx-lm's
//! `models/llama.py` loads them).
//!
//! Key and tensor names follow gguf-py `constants.py` (`Keys.LLM`, `MODEL_TENSOR` for
//! `MODEL_ARCH.LLAMA`).

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::ggml_type::GgmlType;
use crate::reader::GgufFile;
use crate::GgufError;

/// Architectures (`general.architecture`) the importer converts.
pub(crate) const SUPPORTED_ARCHITECTURES: &[&str] = &["llama"];

/// llama.cpp's default RoPE base when `llama.rope.freq_base` is absent.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// The hyperparameters of a llama model, in Hugging Face terms.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LlamaHparams {
    pub(crate) hidden_size: u64,
    pub(crate) intermediate_size: u64,
    pub(crate) num_hidden_layers: u64,
    pub(crate) num_attention_heads: u64,
    pub(crate) num_key_value_heads: u64,
    pub(crate) head_dim: u64,
    pub(crate) max_position_embeddings: u64,
    pub(crate) vocab_size: u64,
    pub(crate) rms_norm_eps: f64,
    pub(crate) rope_theta: f64,
    /// `rope_scaling` as Hugging Face writes it, `None` for plain RoPE.
    pub(crate) rope_scaling: Option<Value>,
    /// Whether q/k/v/o projections carry biases (`attention_bias`).
    pub(crate) attention_bias: bool,
    /// Whether gate/up/down projections carry biases (`mlp_bias`).
    pub(crate) mlp_bias: bool,
}

impl LlamaHparams {
    /// Reads the `llama.*` keys. Errors: [`GgufError::MissingMetadata`] /
    /// [`GgufError::MetadataType`] / [`GgufError::InvalidMetadata`] for absent or inconsistent
    /// keys, [`GgufError::UnsupportedArchitecture`] for mixture-of-experts files,
    /// [`GgufError::UnsupportedRopeScaling`].
    pub(crate) fn from_gguf(gguf: &GgufFile) -> Result<Self, GgufError> {
        let positive = |key: &str| -> Result<u64, GgufError> {
            match gguf.u64(key)? {
                0 => Err(invalid(key, "must be greater than zero")),
                v => Ok(v),
            }
        };
        if gguf.opt_u64("llama.expert_count")?.unwrap_or(0) > 0 {
            return Err(GgufError::UnsupportedArchitecture {
                found: "llama with mixture-of-experts layers".into(),
                supported: SUPPORTED_ARCHITECTURES,
            });
        }
        let hidden_size = positive("llama.embedding_length")?;
        let num_attention_heads = positive("llama.attention.head_count")?;
        let num_key_value_heads = match gguf.opt_u64("llama.attention.head_count_kv")? {
            None => num_attention_heads,
            Some(0) => {
                return Err(invalid(
                    "llama.attention.head_count_kv",
                    "must be greater than zero",
                ))
            }
            Some(v) => v,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(
                "llama.attention.head_count_kv",
                &format!(
                    "{num_key_value_heads} does not divide the head count {num_attention_heads}"
                ),
            ));
        }
        let head_dim = match gguf.opt_u64("llama.attention.key_length")? {
            Some(v) => v,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(invalid(
                    "llama.attention.head_count",
                    &format!(
                        "{num_attention_heads} heads do not divide the hidden size {hidden_size}"
                    ),
                ))
            }
        };
        // The q projection has `heads · head_dim` rows: a file whose product overflows describes
        // no model (and would overflow the tensor shape checks).
        if num_attention_heads.checked_mul(head_dim).is_none() {
            return Err(invalid(
                "llama.attention.key_length",
                &format!(
                    "{num_attention_heads} heads of {head_dim} dimensions overflow a 64-bit size"
                ),
            ));
        }
        if let Some(value_length) = gguf.opt_u64("llama.attention.value_length")? {
            if value_length != head_dim {
                return Err(invalid(
                    "llama.attention.value_length",
                    &format!("{value_length} differs from the key length {head_dim}; llama needs them equal"),
                ));
            }
        }
        if let Some(rope_dims) = gguf.opt_u64("llama.rope.dimension_count")? {
            if rope_dims != head_dim {
                return Err(invalid(
                    "llama.rope.dimension_count",
                    &format!("RoPE on {rope_dims} of {head_dim} head dimensions (partial RoPE) is not supported"),
                ));
            }
        }
        let vocab_size = match gguf.opt_u64("llama.vocab_size")? {
            Some(v) => v,
            None => match gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
                Some(tokens) => tokens.len() as u64,
                None => {
                    return Err(GgufError::MissingMetadata {
                        key: "llama.vocab_size".into(),
                    })
                }
            },
        };
        let rope_theta = gguf
            .opt_f64("llama.rope.freq_base")?
            .unwrap_or(DEFAULT_ROPE_THETA);
        let max_position_embeddings = positive("llama.context_length")?;

        Ok(LlamaHparams {
            hidden_size,
            intermediate_size: positive("llama.feed_forward_length")?,
            num_hidden_layers: positive("llama.block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings,
            vocab_size,
            rms_norm_eps: gguf.f64("llama.attention.layer_norm_rms_epsilon")?,
            rope_theta,
            rope_scaling: rope_scaling(gguf, head_dim, rope_theta)?,
            attention_bias: gguf.tensor("blk.0.attn_q.bias").is_some(),
            mlp_bias: gguf.tensor("blk.0.ffn_up.bias").is_some(),
        })
    }

    /// The architecture fields of `config.json` (token ids and quantization are added by the
    /// importer). Key names and defaults follow `transformers` `LlamaConfig`.
    pub(crate) fn config_fields(&self, tie_word_embeddings: bool) -> BTreeMap<String, Value> {
        let fields = [
            ("architectures", json!(["LlamaForCausalLM"])),
            ("model_type", json!("llama")),
            ("hidden_act", json!("silu")),
            ("hidden_size", json!(self.hidden_size)),
            ("intermediate_size", json!(self.intermediate_size)),
            ("num_hidden_layers", json!(self.num_hidden_layers)),
            ("num_attention_heads", json!(self.num_attention_heads)),
            ("num_key_value_heads", json!(self.num_key_value_heads)),
            ("head_dim", json!(self.head_dim)),
            (
                "max_position_embeddings",
                json!(self.max_position_embeddings),
            ),
            ("vocab_size", json!(self.vocab_size)),
            ("rms_norm_eps", json!(self.rms_norm_eps)),
            ("rope_theta", json!(self.rope_theta)),
            (
                "rope_scaling",
                self.rope_scaling.clone().unwrap_or(Value::Null),
            ),
            ("attention_bias", json!(self.attention_bias)),
            ("mlp_bias", json!(self.mlp_bias)),
            ("tie_word_embeddings", json!(tie_word_embeddings)),
            ("torch_dtype", json!("float16")),
        ];
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
    }

    /// GGUF tensors every model with these hyperparameters must have (`output.weight` is
    /// optional: without it the embeddings are tied), in order. Made one at a time: the layer
    /// count comes from the file, and the importer stops at the first tensor missing, so a header
    /// that claims 2^32 layers costs a lookup per layer the file has, not 2^35 names in memory.
    pub(crate) fn required_tensors(&self) -> impl Iterator<Item = String> + '_ {
        const WEIGHTS: [&str; 9] = [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ];
        const ATTENTION_BIASES: [&str; 4] = ["attn_q", "attn_k", "attn_v", "attn_output"];
        const MLP_BIASES: [&str; 3] = ["ffn_gate", "ffn_up", "ffn_down"];
        let layers = (0..self.num_hidden_layers).flat_map(move |i| {
            let biases = ATTENTION_BIASES
                .iter()
                .filter(move |_| self.attention_bias)
                .chain(MLP_BIASES.iter().filter(move |_| self.mlp_bias));
            WEIGHTS
                .iter()
                .map(move |part| format!("blk.{i}.{part}.weight"))
                .chain(biases.map(move |part| format!("blk.{i}.{part}.bias")))
        });
        ["token_embd.weight", "output_norm.weight"]
            .into_iter()
            .map(String::from)
            .chain(layers)
    }
}

fn invalid(key: &str, reason: &str) -> GgufError {
    GgufError::InvalidMetadata {
        key: key.to_string(),
        reason: reason.to_string(),
    }
}

/// What a module is, which decides whether MLX can hold it quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModuleKind {
    Embedding,
    Linear,
    Norm,
}

/// Where a GGUF tensor goes in the Hugging Face layout.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MappedTensor {
    /// Module path, e.g. `model.layers.0.self_attn.q_proj`.
    pub(crate) module: String,
    /// `"weight"` or `"bias"`.
    pub(crate) param: &'static str,
    pub(crate) kind: ModuleKind,
    /// Head count to undo llama.cpp's RoPE row permutation with (q and k only).
    pub(crate) rope_heads: Option<u64>,
    /// Row-major Hugging Face shape the tensor must have.
    pub(crate) expected_shape: Vec<u64>,
}

/// What the importer does with a GGUF tensor.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TensorRole {
    /// Written under a Hugging Face name.
    Mapped(MappedTensor),
    /// llama.cpp's precomputed Llama 3 RoPE factors; already folded into `rope_scaling`.
    RopeFreqs,
}

/// Maps a GGUF tensor name. Errors: [`GgufError::UnexpectedTensor`] for names outside the
/// llama layout (or layers beyond `block_count`).
pub(crate) fn map_tensor(name: &str, hp: &LlamaHparams) -> Result<TensorRole, GgufError> {
    let unexpected = || GgufError::UnexpectedTensor {
        tensor: name.to_string(),
        architecture: "llama".into(),
    };
    if name == "rope_freqs.weight" {
        return Ok(TensorRole::RopeFreqs);
    }
    let (stem, param) = if let Some(stem) = name.strip_suffix(".weight") {
        (stem, "weight")
    } else if let Some(stem) = name.strip_suffix(".bias") {
        (stem, "bias")
    } else {
        return Err(unexpected());
    };
    let (h, inter) = (hp.hidden_size, hp.intermediate_size);
    let q_rows = hp.num_attention_heads * hp.head_dim;
    let kv_rows = hp.num_key_value_heads * hp.head_dim;

    let (module, kind, rope_heads, shape): (String, ModuleKind, Option<u64>, [u64; 2]) = match stem
    {
        "token_embd" => (
            "model.embed_tokens".into(),
            ModuleKind::Embedding,
            None,
            [hp.vocab_size, h],
        ),
        "output_norm" => ("model.norm".into(), ModuleKind::Norm, None, [h, 0]),
        "output" => (
            "lm_head".into(),
            ModuleKind::Linear,
            None,
            [hp.vocab_size, h],
        ),
        _ => {
            let rest = stem.strip_prefix("blk.").ok_or_else(unexpected)?;
            let (layer, part) = rest.split_once('.').ok_or_else(unexpected)?;
            let layer: u64 = layer.parse().map_err(|_| unexpected())?;
            if layer >= hp.num_hidden_layers {
                return Err(unexpected());
            }
            let prefix = format!("model.layers.{layer}");
            let (suffix, kind, rope_heads, shape) = match part {
                "attn_norm" => ("input_layernorm", ModuleKind::Norm, None, [h, 0]),
                "ffn_norm" => ("post_attention_layernorm", ModuleKind::Norm, None, [h, 0]),
                "attn_q" => (
                    "self_attn.q_proj",
                    ModuleKind::Linear,
                    Some(hp.num_attention_heads),
                    [q_rows, h],
                ),
                "attn_k" => (
                    "self_attn.k_proj",
                    ModuleKind::Linear,
                    Some(hp.num_key_value_heads),
                    [kv_rows, h],
                ),
                "attn_v" => ("self_attn.v_proj", ModuleKind::Linear, None, [kv_rows, h]),
                "attn_output" => ("self_attn.o_proj", ModuleKind::Linear, None, [h, q_rows]),
                "ffn_gate" => ("mlp.gate_proj", ModuleKind::Linear, None, [inter, h]),
                "ffn_up" => ("mlp.up_proj", ModuleKind::Linear, None, [inter, h]),
                "ffn_down" => ("mlp.down_proj", ModuleKind::Linear, None, [h, inter]),
                _ => return Err(unexpected()),
            };
            (format!("{prefix}.{suffix}"), kind, rope_heads, shape)
        }
    };
    // Norms have one parameter; linear layers' biases are [out].
    let expected_shape = match (kind, param) {
        (ModuleKind::Norm, "weight") => vec![shape[0]],
        (ModuleKind::Norm, _) | (ModuleKind::Embedding, "bias") => return Err(unexpected()),
        (_, "bias") => vec![shape[0]],
        _ => shape.to_vec(),
    };
    Ok(TensorRole::Mapped(MappedTensor {
        module,
        param,
        kind,
        rope_heads,
        expected_shape,
    }))
}

/// `rope_scaling` for config.json from the GGUF's RoPE scaling keys or its `rope_freqs` tensor.
fn rope_scaling(
    gguf: &GgufFile,
    head_dim: u64,
    rope_theta: f64,
) -> Result<Option<Value>, GgufError> {
    if let Some(info) = gguf.tensor("rope_freqs.weight") {
        if info.ggml_type != GgmlType::F32 || info.n_elements() != head_dim / 2 {
            return Err(GgufError::InvalidTensor {
                tensor: info.name.clone(),
                reason: format!(
                    "expected {} F32 RoPE factors, found {} of type {}",
                    head_dim / 2,
                    info.n_elements(),
                    info.ggml_type
                ),
            });
        }
        let bytes = gguf.read_tensor_bytes(info)?;
        let factors: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect();
        let original_context = gguf.opt_u64("llama.rope.scaling.original_context_length")?;
        return llama3_scaling_from_factors(&factors, head_dim, rope_theta, original_context)
            .map(Some);
    }
    match gguf.opt_str("llama.rope.scaling.type")? {
        None | Some("none") => Ok(None),
        Some("linear") => {
            let factor = gguf.f64("llama.rope.scaling.factor")?;
            Ok(Some(json!({ "type": "linear", "factor": factor })))
        }
        Some(other) => Err(GgufError::UnsupportedRopeScaling {
            reason: format!(
                "scaling type `{other}` (supported: none, linear, and Llama 3 `rope_freqs`)"
            ),
        }),
    }
}

/// Llama 3 RoPE factor for one frequency (`rope_type: "llama3"` in `transformers`
/// `modeling_rope_utils.py`; llama.cpp precomputes the same values into `rope_freqs`).
fn llama3_factor(
    freq: f64,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_context: f64,
) -> f64 {
    let wavelen = 2.0 * std::f64::consts::PI / freq;
    let low_freq_wavelen = original_context / low_freq_factor;
    let high_freq_wavelen = original_context / high_freq_factor;
    if wavelen < high_freq_wavelen {
        1.0
    } else if wavelen > low_freq_wavelen {
        factor
    } else {
        let smooth =
            (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
        1.0 / ((1.0 - smooth) / factor + smooth)
    }
}

/// Recovers Hugging Face's `rope_scaling` from llama.cpp's `rope_freqs` tensor.
///
/// The tensor keeps only the per-frequency factors, not the parameters. llama.cpp's converter
/// fills in `low_freq_factor` 1, `high_freq_factor` 4 and an original context of 8192 when the
/// config lacks them, and every Llama 3.x release uses those values; the largest factor is
/// `factor`. The guess is accepted only if it reproduces every stored factor.
pub(crate) fn llama3_scaling_from_factors(
    factors: &[f64],
    head_dim: u64,
    rope_theta: f64,
    original_context: Option<u64>,
) -> Result<Value, GgufError> {
    let (low, high) = (1.0, 4.0);
    let original_context = original_context.unwrap_or(8192);
    let factor = factors.iter().copied().fold(1.0, f64::max);
    let matches = factors.iter().enumerate().all(|(i, &stored)| {
        let freq = 1.0 / rope_theta.powf((2 * i) as f64 / head_dim as f64);
        let expected = llama3_factor(freq, factor, low, high, original_context as f64);
        (expected - stored).abs() <= 1e-4 * expected.abs()
    });
    if !matches {
        return Err(GgufError::UnsupportedRopeScaling {
            reason: "the `rope_freqs` factors do not follow Llama 3 scaling \
                     (low_freq_factor 1, high_freq_factor 4, original context 8192)"
                .into(),
        });
    }
    Ok(json!({
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_context,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hparams() -> LlamaHparams {
        LlamaHparams {
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            max_position_embeddings: 8192,
            vocab_size: 49152,
            rms_norm_eps: 1e-5,
            rope_theta: 100000.0,
            rope_scaling: None,
            attention_bias: false,
            mlp_bias: false,
        }
    }

    fn mapped(name: &str) -> MappedTensor {
        match map_tensor(name, &hparams()).unwrap() {
            TensorRole::Mapped(m) => m,
            other => panic!("{name} mapped to {other:?}"),
        }
    }

    #[test]
    fn maps_gguf_names_to_hugging_face_names_and_shapes() {
        let k = mapped("blk.7.attn_k.weight");
        assert_eq!(k.module, "model.layers.7.self_attn.k_proj");
        assert_eq!(
            (k.rope_heads, k.expected_shape.clone()),
            (Some(3), vec![192, 576])
        );
        assert_eq!(mapped("blk.0.attn_q.weight").rope_heads, Some(9));
        assert_eq!(mapped("blk.0.attn_v.weight").rope_heads, None);
        assert_eq!(
            mapped("blk.1.ffn_down.weight").expected_shape,
            vec![576, 1536]
        );
        assert_eq!(
            mapped("blk.2.ffn_norm.weight").module,
            "model.layers.2.post_attention_layernorm"
        );
        assert_eq!(mapped("output.weight").module, "lm_head");
        assert_eq!(mapped("token_embd.weight").kind, ModuleKind::Embedding);
        assert_eq!(mapped("blk.0.attn_q.bias").expected_shape, vec![576]);
        assert_eq!(
            map_tensor("rope_freqs.weight", &hparams()).unwrap(),
            TensorRole::RopeFreqs
        );
        for bad in [
            "blk.30.attn_q.weight",
            "blk.x.attn_q.weight",
            "blk.0.ffn_gate_exps.weight",
            "token_embd",
            "output_norm.bias",
        ] {
            let err = map_tensor(bad, &hparams()).unwrap_err();
            assert!(
                matches!(err, GgufError::UnexpectedTensor { .. }),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn recovers_llama3_rope_scaling_from_factors() {
        // Llama 3.1 8B: head_dim 128, theta 500000, factor 8.
        let (head_dim, theta) = (128u64, 500_000.0);
        let factors: Vec<f64> = (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / f64::powf(theta, (2 * i) as f64 / head_dim as f64);
                // As stored: f32.
                f64::from(llama3_factor(freq, 8.0, 1.0, 4.0, 8192.0) as f32)
            })
            .collect();
        assert!(
            factors.iter().any(|&f| f > 1.0 && f < 8.0),
            "the test needs smoothed factors"
        );
        let scaling = llama3_scaling_from_factors(&factors, head_dim, theta, None).unwrap();
        assert_eq!(scaling["rope_type"], "llama3");
        assert_eq!(scaling["factor"], 8.0);
        assert_eq!(scaling["original_max_position_embeddings"], 8192);

        let mut wrong = factors.clone();
        wrong[40] *= 1.5;
        let err = llama3_scaling_from_factors(&wrong, head_dim, theta, None).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedRopeScaling { .. }),
            "{err}"
        );
    }
}
