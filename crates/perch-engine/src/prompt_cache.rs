//! Prompt caches on disk: the KV state of a prefix as a safetensors file, in the layout of
//! mlx_lm's `save_prompt_cache` / `load_prompt_cache` (`mlx_lm/models/cache.py`, one `KVCache`
//! per layer), so files move between Perch and mlx_lm both ways.
//!
//! Layout (mlx_lm 0.32):
//! - tensors `"{layer}.0"` keys and `"{layer}.1"` values, `[1, kv_heads, positions, head_dim]`
//!   (mlx_lm writes its whole buffer, so `positions` may exceed the cached length), and
//!   `"{layer}.2"` the cached length (`offset`), a scalar;
//! - metadata `"0.{key}"` free-form strings, `"1.{layer}"` the cache class (`KVCache`), and
//!   `"2.0" = ""`, `"2.{k}.0" = "{layer}.2"`, `"2.{k}.1" = "scalar"` marking the scalars.
//!
//! Perch adds its own free-form keys, which mlx_lm carries along and ignores: `perch_model_id`,
//! `perch_tokens` (the prefix's token ids, JSON), `perch_block_size`, `perch_dtype`. A file from
//! mlx_lm has none of them: its prefix is used as is, without joining the prefix cache.
//!
//! Errors, never panics: a damaged file, another architecture's shapes, another model's id,
//! another cache class, and an offset that disagrees with the tokens are each reported as
//! [`EngineError::PromptCache`]. Saving writes a temporary file and renames it, so an existing
//! file is never left half written.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::{Array, Dtype};

use crate::cache::KvCache;
use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::models::Model;

const CLASS: &str = "KVCache";

/// A prefix's KV state, read from or written to a prompt-cache file.
pub struct PromptCache {
    /// One per layer, holding `offset` positions.
    pub layers: Vec<KvCache>,
    /// Cached positions.
    pub offset: usize,
    /// The prefix's token ids, when the file records them (files written by Perch).
    pub tokens: Option<Vec<u32>>,
    /// The free-form metadata (`"0.{key}"` entries), Perch's keys included.
    pub metadata: HashMap<String, String>,
}

/// Why a model with linear-attention layers has no prompt caches yet.
pub const RECURRENT_UNSUPPORTED: &str =
    "prompt caches of models with linear-attention layers (Qwen3.5) are not supported yet";

/// Why a model with sliding-window layers has no prompt caches yet (mlx_lm keeps those layers in
/// `RotatingKVCache`s, a layout Perch neither writes nor reads yet).
pub const SLIDING_WINDOW_UNSUPPORTED: &str =
    "prompt caches of models with sliding-window layers (Gemma 3, Ministral 3 with `layer_types`) are not supported yet";

/// Why `model` cannot have prompt caches, or `None` when it can.
pub fn unsupported_reason(model: &dyn Model) -> Option<&'static str> {
    if model.has_recurrent_layers() {
        Some(RECURRENT_UNSUPPORTED)
    } else if model.has_sliding_window_layers() {
        Some(SLIDING_WINDOW_UNSUPPORTED)
    } else {
        None
    }
}

/// Writes `layers` (each holding `tokens.len()` positions) to `path` (must end in
/// `.safetensors`), with `tokens` and `model_id` recorded for later validation.
pub fn save_prompt_cache(
    path: &Path,
    layers: &[KvCache],
    tokens: &[u32],
    model_id: &str,
    block_size: usize,
) -> Result<()> {
    let error = |message: String| EngineError::PromptCache {
        path: path.to_path_buf(),
        message,
    };
    if layers.iter().any(KvCache::is_recurrent) {
        return Err(error(RECURRENT_UNSUPPORTED.into()));
    }
    if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        return Err(error("the file name must end in .safetensors".into()));
    }
    let offset = tokens.len() as i32;
    let mut arrays: Vec<(String, Array)> = Vec::new();
    let mut metadata: HashMap<String, String> = HashMap::new();
    metadata.insert("2.0".into(), String::new());
    let mut dtype = None;
    for (i, layer) in layers.iter().enumerate() {
        if layer.offset() != offset {
            return Err(error(format!(
                "layer {i} holds {} positions, not {offset}",
                layer.offset()
            )));
        }
        let (keys, values) = layer.positions(0, offset)?;
        dtype.get_or_insert(keys.dtype());
        arrays.push((format!("{i}.0"), keys));
        arrays.push((format!("{i}.1"), values));
        arrays.push((format!("{i}.2"), Array::from_int(offset)));
        metadata.insert(format!("1.{i}"), CLASS.into());
        metadata.insert(format!("2.{}.0", i + 1), format!("{i}.2"));
        metadata.insert(format!("2.{}.1", i + 1), "scalar".into());
    }
    let user = [
        ("perch_model_id", model_id.to_string()),
        (
            "perch_tokens",
            serde_json::to_string(tokens).expect("token ids serialize"),
        ),
        ("perch_block_size", block_size.to_string()),
        (
            "perch_dtype",
            format!("{:?}", dtype.unwrap_or(Dtype::Float32)).to_lowercase(),
        ),
    ];
    for (key, value) in user {
        metadata.insert(format!("0.{key}"), value);
    }

    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("cache");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp.safetensors", std::process::id()));
    let written =
        Array::save_safetensors(arrays.iter().map(|(k, v)| (k.as_str(), v)), &metadata, &tmp)
            .map_err(|e| error(format!("cannot write: {e}")))
            .and_then(|()| {
                std::fs::rename(&tmp, path).map_err(|e| error(format!("cannot write: {e}")))
            });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads a prompt-cache file for `model`, whose identity is `model_id`. The layers come back in
