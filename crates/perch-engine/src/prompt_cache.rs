//! Prompt caches on disk: the KV state of a prefix as a safetensors file, in the layout of
//! mlx_lm's `save_prompt_cache` / `load_prompt_cache` (`mlx_lm/models/cache.py`), so files move
//! between Perch and mlx_lm both ways.
//!
//! Layout (mlx_lm 0.32), per layer one of:
//! - `KVCache` (global attention): tensors `"{layer}.0"` keys and `"{layer}.1"` values,
//!   `[1, kv_heads, positions, head_dim]` (mlx_lm writes its whole buffer, so `positions` may
//!   exceed the cached length), and `"{layer}.2"` the cached length (`offset`), a scalar;
//! - `RotatingKVCache` (sliding-window layers, mlx_lm's `state`): `"{layer}.0"` / `"{layer}.1"`
//!   keys and values, then the scalars `offset`, `keep`, `max_size` (the window) and `_idx` as
//!   `"{layer}.2"` … `"{layer}.5"`. The buffer may be a ring: mlx_lm's `_temporal_order` puts
//!   it back in order (as is when `_idx` is its length; `[:keep] + [_idx:] + [keep:_idx]` when
//!   `_idx < offset`; else `[:_idx]`), after which it holds the last positions before `offset`.
//! - `ArraysCache` (a linear-attention layer of a hybrid model, Qwen3.5): `"{layer}.0.0"` the
//!   convolution's last inputs `[1, kernel - 1, channels]`, `"{layer}.0.1"` the recurrence's
//!   state `[1, value_heads, value_dim, key_dim]`, and `"{layer}.1"` / `"{layer}.2"` (left padding
//!   and lengths of a batch) `None`: an empty tensor listed as `"none"`. No offset: the attention
//!   layers' gives the state's position.
//! - metadata `"0.{key}"` free-form strings, `"1.{layer}"` the cache class, and `"2.0" = ""`,
//!   `"2.{k}.0" = "{layer}.{part}"`, `"2.{k}.1" = "scalar"` (or `"none"`) marking the scalars,
//!   `k` counting every scalar of the file from 1.
//!
//! Perch writes a sliding layer's positions in order, all those the prefix computed (`_idx` =
//! their number, `keep` = 0), which is the state mlx_lm itself has after one prompt pass; mlx_lm
//! trims them to its window at its next update. A sliding layer read from mlx_lm may hold only
//! its last positions: such a prefix serves requests that continue it ([`Prompt::AfterCache`])
//! but cannot join the prefix cache, whose blocks hold every layer.
//!
//! Perch adds its own free-form keys, which mlx_lm carries along and ignores: `perch_model_id`,
//! `perch_tokens` (the prefix's token ids, JSON), `perch_block_size`, `perch_dtype`, and for a
//! rank's part of a model divided over ranks `perch_part` ([`part_of`]). A file from mlx_lm has
//! none of them: its prefix is used as is, without joining the prefix cache.
//!
//! A model divided over ranks keeps a prompt cache as one file a rank, each holding that rank's
//! part of the KV (its heads, or its stage's layers): rank 0's at the path asked for, rank `r`'s
//! beside it at [`rank_path`] on that rank's host. Each part loads only into the same rank of the
//! same division (`perch_part`).
//!
//! Errors, never panics: a damaged file, another architecture's shapes, another model's id,
//! another cache class or window, positions a layer needs but the file dropped, and an offset
//! that disagrees with the tokens are each reported as [`EngineError::PromptCache`]. Saving
//! writes a temporary file and renames it, so an existing file is never left half written.
//!
//! [`Prompt::AfterCache`]: crate::Prompt::AfterCache

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::kv::cache::{KvCache, RecurrentState};
use crate::models::Model;

const CLASS: &str = "KVCache";
const ROTATING_CLASS: &str = "RotatingKVCache";
const ARRAYS_CLASS: &str = "ArraysCache";

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

/// A rank's part of a prompt cache saved by a model divided over ranks: which part it is
/// ([`part_of`], `perch_part`), and the save it belongs to (`perch_save`: one id for every
/// rank's file of one save, so that parts of different saves are never read together).
pub struct RankPart {
    pub part: String,
    pub save_id: u64,
}

impl PromptCache {
    /// Why this prefix cannot join a prefix cache of `block_size`-token blocks, or `None` when
    /// it can: every layer must hold every position from 0 (a sliding layer read from mlx_lm may
    /// hold only its window), and linear-attention layers' states, which exist after the last
    /// token only, must fall at the end of a block (where a hit can start from them).
    pub fn why_not_in_prefix_cache(&self, block_size: usize) -> Option<String> {
        if self.layers.iter().any(|l| l.first_position() > 0) {
            return Some(
                "its sliding-window layers hold only their last positions, and prefix-cache \
                 blocks hold every position"
                    .into(),
            );
        }
        if self.layers.iter().any(KvCache::is_recurrent)
            && !self.offset.is_multiple_of(block_size.max(1))
        {
            return Some(format!(
                "its linear-attention layers' states are after {} tokens, not at the end of a \
                 {block_size}-token block, where the prefix cache keeps such states",
                self.offset
            ));
        }
        None
    }
}

/// Why `model` cannot have prompt caches, or `None` when it can (every architecture Perch runs
/// can now; kept for the engine's check before it computes a prefix).
pub fn unsupported_reason(_model: &dyn Model) -> Option<&'static str> {
    None
}

/// Which part of a divided model `model` is (`"tensor parallel, rank 1 of 2"`), or `None` for
/// a whole model: recorded as `perch_part` in the prompt caches it saves.
pub fn part_of(model: &dyn Model) -> Option<String> {
    let division = model.division().filter(|d| d.size() > 1)?;
    let kind = match division {
        crate::distributed::Division::Tensor(_) => "tensor parallel",
        crate::distributed::Division::Pipeline(_) => "pipeline stage",
    };
    Some(format!(
        "{kind}, rank {} of {}",
        division.rank(),
        division.size()
    ))
}

/// Where rank `rank` of a divided model keeps its part of the prompt cache asked for at `path`
/// (rank 0: `path` itself; rank 2 of `c.safetensors`: `c.rank2.safetensors`).
pub fn rank_path(path: &Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("cache");
    path.with_file_name(format!("{stem}.rank{rank}.safetensors"))
}