/// the model's compute dtype.
pub fn load_prompt_cache(path: &Path, model: &dyn Model, model_id: &str) -> Result<PromptCache> {
    let error = |message: String| EngineError::PromptCache {
        path: path.to_path_buf(),
        message,
    };
    if let Some(reason) = unsupported_reason(model) {
        return Err(error(reason.into()));
    }
    crate::weights::validate_safetensors(path).map_err(|e| match e {
        EngineError::CorruptWeights { message, .. } => {
            error(format!("damaged or not a safetensors file: {message}"))
        }
        other => other,
    })?;
    let (mut arrays, raw) =
        Array::load_safetensors_with_metadata(path).map_err(|e| error(e.to_string()))?;
    let metadata: HashMap<String, String> = raw
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("0.").map(|k| (k.to_string(), v.clone())))
        .collect();

    if let Some(id) = metadata.get("perch_model_id") {
        if id != model_id {
            return Err(error(format!(
                "it was made with model {id}, not the loaded {model_id}"
            )));
        }
    }
    let info = model.info();
    let classes: Vec<&String> = (0..).map_while(|i| raw.get(&format!("1.{i}"))).collect();
    if classes.len() != info.num_layers {
        return Err(error(format!(
            "it holds {} layers; the model has {}",
            classes.len(),
            info.num_layers
        )));
    }
    if let Some(other) = classes.iter().find(|c| c.as_str() != CLASS) {
        return Err(error(format!(
            "cache type {other} is not supported (only {CLASS})"
        )));
    }
    let dtype = Backend::current().compute_dtype(Dtype::Float32);
    let mut layers = Vec::with_capacity(info.num_layers);
    let mut offset = None;
    for i in 0..info.num_layers {
        let mut take = |part: usize| {
            arrays
                .remove(&format!("{i}.{part}"))
                .ok_or_else(|| error(format!("tensor {i}.{part} is missing")))
        };
        let (keys, values, length) = (take(0)?, take(1)?, take(2)?);
        let length = length.as_dtype(Dtype::Int64)?;
        length.eval()?;
        let length = match length.shape() {
            [] => length.as_slice::<i64>()[0],
            _ => return Err(error(format!("tensor {i}.2 is not a scalar offset"))),
        };
        let expected = [
            1,
            info.num_kv_heads as i32,
            keys.shape().get(2).copied().unwrap_or(0),
            info.head_dim as i32,
        ];
        if keys.shape() != expected || values.shape() != expected {
            return Err(error(format!(
                "layer {i} has keys {:?} and values {:?}; the model needs [1, {}, positions, {}]",
                keys.shape(),
                values.shape(),
                info.num_kv_heads,
                info.head_dim
            )));
        }
        if length < 0 || length > expected[2] as i64 || *offset.get_or_insert(length) != length {
            return Err(error(format!(
                "layer {i} has offset {length}, inconsistent with its {} positions or other layers",
                expected[2]
            )));
        }
        let length = length as i32;
        let mut cache = KvCache::new();
        if length > 0 {
            let range = |a: &Array| {
                crate::mlx_ext::slice(a, &[0, 0, 0, 0], &[1, expected[1], length, expected[3]])
            };
            cache.update_and_fetch(
                &range(&keys)?.as_dtype(dtype)?,
                &range(&values)?.as_dtype(dtype)?,
            )?;
        }
        layers.push(cache);
    }
    let offset = offset.unwrap_or(0) as usize;
    let tokens = match metadata.get("perch_tokens") {
        Some(json) => {
            let tokens: Vec<u32> = serde_json::from_str(json)
                .map_err(|e| error(format!("perch_tokens is not a list of token ids: {e}")))?;
            if tokens.len() != offset {
                return Err(error(format!(
                    "it records {} tokens but caches {offset} positions",
                    tokens.len()
                )));
            }
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
                return Err(error(format!(
                    "token id {bad} is outside the model's vocabulary"
                )));
            }
            Some(tokens)
        }
        None => None,
    };
    if offset >= info.context_length {
        return Err(error(format!(
            "it caches {offset} positions, the model's context is {}",
            info.context_length
        )));
    }
    mlx_rs::transforms::eval(layers.iter().flat_map(KvCache::state))?;
    Ok(PromptCache {
        layers,
        offset,
        tokens,
        metadata,
    })
}