/// Writes `layers` (each holding `tokens.len()` positions) to `path` (must end in
/// `.safetensors`), with `tokens` and `model_id` recorded for later validation, and `part`
/// when the layers are a rank's part of a divided model.
pub fn save_prompt_cache(
    path: &Path,
    layers: &[KvCache],
    tokens: &[u32],
    model_id: &str,
    block_size: usize,
    part: Option<&RankPart>,
) -> Result<()> {
    let error = |message: String| EngineError::PromptCache {
        path: path.to_path_buf(),
        message,
    };
    if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
        return Err(error("the file name must end in .safetensors".into()));
    }
    let offset = tokens.len() as i32;
    let mut arrays: Vec<(String, Array)> = Vec::new();
    let mut metadata: HashMap<String, String> = HashMap::new();
    metadata.insert("2.0".into(), String::new());
    let mut dtype = None;
    let mut scalars = 0;
    let mut scalar_entry = |name: &str, kind: &str, metadata: &mut HashMap<String, String>| {
        scalars += 1;
        metadata.insert(format!("2.{scalars}.0"), name.to_string());
        metadata.insert(format!("2.{scalars}.1"), kind.to_string());
    };
    for (i, layer) in layers.iter().enumerate() {
        if layer.offset() != offset {
            return Err(error(format!(
                "layer {i} holds {} positions, not {offset}",
                layer.offset()
            )));
        }
        if layer.is_recurrent() {
            let state = layer
                .recurrent_state()
                .ok_or_else(|| error(format!("layer {i} has no state (an empty prefix)")))?;
            arrays.push((format!("{i}.0.0"), state.conv.clone()));
            arrays.push((format!("{i}.0.1"), state.ssm.clone()));
            for part in [1, 2] {
                let name = format!("{i}.{part}");
                scalar_entry(&name, "none", &mut metadata);
                arrays.push((name, Array::from_slice::<f32>(&[], &[0])));
            }
            metadata.insert(format!("1.{i}"), ARRAYS_CLASS.into());
            continue;
        }
        let first = layer.first_position();
        let (keys, values) = layer.positions(first, offset)?;
        dtype.get_or_insert(keys.dtype());
        arrays.push((format!("{i}.0"), keys));
        arrays.push((format!("{i}.1"), values));
        let (class, ints) = match layer.window() {
            // offset, keep, max_size, _idx (the positions held, in order).
            Some(window) => (ROTATING_CLASS, vec![offset, 0, window, offset - first]),
            None => (CLASS, vec![offset]),
        };
        for (k, value) in ints.into_iter().enumerate() {
            let name = format!("{i}.{}", k + 2);
            scalar_entry(&name, "scalar", &mut metadata);
            arrays.push((name, Array::from_int(value)));
        }
        metadata.insert(format!("1.{i}"), class.into());
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
    if let Some(part) = part {
        metadata.insert("0.perch_part".into(), part.part.clone());
        metadata.insert("0.perch_save".into(), part.save_id.to_string());
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
    crate::nn::weights::validate_safetensors(path).map_err(|e| match e {
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
    let (theirs, ours) = (metadata.get("perch_part").cloned(), part_of(model));
    if theirs != ours {
        let held = |part: Option<String>| match part {
            Some(part) => format!("the {part} part of the model's KV"),
            None => "the whole model's KV".to_owned(),
        };
        return Err(error(format!(
            "it holds {}; the loaded model needs {}: a prompt cache saved over ranks is a file a \
             rank, each loaded by the same rank of the same division",
            held(theirs),
            held(ours),
        )));
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
    if let Some(other) = classes
        .iter()
        .find(|c| ![CLASS, ROTATING_CLASS, ARRAYS_CLASS].contains(&c.as_str()))
    {
        return Err(error(format!(
            "cache type {other} is not supported (only {CLASS}, {ROTATING_CLASS} and \
             {ARRAYS_CLASS})"
        )));
    }
    // The scalars' kinds by tensor name ("scalar", "none", ...).
    let scalar_kinds: HashMap<&str, &str> = (1..)
        .map_while(|k| {
            Some((
                raw.get(&format!("2.{k}.0"))?.as_str(),
                raw.get(&format!("2.{k}.1"))?.as_str(),
            ))
        })
        .collect();
    let empty = model.make_cache(None);
    let dtype = Backend::current().compute_dtype(Dtype::Float32);
    let mut layers = Vec::with_capacity(info.num_layers);
    // Recurrent layers' states, set once the attention layers gave the offset.
    let mut states = Vec::new();
    let mut offset = None;
    for (i, model_layer) in empty.iter().enumerate() {
        let window = model_layer.window();
        let mut take = |part: &str| {
            arrays
                .remove(&format!("{i}.{part}"))
                .ok_or_else(|| error(format!("tensor {i}.{part} is missing")))
        };
        let recurrent_file = classes[i].as_str() == ARRAYS_CLASS;
        if model_layer.is_recurrent() != recurrent_file {
            return Err(error(format!(
                "layer {i} is a {} in the file; the model's layer {i} is {}",
                classes[i],
                if model_layer.is_recurrent() {
                    "a linear-attention layer (ArraysCache)"
                } else {
                    "an attention layer"
                }
            )));
        }
        if recurrent_file {
            for part in ["1", "2"] {
                let name = format!("{i}.{part}");
                if scalar_kinds.get(name.as_str()) != Some(&"none") {
                    return Err(error(format!(
                        "layer {i}'s ArraysCache has left padding or lengths (a batch's cache); \
                         only one sequence's state is read"
                    )));
                }
            }
            let (conv, ssm) = (take("0.0")?, take("0.1")?);
            if let Some([conv_shape, ssm_shape]) = model_layer.state_shapes() {
                if conv.shape() != conv_shape.as_slice() || ssm.shape() != ssm_shape.as_slice() {
                    return Err(error(format!(
                        "layer {i} has states {:?} and {:?}; the model needs {conv_shape:?} and \
                         {ssm_shape:?}",
                        conv.shape(),
                        ssm.shape()
                    )));
                }
            }
            states.push((
                i,
                RecurrentState {
                    conv: conv.as_dtype(dtype)?,
                    ssm: ssm.as_dtype(Dtype::Float32)?,
                },
            ));
            layers.push(KvCache::recurrent());
            continue;
        }
        let mut take = |part: usize| take(&part.to_string());
        let (keys, values) = (take(0)?, take(1)?);
        let mut scalar = |part: usize| -> Result<i64> {
            let value = take(part)?.as_dtype(Dtype::Int64)?;
            value.eval()?;
            match value.shape() {
                [] => Ok(value.as_slice::<i64>()[0]),
                _ => Err(error(format!("tensor {i}.{part} is not a scalar"))),
            }
        };
        let [kv_heads, head_dim] = model_layer
            .head_shape()
            .unwrap_or([info.num_kv_heads as i32, info.head_dim as i32]);
        let expected = [
            1,
            kv_heads,
            keys.shape().get(2).copied().unwrap_or(0),
            head_dim,
        ];
        if keys.shape() != expected || values.shape() != expected {
            return Err(error(format!(
                "layer {i} has keys {:?} and values {:?}; the model needs [1, {kv_heads}, \
                 positions, {head_dim}]",
                keys.shape(),
                values.shape(),
            )));
        }
        let held = expected[2] as i64;
        // The offset, the buffer's positions in temporal order (as ranges of the buffer) and
        // how many they are.
        let (length, order, kept) = if classes[i].as_str() == CLASS {
            let length = scalar(2)?;
            if length < 0 || length > held {
                return Err(error(format!(
                    "layer {i} has offset {length}, more than its {held} positions"
                )));
            }
            (length, vec![(0, length)], length)
        } else {
            let (length, keep, max_size, idx) = (scalar(2)?, scalar(3)?, scalar(4)?, scalar(5)?);
            if length < 0 || keep < 0 || idx < keep || idx > held || max_size < 1 {
                return Err(error(format!(
                    "layer {i} is a {ROTATING_CLASS} with offset {length}, keep {keep}, \
                     max_size {max_size} and _idx {idx} over {held} positions: inconsistent"
                )));
            }
            let order = if idx == held {
                vec![(0, held)]
            } else if idx < length {
                vec![(0, keep), (idx, held), (keep, idx)]
            } else {
                vec![(0, idx)]
            };
            let kept: i64 = order.iter().map(|(a, b)| b - a).sum();
            if kept > length {
                return Err(error(format!(
                    "layer {i} holds {kept} positions after only {length} tokens"
                )));
            }
            if keep > 0 && kept < length {
                return Err(error(format!(
                    "layer {i} keeps its first {keep} positions apart from its last ones \
                     (mlx_lm's max_kv_size); Perch reads windows without kept positions only"
                )));
            }
            match window {
                Some(window) if window as i64 != max_size => {
                    return Err(error(format!(
                        "layer {i} has a window of {max_size} positions; the model's is {window}"
                    )));
                }
                _ => {}
            }
            (length, order, kept)
        };
        // Before any arithmetic on it: a file's offset is untrusted.
        if length >= info.context_length as i64 {
            return Err(error(format!(
                "it caches {length} positions, the model's context is {}",
                info.context_length
            )));
        }
        if *offset.get_or_insert(length) != length {
            return Err(error(format!(
                "layer {i} has offset {length}, unlike the layers before it"
            )));
        }
        let first = length - kept;
        // The next query (at `length`) must see every position its layer attends to.
        let needed = match window {
            Some(window) => (length + 1 - window as i64).max(0),
            None => 0,
        };
        if first > needed {
            return Err(error(format!(
                "layer {i} holds only its last {kept} of {length} positions; the model's \
                 layer attends to {}",
                match window {
                    Some(window) => format!("its last {window}"),
                    None => "all of them".into(),
                }
            )));
        }
        let mut cache = KvCache::new();
        cache.start_at(first as i32);
        if kept > 0 {
            let in_order = |a: &Array| -> Result<Array> {
                let pieces = order
                    .iter()
                    .filter(|(start, end)| end > start)
                    .map(|&(start, end)| {
                        crate::nn::mlx_ext::slice(
                            a,
                            &[0, 0, start as i32, 0],
                            &[1, expected[1], end as i32, expected[3]],
                        )
                    })
                    .collect::<std::result::Result<Vec<Array>, _>>()?;
                Ok(mlx_rs::ops::concatenate(&pieces, 2)?.as_dtype(dtype)?)
            };
            cache.update_and_fetch(&in_order(&keys)?, &in_order(&values)?)?;
        }
        layers.push(cache);
    }
    let offset = offset.unwrap_or(0) as usize;
    for (i, state) in states {
        layers[i].set_recurrent_state(state, offset as i32);
    }
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
    mlx_rs::transforms::eval(layers.iter().flat_map(KvCache::state))?;
    Ok(PromptCache {
        layers,
        offset,
        tokens,
        metadata,
    })
}
