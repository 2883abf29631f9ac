//! Model architectures and the registry from `config.json`'s `model_type` to a loader.
//!
//! Each architecture file (`llama.rs`, `qwen2.rs`, `qwen3.rs`) reads its own tolerant config
//! struct and resolves it into the shared [`decoder::DecoderConfig`].

pub mod decoder;
pub mod gated_delta;
pub mod gemma3;
pub mod gemma4;
pub mod gemma4_vision;
pub mod gpt_oss;
pub mod llama;
pub mod ministral3;
pub mod moe;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen_vision;
pub mod vision;

use std::path::Path;

use mlx_rs::Array;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::attention::KvQuantization;
use crate::device::Backend;
use crate::distributed::{Division, Group, PipelineParallel, TensorParallel};
use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;
use crate::kv::slot_cache::SlotKvCache;
use crate::kv::LayerCaches;
use crate::nn::layers::{Quantization, Rope};
use crate::nn::weights::{weights_digest, LoadProgress, Weights};
use decoder::{Decoder, DecoderConfig};

/// `Ok` when a config size `value` is in `1..=max`; otherwise a sentence naming the field `name`.
pub(crate) fn within(name: &str, value: i32, max: i32) -> std::result::Result<(), String> {
    if (1..=max).contains(&value) {
        Ok(())
    } else {
        Err(format!("`{name}` must be between 1 and {max}, got {value}"))
    }
}

/// What callers need to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_type: String,
    pub vocab_size: usize,
    /// Layers with a cache of their own: every decoder layer, but those that read an earlier
    /// layer's keys and values (Gemma 4's KV-shared layers). Caches, slot caches and prompt-cache
    /// files have this many entries, as mlx_lm's `make_cache` does.
    pub num_layers: usize,
    /// KV heads and head size of the attention layers; where layers differ (Gemma 4's global
    /// layers), the first layer's, and each cache says its own ([`KvCache::head_shape`]).
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Longest sequence (prompt + generation) in tokens, from `max_position_embeddings`.
    pub context_length: usize,
    /// The residual stream's width and the attention layers' query heads (the first layer's,
    /// as `num_kv_heads`): with [`ModelInfo::mlp_width`], what a step's activations take
    /// ([`crate::memory::step_activation_bytes`]).
    pub hidden_size: usize,
    pub num_heads: usize,
    /// The widest feed-forward hidden of a token: the MLP's intermediate size or, in
    /// mixture-of-experts layers, its experts' (times the experts a token takes, plus the
    /// shared expert), whichever is larger.
    pub mlp_width: usize,
}

/// What a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Logits `[rows, tokens, vocab]`.
    Logits,
    /// Nothing: the pass only fills the caches (a prompt chunk whose logits nobody reads). On
    /// CPU Perch's quantized projections run eagerly (`crates/perch-qgemm`), so computing logits
    /// nobody reads would cost a `[tokens, vocab]` float32 array (400 MB for a 2,048-token chunk
    /// over a 49,152-token vocabulary) and its arithmetic; MLX's lazy graph skips them on other
    /// backends anyway.
    CacheOnly,
}

/// What a forward pass takes besides its token ids when a row's sequence holds images.
/// `features`: features fed in place of some tokens' embeddings (an image's, at its image
/// tokens, [`vision::VisionTower::embed`]): `[n]` int32 indices of the pass's tokens row-major
/// (`row · tokens + token`) and `[n, hidden]` values, what the embedding layer's output holds
/// there before the model's embedding scale; `None` when no token of the pass is an image's.
/// `rope_positions`: each token's multimodal RoPE position `[3, rows, tokens]` int32 (time, row,
/// column: Qwen's, [`qwen_vision::mrope_positions`]) for models that rotate by them; `None`: each
/// row's tokens at its own positions. `both_ways`: spans `(row, start, end)` of the pass's tokens
/// (offsets in their row) whose tokens attend to each other in both directions (Gemma 4's images
/// where its config says so, [`vision::VisionTower::attends_both_ways`]; see
/// [`SlotKvCache::begin_step_with`]); a span is whole in its pass.
#[derive(Default)]
pub struct Spliced {
    pub features: Option<(Array, Array)>,
    pub rope_positions: Option<Array>,
    pub both_ways: Vec<(usize, usize, usize)>,
}

/// A causal language model.
pub trait Model: Send {
    /// The forward pass, the only one: token ids `[rows, tokens]` → logits `[rows, tokens,
    /// vocab]` (`None` for [`Output::CacheOnly`]), each row's tokens appended to its caches in
    /// `caches` (one sequence's, or a batch's rows in slot caches: [`LayerCaches`], which
    /// decides positions and what attention reads). A row's real positions compute what its
    /// sequence computes alone, up to reduction order. Builds its graph from `ids`, the caches'
    /// arrays and the weights only, so that MLX can trace it ([`crate::worker::compiled`]).
    /// `spliced`: features that replace some tokens' embeddings (images', see [`Spliced`]).
    fn forward(
        &self,
        ids: &Array,
        spliced: Option<&Spliced>,
        caches: &mut LayerCaches<'_>,
        output: Output,
    ) -> Result<Option<Array>>;
    /// The vision tower of a vision-language model whose checkpoint has one.
    fn vision(&self) -> Option<&vision::VisionTower> {
        None
    }
    /// Why a vision-language checkpoint's tower was not loaded (the text model runs).
    fn vision_unavailable(&self) -> Option<&str> {
        None
    }
    /// A copy sharing this model's weights (MLX arrays are reference-counted) whose forward
    /// passes MLX can trace (every product through MLX's operations, none read on the host):
    /// what a compiled step owns.
    fn clone_for_compile(&self) -> Box<dyn Model>;
    fn info(&self) -> &ModelInfo;
    /// Keeps only rank `tp.rank()`'s part of every block of a tensor-parallel group
    /// ([`TensorParallel`]): its share of the attention heads (and so of the KV caches, which
    /// [`Model::make_cache`] then shapes) and of the feed-forward features. Every rank runs the
    /// same passes on the same tokens and gets the whole model's logits. Embeddings, norms and
    /// the LM head stay whole. Errors, leaving the model as it was, for layers not divided yet
    /// and for heads or features that do not divide by the ranks.
    fn shard(&mut self, _tp: &TensorParallel) -> Result<()> {
        Err(EngineError::Distributed(format!(
            "`{}` models are not divided over ranks",
            self.info().model_type
        )))
    }
    /// Keeps only rank `pp.rank()`'s stage of a pipeline-parallel group ([`PipelineParallel`]):
    /// its run of layers ([`PipelineParallel::layers`]) and their caches, which
    /// [`Model::make_cache`] then makes ([`ModelInfo::num_layers`] becomes the stage's count).
    /// Every rank runs the same passes on the same tokens and gets the whole model's logits.
    /// Embeddings, the final norm and the LM head stay on every rank. Errors, leaving the model
    /// as it was, where layers cannot be split.
    fn pipeline(&mut self, _pp: &PipelineParallel) -> Result<()> {
        Err(EngineError::Distributed(format!(
            "`{}` models are not split into stages",
            self.info().model_type
        )))
    }
    /// The group this model is divided over ([`Model::shard`], [`Model::pipeline`]), once divided.
    fn division(&self) -> Option<&Division> {
        None
    }
    /// Whether some layers keep a recurrent state instead of keys and values (linear
    /// attention: [`KvCache::recurrent`]); their prefix cache keeps states at block boundaries
    /// (`crate::kv::block_store`).
    fn has_recurrent_layers(&self) -> bool {
        false
    }
    /// Runs linear-attention layers' per-token recurrence through MLX's compiler, or not (the
    /// default depends on the backend: compiled on GPUs). No effect on other models.
    fn compile_recurrence(&mut self, _on: bool) {}
    /// Whether some layers attend within a sliding window (Gemma 3, gpt-oss): their caches keep
    /// about a window of positions (see [`KvCache::with_window`] and the slot caches' rings).
    fn has_sliding_window_layers(&self) -> bool {
        false
    }
    /// An empty cache, one entry per KV cache layer ([`ModelInfo::num_layers`]), float or
    /// quantized, each knowing its layer's head shape.
    fn make_cache(&self, quantization: Option<KvQuantization>) -> Vec<KvCache> {
        let info = self.info();
        (0..info.num_layers)
            .map(|_| {
                KvCache::with_quantization(quantization)
                    .with_head_shape(info.num_kv_heads as i32, info.head_dim as i32)
            })
            .collect()
    }
}

impl dyn Model + '_ {
    /// [`Model::forward`] over one sequence's caches (one per layer): ids `[1, seq]` → logits
    /// `[1, seq, vocab]`.
    pub fn forward_sequence(&self, ids: &Array, cache: &mut [KvCache]) -> Result<Array> {
        let logits = self.forward(ids, None, &mut LayerCaches::Sequence(cache), Output::Logits)?;
        Ok(logits.expect("logits were asked for"))
    }

    /// [`Model::forward`] over one sequence's caches for a prompt chunk whose logits are never
    /// read: fills the caches only ([`Output::CacheOnly`]).
    pub fn prefill_sequence(&self, ids: &Array, cache: &mut [KvCache]) -> Result<()> {
        self.forward(
            ids,
            None,
            &mut LayerCaches::Sequence(cache),
            Output::CacheOnly,
        )
        .map(drop)
    }

    /// One step of every sequence in `slots` ([`SlotKvCache`]): token ids `[rows, tokens]`, row
    /// `r` the tokens the sequence in slot `r` feeds, its first `new_tokens[r]` real and the rest
    /// padding (as are padding rows: any ids) → logits `[rows, tokens, vocab]`; slot `r` holds
    /// `new_tokens[r]` more positions afterwards. A decode step feeds one token per row, a
    /// prefill step a prompt chunk.
    pub fn forward_slots(
        &self,
        ids: &Array,
        slots: &mut SlotKvCache,
        new_tokens: &[usize],
    ) -> Result<Array> {
        self.forward_slots_spliced(ids, None, slots, new_tokens)
    }

    /// [`forward_slots`](Self::forward_slots) with some tokens' embeddings replaced ([`Spliced`]).
    pub fn forward_slots_spliced(
        &self,
        ids: &Array,
        spliced: Option<&Spliced>,
        slots: &mut SlotKvCache,
        new_tokens: &[usize],
    ) -> Result<Array> {
        let both_ways = spliced.map_or(&[][..], |s| &s.both_ways[..]);
        let step = slots.begin_step_with(ids.shape()[1] as usize, new_tokens, both_ways)?;
        let logits = self.forward(
            ids,
            spliced,
            &mut LayerCaches::Slots {
                cache: slots,
                step: &step,
            },
            Output::Logits,
        )?;
        slots.end_step(new_tokens)?;
        Ok(logits.expect("logits were asked for"))
    }
}

/// Everything an architecture loader gets. Its weights may be none (see [`check_config`]): a
/// loader reads only the config, and may rename or drop tensors a checkpoint holds beside the
/// text model's.
pub struct LoadContext<'a> {
    pub config: &'a Value,
    pub config_path: &'a Path,
    pub weights: &'a mut Weights,
}

/// What a loader makes of its config: the shared decoder's config and RoPE, and the model type
/// the model reports.
pub struct Resolved {
    pub config: DecoderConfig,
    pub rope: Rope,
    pub model_type: String,
    /// A vision-language checkpoint's vision tower, or why it was not loaded (the text model
    /// still runs; requests with images are refused with the reason).
    pub vision: Option<std::result::Result<vision::VisionTower, String>>,
}

impl LoadContext<'_> {
    /// Deserializes the architecture's own config struct, naming the file on error.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        // The error names the field (`mlp_only_layers: invalid type: …`).
        serde_path_to_error::deserialize(self.config).map_err(|e| self.error(e.to_string()))
    }

    /// Deserializes a part of the config (`name`, e.g. `text_config`), naming the file and the
    /// field on error.
    pub fn parse_value<T: DeserializeOwned>(&self, value: &Value, name: &str) -> Result<T> {
        serde_path_to_error::deserialize(value).map_err(|e| self.error(format!("{name}: {e}")))
    }

    pub fn error(&self, message: String) -> EngineError {
        EngineError::Config {
            path: self.config_path.to_path_buf(),
            message,
        }
    }

    /// The shared decoder's config and RoPE (whose error, from [`Rope::new`], names this
    /// config file): what [`load`] builds the model from.
    pub fn decoder(
        self,
        config: DecoderConfig,
        rope: std::result::Result<Rope, String>,
        model_type: &str,
    ) -> Result<Resolved> {
        let rope = rope.map_err(|m| self.error(m))?;
        Ok(Resolved {
            config,
            rope,
            model_type: model_type.to_string(),
            vision: None,
        })
    }
}

type Loader = fn(LoadContext<'_>) -> Result<Resolved>;

/// The text model's config of a Gemma multimodal checkpoint (mlx_lm's `gemma3.ModelArgs`,
/// `gemma4.ModelArgs`): `text_config` (absent: all defaults) with the top level's `vocab_size`
/// (default `vocab`) in place of its own, and the head counts `heads` (query, KV) where it has
/// none.
pub(crate) fn gemma_text_config(
    cx: &LoadContext<'_>,
    vocab: i64,
    heads: [i64; 2],
) -> Result<Value> {
    let mut text = match cx.config.get("text_config") {
        None => Value::Object(Default::default()),
        Some(text @ Value::Object(_)) => text.clone(),
        Some(_) => return Err(cx.error("`text_config` must be an object".into())),
    };
    let fields = text.as_object_mut().expect("an object");
    let vocab = cx
        .config
        .get("vocab_size")
        .cloned()
        .unwrap_or(Value::from(vocab));
    fields.insert("vocab_size".into(), vocab);
    for (name, default) in ["num_attention_heads", "num_key_value_heads"]
        .iter()
        .zip(heads)
    {
        fields
            .entry(name.to_string())
            .or_insert(Value::from(default));
    }
    Ok(text)
}

/// `model_type` → loader. Aliases share a loader.
const ARCHITECTURES: &[(&str, Loader)] = &[
    ("gemma3", gemma3::load),
    ("gemma3_text", gemma3::load),
    ("gemma4", gemma4::load),
    ("gemma4_text", gemma4::load),
    ("gemma4_unified", gemma4::load),
    ("gpt_oss", gpt_oss::load),
    ("llama", llama::load),
    ("ministral3", ministral3::load),
    ("mistral", llama::load),
    ("mistral3", ministral3::load_mistral3),
    ("olmo2", llama::load_olmo2),
    ("phi3", phi3::load),
    ("qwen2", qwen2::load),
    ("qwen3", qwen3::load),
    ("qwen3_5", qwen3_5::load),
    ("qwen3_5_moe", qwen3_5::load),
    ("qwen3_moe", qwen3_moe::load),
    ("smollm3", llama::load_smollm3),
];

/// The `model_type`s Perch can load.
pub fn supported_architectures() -> Vec<&'static str> {
    ARCHITECTURES.iter().map(|(name, _)| *name).collect()
}

/// `None` when a model of `model_type` (its `config.json`'s, as the Hub reports it too) loads;
/// otherwise a sentence naming it and the architectures that do, for the model picker and
/// `perch search` to show before anything is downloaded.
pub fn unsupported_architecture_note(model_type: &str) -> Option<String> {
    if ARCHITECTURES.iter().any(|(name, _)| *name == model_type) {
        return None;
    }
    Some(format!(
        "{model_type} is not supported yet (Perch runs {})",
        supported_architectures().join(", ")
    ))
}

/// Whether the model in `model_dir`, whose `config.json` is `config`, takes images: an
/// architecture whose vision tower Perch runs ([`vision`]: Gemma 3's `gemma3`, Qwen3.5's
/// `qwen3_5` and `qwen3_5_moe`) with its `vision_config` and the tower's weights (text-only
/// conversions keep the config but drop the tower; read from the weight index or the files'
/// headers, nothing loaded) and, for Qwen, an unscaled RoPE. For the model picker, before anything is loaded (a tower that then
/// fails to load leaves a text model).
pub fn takes_images(config: &Value, model_dir: &Path) -> bool {
    let tower_weights: &[&str] = match config.get("model_type").and_then(Value::as_str) {
        Some("gemma3") => &["vision_tower.vision_model.embeddings.patch_embedding.weight"],
        // A Qwen checkpoint that scales its RoPE refuses images ([`qwen3_5`]).
        Some("qwen3_5" | "qwen3_5_moe") if qwen3_5::scales_rope(config) => return false,
        Some("qwen3_5" | "qwen3_5_moe") => &["vision_tower.patch_embed.proj.weight"],
        Some("gemma4") => &[
            "vision_tower.patch_embedder.input_proj.weight",
            "model.vision_tower.patch_embedder.input_proj.weight",
        ],
        _ => return false,
    };
    config.get("vision_config").is_some_and(Value::is_object)
        && tower_weights
            .iter()
            .any(|name| crate::nn::weights::has_tensor(model_dir, name))
}

/// Loads the model in `model_dir` (mlx-community layout: `config.json` + `*.safetensors`).
///
/// Floating-point weights are cast for the backend: float32 on CPU; on GPU float32 becomes
/// bfloat16 (MLX's CUDA quantized matmul is inaccurate with float32 activations).
///
/// Errors: missing/invalid config ([`EngineError::Io`], [`EngineError::Config`]), unknown
/// `model_type` ([`EngineError::UnsupportedArchitecture`]), damaged weights, missing tensors or
/// shapes that disagree with the config. Weights are evaluated here, so a load that returns `Ok`
/// has read every byte.
pub fn load(model_dir: &Path) -> Result<Box<dyn Model>> {
    load_with_progress(model_dir, &mut |_| {})
}

/// [`load`], reporting the weights read as they are ([`Weights::load_with_progress`]).
pub fn load_with_progress(
    model_dir: &Path,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Box<dyn Model>> {
    load_part(model_dir, None, progress)
}

/// [`load`] of this rank's part of the model alone (`division`: [`Model::shard`]'s or
/// [`Model::pipeline`]'s), reading the weights as the layers take them
/// ([`Weights::load_lazily`]): another stage's layers are never read, and a layer divided by
/// heads is whole in memory only while it is divided. The same model as loading it whole and
/// dividing it after.
///
/// Every rank must hold the same model: before any weight is read, the ranks compare their
/// copies ([`same_model_on_every_rank`]) and all refuse alike when they differ. After loading,
/// the ranks meet again ([`every_rank_loaded`]): a rank that failed to load fails every rank
/// alike, and none starts computing before the slowest has its part. Where the ranks meet, each
/// waits for the others at most [`crate::distributed::load_limit`] (a rank stuck loading, or
/// gone, would otherwise hold the others for ever): past it the waiting rank ends
/// ([`crate::distributed::Watchdog::waiting_while_loading`]).
pub fn load_divided(model_dir: &Path, division: &Division) -> Result<Box<dyn Model>> {
    let group = division.group();
    let meeting = || {
        crate::distributed::Watchdog::waiting_while_loading(
            group.rank(),
            crate::distributed::load_limit(),
        )
    };
    {
        let _meeting = meeting();
        same_model_on_every_rank(model_dir, group)?;
    }
    let loaded = load_part(model_dir, Some(division), &mut |_| {});
    let _meeting = meeting();
    every_rank_loaded(group, loaded)
}

/// The ranks' meeting after each loaded its part: `loaded` when every rank's load succeeded;
/// this rank's own error when it failed; else an error naming the ranks that failed (each
/// reports its own).
fn every_rank_loaded(group: &Group, loaded: Result<Box<dyn Model>>) -> Result<Box<dyn Model>> {
    let all = group.all_gather_bytes(&[u8::from(loaded.is_ok())])?;
    let model = loaded?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 0).collect();
    match failed.is_empty() {
        true => Ok(model),
        false => Err(EngineError::Distributed(format!(
            "{} could not load its part of the model (its own error says why)",
            ranks(&failed)
        ))),
    }
}

/// The files besides `config.json` that decide what a rank feeds the model and when it stops:
/// the tokenizer, its chat template and the generation defaults.
const TOKENIZER_FILES: [&str; 6] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// This rank's copy of the model in `model_dir`, as [`same_model_on_every_rank`] compares it:
/// SHA-256 digests of its `config.json`, of its weight files ([`weights_digest`]) and of its
/// [`TOKENIZER_FILES`] (each one's name, and its bytes or that it is absent).
fn model_digest(model_dir: &Path) -> Result<[u8; 96]> {
    use sha2::{Digest, Sha256};
    let config = crate::limits::read_text_capped(
        &model_dir.join("config.json"),
        crate::limits::MAX_CONFIG_BYTES,
    )?;
    let mut tokenizer = Sha256::new();
    for name in TOKENIZER_FILES {
        let path = model_dir.join(name);
        tokenizer.update(name.as_bytes());
        if path.exists() {
            tokenizer.update([1]);
            tokenizer.update(crate::limits::read_capped(
                &path,
                crate::limits::MAX_TOKENIZER_JSON_BYTES,
            )?);
        } else {
            tokenizer.update([0]);
        }
    }
    let mut digest = [0u8; 96];
    digest[..32].copy_from_slice(&Sha256::digest(config.as_bytes()));
    digest[32..64].copy_from_slice(&weights_digest(model_dir)?);
    digest[64..].copy_from_slice(&tokenizer.finalize());
    Ok(digest)
}

/// Refuses a group whose ranks hold different models (which would compute wrong tokens
/// together, or fail mid-request on mismatched shapes), before any weight is read: each rank's
/// [`model_digest`] goes to every rank (`all_gather`), so all of them refuse alike rather than
/// some loading and then waiting on peers that gave up. A rank that cannot read its copy
/// returns its own error; the others name it.
fn same_model_on_every_rank(model_dir: &Path, group: &Group) -> Result<()> {
    let mine = model_digest(model_dir);
    // A readable copy's flag, then its digest (zeros when it could not be read).
    let mut sent = [0u8; 97];
    if let Ok(digest) = &mine {
        sent[0] = 1;
        sent[1..].copy_from_slice(digest);
    }
    let all = group.all_gather_bytes(&sent)?;
    mine?;
    let unreadable: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] == 0).collect();
    if !unreadable.is_empty() {
        return Err(EngineError::Distributed(format!(
            "{} could not read its copy of the model (its own error says why)",
            ranks(&unreadable)
        )));
    }
    let differs = |part: std::ops::Range<usize>| -> Vec<usize> {
        (1..all.len())
            .filter(|&r| all[r][part.clone()] != all[0][part.clone()])
            .collect()
    };
    let (config, weights, tokenizer) = (differs(1..33), differs(33..65), differs(65..97));
    let mut reasons = Vec::new();
    if !config.is_empty() {
        reasons.push(format!(
            "the config.json of {} differs from rank 0's",
            ranks(&config)
        ));
    }
    if !weights.is_empty() {
        reasons.push(format!(
            "the weight files of {} differ from rank 0's (their tensors' names, types or \
             shapes, or their data)",
            ranks(&weights)
        ));
    }
    if !tokenizer.is_empty() {
        reasons.push(format!(
            "the tokenizer files of {} differ from rank 0's (tokenizer, chat template or \
             generation defaults)",
            ranks(&tokenizer)
        ));
    }
    match reasons.is_empty() {
        true => Ok(()),
        false => Err(EngineError::Distributed(format!(
            "the ranks hold different models: {}; every host needs the same model files",
            reasons.join(", and ")
        ))),
    }
}

/// "rank 1", "ranks 1 and 3", "ranks 1, 2 and 3".
fn ranks(list: &[usize]) -> String {
    match list {
        [one] => format!("rank {one}"),
        [rest @ .., last] => {
            let rest: Vec<String> = rest.iter().map(usize::to_string).collect();
            format!("ranks {} and {last}", rest.join(", "))
        }
        [] => "no rank".to_owned(),
    }
}

/// [`load_with_progress`], or [`load_divided`] with `division` (no progress then).
fn load_part(
    model_dir: &Path,
    division: Option<&Division>,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Box<dyn Model>> {
    let config_path = model_dir.join("config.json");
    let config = read_config(&config_path)?;
    let (model_type, loader, quantization) = resolve_config(&config, &config_path)?;
    let mut weights = match division {
        None => Weights::load_with_progress(model_dir, Backend::current(), progress)?,
        Some(division) => {
            Weights::load_lazily(model_dir, Backend::current(), 1.0 / division.size() as f64)?
        }
    };
    let resolved = loader(LoadContext {
        config: &config,
        config_path: &config_path,
        weights: &mut weights,
    })?;
    let model: Box<dyn Model> = Box::new(
        Decoder::load_divided(
            resolved.config,
            resolved.rope,
            &quantization,
            &mut weights,
            &resolved.model_type,
            division,
        )?
        .with_vision(resolved.vision),
    );
    // Like mlx-lm's strict load: tensors nobody used mean the config does not describe these weights.
    let unused = weights.remaining();
    if !unused.is_empty() {
        let shown: Vec<&str> = unused.iter().take(5).map(String::as_str).collect();
        return Err(EngineError::Config {
            path: config_path,
            message: format!(
                "{} weight(s) are not part of a `{model_type}` model with this config, e.g. {}",
                unused.len(),
                shown.join(", ")
            ),
        });
    }
    Ok(model)
}

/// The loader for `config`'s `model_type`, and its quantization: what [`load`] needs from the
/// config before it reads the weights.
fn resolve_config(config: &Value, config_path: &Path) -> Result<(String, Loader, Quantization)> {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| EngineError::Config {
            path: config_path.to_path_buf(),
            message: "missing `model_type`".into(),
        })?
        .to_string();
    let loader = ARCHITECTURES
        .iter()
        .find(|(name, _)| *name == model_type)
        .map(|(_, loader)| *loader)
        .ok_or_else(|| EngineError::UnsupportedArchitecture {
            found: model_type.clone(),
            supported: supported_architectures().join(", "),
        })?;
    let quantization =
        Quantization::from_config(config).map_err(|message| EngineError::Config {
            path: config_path.to_path_buf(),
            message,
        })?;
    Ok((model_type, loader, quantization))
}

/// Checks the text of a `config.json` as [`load`] does before it builds anything: JSON, a
/// supported `model_type`, the `quantization` section, then the architecture's own fields,
/// parsed and validated by that architecture's loader ([`DecoderConfig::validate`], RoPE
/// scaling). Nothing is sized from the config and no weight is read. Returns the `model_type`.
///
/// Errors: [`EngineError::Config`] (naming `config.json`), [`EngineError::UnsupportedArchitecture`].
pub fn check_config(text: &str) -> Result<String> {
    resolve_text(text).map(|(model_type, _)| model_type)
}

/// [`check_config`]'s work: the `model_type` and what its loader resolves.
fn resolve_text(text: &str) -> Result<(String, Resolved)> {
    let config_path = Path::new("config.json");
    let config: Value = serde_json::from_str(text).map_err(|e| EngineError::Config {
        path: config_path.to_path_buf(),
        message: e.to_string(),
    })?;
    let (model_type, loader, _) = resolve_config(&config, config_path)?;
    let mut no_weights = Weights::empty(Backend::current());
    let resolved = loader(LoadContext {
        config: &config,
        config_path,
        weights: &mut no_weights,
    })?;
    Ok((model_type, resolved))
}

/// How much KV cache one sequence of a model takes, from its `config.json` alone (before any
/// weight is downloaded): bytes per position of each cache layer in the compute dtype of this
/// backend (float32 on CPU, 16-bit on GPUs) or, with `kv_quantization`, packed. KV-shared
/// layers take nothing, linear-attention layers a constant recurrent state. The per-token sum
/// equals [`crate::engine::batch::kv_bytes_per_token`] of the loaded model (tested against it): Gemma
/// 4's global layers with their own head size, GQA, KV-shared and hybrid layers all counted as
/// the engine counts them.
///
/// Errors: those of [`check_config`].
pub fn kv_footprint(
    config_text: &str,
    kv_quantization: Option<KvQuantization>,
) -> Result<KvFootprint> {
    let (_, resolved) = resolve_text(config_text)?;
    let c = &resolved.config;
    let dtype_bytes = match Backend::current().compute_dtype(mlx_rs::Dtype::Float32) {
        mlx_rs::Dtype::Float32 => 4,
        _ => 2,
    };
    let mut layers = Vec::new();
    let mut state_bytes = 0u64;
    for i in 0..c.num_layers {
        if c.is_linear_layer(i) {
            if let Some(linear) = &c.linear_attention {
                let [conv, ssm] = linear.layer.state_shapes();
                let count = |shape: &[i32]| shape.iter().map(|&d| d.max(0) as u64).product::<u64>();
                // The convolution's state in the compute dtype, the recurrence's in float32.
                state_bytes += count(&conv) * dtype_bytes as u64 + count(&ssm) * 4;
            }
            continue;
        }
        if let Some((head_shape, window)) = c.cache_layer(i) {
            let [kv_heads, head_dim] = head_shape.map(|d| d.max(0) as usize);
            let per_vector = match kv_quantization {
                None => head_dim * dtype_bytes,
                Some(q) => q.bytes_per_vector(head_dim, dtype_bytes),
            };
            layers.push(KvLayerCost {
                bytes_per_position: (2 * kv_heads * per_vector) as u64,
                window: window.map(|w| w.max(1) as u64),
            });
        }
    }
    Ok(KvFootprint {
        layers,
        state_bytes,
        context_length: c.context_length as u64,
    })
}

/// One cache layer's share of [`KvFootprint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvLayerCost {
    /// Keys and values of one position.
    pub bytes_per_position: u64,
    /// A sliding layer's window (its own cache drops positions before it).
    pub window: Option<u64>,
}

/// The KV cache of one sequence of a model, by cache layer (see [`kv_footprint`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvFootprint {
    /// One per cache layer, in the order of [`Model::make_cache`]'s attention layers.
    pub layers: Vec<KvLayerCost>,
    /// Linear-attention layers' recurrent states of one sequence: the same at every length.
    pub state_bytes: u64,
    /// The longest sequence the model takes (`max_position_embeddings`).
    pub context_length: u64,
}

impl KvFootprint {
    /// Bytes each position takes in every cache layer (a sliding layer's own cache drops what
    /// its window left: see [`KvFootprint::within_budget`] for what the engine counts).
    pub fn bytes_per_token(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes_per_position).sum()
    }

    /// What a KV budget of `budget` bytes means for this model in the engine: the longest
    /// conversation it holds (at most [`KvFootprint::context_length`]; 0 when not even the
    /// recurrent states fit) as the engine splits the budget ([`perch_sched::budget::KvBudget`]:
    /// sliding layers cost a window per sequence, not every position), and the bytes that
    /// takes (the budget, or less when the model's whole context in every layer needs less).
    pub fn within_budget(&self, budget: u64) -> BudgetUse {
        let per_token = self.bytes_per_token().max(1);
        let bytes = |sliding: bool| -> usize {
            self.layers
                .iter()
                .filter(|l| l.window.is_some() == sliding)
                .map(|l| l.bytes_per_position as usize)
                .sum()
        };
        let window = self.layers.iter().filter_map(|l| l.window).max();
        let split = perch_sched::budget::KvBudget::split(
            usize::try_from(budget.saturating_sub(self.state_bytes)).unwrap_or(usize::MAX),
            bytes(false),
            bytes(true),
            window.map(|w| w as usize),
            self.state_bytes > 0,
        );
        let tokens = (split.max_tokens() as u64).min(self.context_length);
        let whole_context = self
            .state_bytes
            .saturating_add(per_token.saturating_mul(self.context_length));
        BudgetUse {
            tokens: if budget < self.state_bytes { 0 } else { tokens },
            bytes: budget.min(whole_context),
        }
    }
}

/// See [`KvFootprint::within_budget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BudgetUse {
    /// Tokens of one conversation the budget holds.
    pub tokens: u64,
    /// Bytes of the budget those take at most.
    pub bytes: u64,
}

/// Serde default for config flags that default to on (`tie_word_embeddings`).
pub(crate) fn default_true() -> bool {
    true
}

/// Reads and parses `config.json`.
pub fn read_config(path: &Path) -> Result<Value> {
    let text = crate::limits::read_text_capped(path, crate::limits::MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text).map_err(|e| EngineError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_are_named_as_a_list() {
        assert_eq!(ranks(&[1]), "rank 1");
        assert_eq!(ranks(&[1, 3]), "ranks 1 and 3");
        assert_eq!(ranks(&[1, 2, 3]), "ranks 1, 2 and 3");
    }

    /// SmolLM2-135M-Instruct's config (the test model's), as mlx-community writes it.
    const SMOLLM2: &str = r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0, "rope_scaling": null, "tie_word_embeddings": true,
        "vocab_size": 49152, "quantization": {"group_size": 32, "bits": 4, "mode": "affine"}}"#;

    fn with(field: &str, value: Value) -> String {
        let mut config: Value = serde_json::from_str(SMOLLM2).unwrap();
        config[field] = value;
        config.to_string()
    }

    #[test]
    fn unsupported_architectures_are_named_with_the_supported_ones() {
        assert_eq!(unsupported_architecture_note("qwen3"), None);
        assert_eq!(unsupported_architecture_note("llama"), None);
        assert_eq!(unsupported_architecture_note("gemma3"), None);
        let note = unsupported_architecture_note("mamba").unwrap();
        assert!(note.starts_with("mamba is not supported yet"), "{note}");
        for name in supported_architectures() {
            assert!(note.contains(name), "{note}");
        }
    }

    #[test]
    fn check_config_accepts_a_real_config_and_names_what_is_wrong() {
        assert_eq!(check_config(SMOLLM2).unwrap(), "llama");
        for (text, expected) in [
            ("{".to_string(), "EOF"),
            ("{}".to_string(), "missing `model_type`"),
            (with("num_hidden_layers", 0.into()), "`num_hidden_layers`"),
            (
                with("num_key_value_heads", 2.into()),
                "multiple of `num_key_value_heads`",
            ),
            (with("hidden_size", "576".into()), "invalid type"),
            (
                with("quantization", serde_json::json!({"bits": 7})),
                "bits=7",
            ),
            (
                with("rope_scaling", serde_json::json!({"type": "dynamic"})),
                "rope_scaling type `dynamic` is not supported",
            ),
            (
                with("rope_scaling", serde_json::json!({"type": "yarn"})),
                "`yarn` needs a numeric `factor`",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            check_config(&with("model_type", "gpt2".into())),
            Err(EngineError::UnsupportedArchitecture { .. })
        ));
    }

    /// google/gemma-3-1b-it's config.json (Hugging Face, 2025), as mlx-community copies it.
    const GEMMA3_1B: &str = r#"{"architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": [1, 106],
        "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
        "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": null,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "vocab_size": 262144,
        "quantization": {"group_size": 64, "bits": 4}}"#;

    /// The multimodal layout (google/gemma-3-4b-it's text_config, abridged as the Hub has it:
    /// most fields left to their defaults).
    const GEMMA3_4B: &str = r#"{"architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3", "boi_token_index": 255999, "eoi_token_index": 256000,
        "image_token_index": 262144, "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
            "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}"#;

    #[test]
    fn gemma3_configs_are_checked_field_by_field() {
        assert_eq!(check_config(GEMMA3_1B).unwrap(), "gemma3_text");
        assert_eq!(check_config(GEMMA3_4B).unwrap(), "gemma3");
        let text = |field: &str, value: Value| {
            let mut config: Value = serde_json::from_str(GEMMA3_1B).unwrap();
            config[field] = value;
            config.to_string()
        };
        let nested = |field: &str, value: Value| {
            let mut config: Value = serde_json::from_str(GEMMA3_4B).unwrap();
            config["text_config"][field] = value;
            config.to_string()
        };
        for (text, expected) in [
            (
                text("query_pre_attn_scalar", 0.into()),
                "`query_pre_attn_scalar`",
            ),
            (text("sliding_window", 0.into()), "`sliding_window`"),
            (
                text("sliding_window_pattern", (-6).into()),
                "`sliding_window_pattern`",
            ),
            (
                text("rope_local_base_freq", (-1.0).into()),
                "`rope_local_base_freq`",
            ),
            (text("hidden_size", 0.into()), "`hidden_size`"),
            (
                text(
                    "rope_scaling",
                    serde_json::json!({"rope_type": "yarn", "factor": -2.0}),
                ),
                "`yarn` needs a positive `factor`",
            ),
            (
                nested("num_key_value_heads", 3.into()),
                "multiple of `num_key_value_heads`",
            ),
            (
                serde_json::json!({"model_type": "gemma3", "text_config": [1]}).to_string(),
                "`text_config` must be an object",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// Gemma 4 E2B's config as Google publishes it (text model nested, every field set), and
    /// 26B-A4B's text model.
    fn gemma4(text_changes: Value) -> String {
        let layer_types: Vec<&str> = (0..35)
            .map(|i| {
                if i % 5 == 4 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        let mut config = serde_json::json!({"model_type": "gemma4",
            "architectures": ["Gemma4ForConditionalGeneration"],
            "text_config": {"model_type": "gemma4_text", "hidden_size": 1536,
                "num_hidden_layers": 35, "intermediate_size": 6144, "num_attention_heads": 8,
                "num_key_value_heads": 1, "num_global_key_value_heads": null, "head_dim": 256,
                "global_head_dim": 512, "num_kv_shared_layers": 20,
                "hidden_size_per_layer_input": 256, "vocab_size": 262144,
                "vocab_size_per_layer_input": 262144, "sliding_window": 512,
                "layer_types": layer_types, "attention_k_eq_v": false,
                "use_double_wide_mlp": true, "enable_moe_block": false, "num_experts": null,
                "top_k_experts": null, "moe_intermediate_size": null,
                "final_logit_softcapping": 30.0, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-06, "tie_word_embeddings": true,
                "rope_parameters": {
                    "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                        "rope_type": "proportional"},
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}},
            "vision_config": {"model_type": "gemma4_vision"}});
        for (key, value) in text_changes.as_object().unwrap() {
            config["text_config"][key] = value.clone();
        }
        config.to_string()
    }

    /// The fit estimate's numbers for Gemma 4 E2B (15 cache layers for 35 layers: 12 sliding of
    /// one 256-wide KV head, 3 global of one 512-wide head) and for a budget.
    #[test]
    fn kv_footprint_of_gemma4_e2b_and_a_budget() {
        let f = kv_footprint(&gemma4(serde_json::json!({})), None).unwrap();
        assert_eq!(f.layers.len(), 15);
        let dtype = match Backend::current().compute_dtype(mlx_rs::Dtype::Float32) {
            mlx_rs::Dtype::Float32 => 4,
            _ => 2,
        };
        let sliding = f.layers.iter().filter(|l| l.window == Some(512)).count();
        assert_eq!(sliding, 12);
        assert_eq!(f.bytes_per_token(), (12 * 2 * 256 + 3 * 2 * 512) * dtype);
        assert_eq!(f.context_length, 131_072);
        let per_token = f.bytes_per_token();
        // Within what a sequence's sliding layers hold (512 + a 2,048-token chunk + 256), a
        // token costs every layer.
        let budget = 1000 * per_token + 7;
        assert_eq!(
            f.within_budget(budget),
            BudgetUse {
                tokens: 1000,
                bytes: budget
            }
        );
        // Past it, the 3 global layers only.
        let (global, window) = (3 * 2 * 512 * dtype, 512 + 2048 + 256);
        let budget = window * per_token + 10_000 * global;
        assert_eq!(f.within_budget(budget).tokens, window + 10_000);
        // A budget past the whole context is not all needed.
        let whole = per_token * 131_072;
        assert_eq!(
            f.within_budget(whole * 2),
            BudgetUse {
                tokens: 131_072,
                bytes: whole
            }
        );
        // 8-bit KV: packed values plus a scale and bias per group of 64.
        let q = KvQuantization::new(8, 64, 256).unwrap();
        let packed = kv_footprint(&gemma4(serde_json::json!({})), Some(q)).unwrap();
        assert!(packed.bytes_per_token() < per_token);
    }

    #[test]
    fn gemma4_configs_are_checked_field_by_field() {
        assert_eq!(
            check_config(&gemma4(serde_json::json!({}))).unwrap(),
            "gemma4"
        );
        let layer_types: Vec<&str> = (0..30)
            .map(|i| {
                if i % 6 == 5 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        let moe = serde_json::json!({"model_type": "gemma4_text", "hidden_size": 2816,
            "num_hidden_layers": 30, "intermediate_size": 2112, "num_attention_heads": 16,
            "num_key_value_heads": 8, "num_global_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "attention_k_eq_v": true, "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0, "enable_moe_block": true, "num_experts": 128,
            "top_k_experts": 8, "moe_intermediate_size": 704, "sliding_window": 1024,
            "layer_types": layer_types, "max_position_embeddings": 262144});
        assert_eq!(check_config(&moe.to_string()).unwrap(), "gemma4_text");
        for (changes, expected) in [
            (
                serde_json::json!({"num_kv_shared_layers": 35}),
                "`num_kv_shared_layers`",
            ),
            (
                // Only the last layer is global, and it shares: no earlier global layer.
                serde_json::json!({"num_hidden_layers": 3, "num_kv_shared_layers": 1,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
                "layer 2 shares the keys and values of an earlier layer of its kind",
            ),
            (
                serde_json::json!({"vocab_size_per_layer_input": 1000}),
                "`vocab_size_per_layer_input` (1000) is below the vocabulary",
            ),
            (
                serde_json::json!({"global_head_dim": 511}),
                "global layers' 1 KV heads of 511",
            ),
            (
                serde_json::json!({"layer_types": ["chunked_attention"]}),
                "`layer_types` lists",
            ),
            (
                serde_json::json!({"layer_types": ["sliding_attention"]}),
                "the sliding-window layer list has 1 entries for 35 layers",
            ),
            (
                serde_json::json!({"rope_parameters": {"full_attention": {"rope_type": "proportional",
                    "partial_rotary_factor": 1.5}}}),
                "`partial_rotary_factor` must be between 0 and 1",
            ),
            (
                serde_json::json!({"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}}),
                "RoPE type `yarn` is not supported",
            ),
            (
                serde_json::json!({"rope_parameters": {"full_attention": {"rope_theta": -1}}}),
                "`rope_theta` must be a positive number",
            ),
            (
                serde_json::json!({"enable_moe_block": true}),
                "`enable_moe_block` needs `num_experts`",
            ),
            (
                serde_json::json!({"final_logit_softcapping": 0.0}),
                "`final_logit_softcapping` must be a positive number",
            ),
            (
                serde_json::json!({"hidden_size_per_layer_input": -4}),
                "`hidden_size_per_layer_input`",
            ),
            (
                serde_json::json!({"num_hidden_layers": "35"}),
                "text_config: num_hidden_layers",
            ),
        ] {
            let text = gemma4(changes.clone());
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{changes}: {e}")
                }
                other => panic!("{changes}: {other:?}"),
            }
        }
    }

    #[test]
    fn gpt_oss_configs_are_checked_field_by_field() {
        let config = |changes: Value| {
            let mut config: Value = serde_json::from_str(
                &std::fs::read_to_string(
                    Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("../../fuzz/corpus/config/gpt_oss.json"),
                )
                .unwrap(),
            )
            .unwrap();
            for (key, value) in changes.as_object().unwrap() {
                config[key] = value.clone();
            }
            config.to_string()
        };
        assert_eq!(
            check_config(&config(serde_json::json!({}))).unwrap(),
            "gpt_oss"
        );
        for (changes, expected) in [
            (
                serde_json::json!({"num_experts_per_tok": 40}),
                "`num_experts_per_tok` must be between 1 and 32",
            ),
            (
                serde_json::json!({"layer_types": ["sliding_attention"]}),
                "the sliding-window layer list has 1 entries for 24 layers",
            ),
            (
                serde_json::json!({"rope_scaling": {"rope_type": "yarn"}}),
                "`yarn` needs a numeric `factor`",
            ),
            (
                serde_json::json!({"rope_theta": 0}),
                "`rope_theta` must be a positive number",
            ),
            (serde_json::json!({"sliding_window": 0}), "`sliding_window`"),
        ] {
            let text = config(changes.clone());
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{changes}: {e}")
                }
                other => panic!("{changes}: {other:?}"),
            }
        }
    }

    /// A Phi-3.5-mini-shaped config (LongRoPE over 96-feature heads: 48 factors each) and
    /// Phi-4-mini's shape (GQA, RoPE on 0.75 of 128-feature heads: 48 factors again).
    fn phi3(changes: Value) -> String {
        let factors: Vec<f64> = (0..48).map(|i| 1.0 + i as f64 * 0.5).collect();
        let mut config = serde_json::json!({"architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
            "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": 32064,
            "rope_scaling": {"type": "longrope", "long_factor": factors,
                "short_factor": factors}, "tie_word_embeddings": false});
        for (key, value) in changes.as_object().unwrap() {
            config[key] = value.clone();
        }
        config.to_string()
    }

    #[test]
    fn phi3_configs_are_checked_field_by_field() {
        assert_eq!(check_config(&phi3(serde_json::json!({}))).unwrap(), "phi3");
        let phi4_mini = serde_json::json!({"num_attention_heads": 24, "num_key_value_heads": 8,
            "partial_rotary_factor": 0.75, "vocab_size": 200064, "tie_word_embeddings": true});
        assert_eq!(check_config(&phi3(phi4_mini)).unwrap(), "phi3");
        let few: Vec<f64> = vec![1.0; 47];
        for (text, expected) in [
            (
                phi3(serde_json::json!({"rope_scaling": {"type": "longrope", "long_factor": few}})),
                "`long_factor` has 47 values; RoPE over 96 features needs 48",
            ),
            (
                phi3(serde_json::json!({"rope_scaling": {"long_factor": [1.0]}})),
                "must contain `long_factor` and `type`",
            ),
            (
                phi3(serde_json::json!({"rope_scaling": {"type": "su", "long_factor": [0.0]}})),
                "must be positive",
            ),
            (
                phi3(serde_json::json!({"partial_rotary_factor": 0.0})),
                "`partial_rotary_factor`",
            ),
            (
                phi3(serde_json::json!({"num_attention_heads": 7})),
                "multiple of `num_attention_heads`",
            ),
            (
                phi3(serde_json::json!({"original_max_position_embeddings": 0})),
                "`original_max_position_embeddings`",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// mlx-community/Qwen3-30B-A3B-4bit's config.json (the router gates kept at 8 bits).
    const QWEN3_30B_A3B: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": false, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": false, "quantization": {"group_size": 64, "bits": 4,
        "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}, "rms_norm_eps": 1e-06,
        "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}"#;

    #[test]
    fn qwen3_moe_configs_are_checked_field_by_field() {
        assert_eq!(check_config(QWEN3_30B_A3B).unwrap(), "qwen3_moe");
        let with = |field: &str, value: Value| {
            let mut config: Value = serde_json::from_str(QWEN3_30B_A3B).unwrap();
            config[field] = value;
            config.to_string()
        };
        for (text, expected) in [
            (with("num_experts", 0.into()), "`num_experts`"),
            (with("num_experts", 100_000.into()), "`num_experts`"),
            (
                with("num_experts_per_tok", 129.into()),
                "`num_experts_per_tok`",
            ),
            (
                with("moe_intermediate_size", (-1).into()),
                "`moe_intermediate_size`",
            ),
            (
                with("decoder_sparse_step", 0.into()),
                "`decoder_sparse_step`",
            ),
            (
                with("mlp_only_layers", "all".into()),
                "mlp_only_layers: invalid type",
            ),
            (
                with("norm_topk_prob", Value::Null),
                "norm_topk_prob: invalid type",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// Qwen3.5's layout: the text model's fields nested in `text_config`.
    fn qwen3_5(text: Value) -> String {
        let mut base = serde_json::json!({"hidden_size": 64, "num_hidden_layers": 4,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 100, "max_position_embeddings": 512,
            "head_dim": 32, "full_attention_interval": 2, "linear_num_value_heads": 4,
            "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e5,
                "partial_rotary_factor": 0.25}});
        for (key, value) in text.as_object().unwrap() {
            base[key] = value.clone();
        }
        serde_json::json!({"model_type": "qwen3_5", "text_config": base}).to_string()
    }

    #[test]
    fn qwen3_5_configs_are_checked_field_by_field() {
        assert_eq!(
            check_config(&qwen3_5(serde_json::json!({}))).unwrap(),
            "qwen3_5"
        );
        // The mixture-of-experts variant, nested or (as mlx_lm also reads it) at the top level.
        let moe = serde_json::json!({"num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512});
        let mut nested: Value = serde_json::from_str(&qwen3_5(moe)).unwrap();
        nested["model_type"] = "qwen3_5_moe".into();
        assert_eq!(check_config(&nested.to_string()).unwrap(), "qwen3_5_moe");
        let mut flat = nested["text_config"].clone();
        flat["model_type"] = "qwen3_5_moe".into();
        assert_eq!(check_config(&flat.to_string()).unwrap(), "qwen3_5_moe");
        for (text, expected) in [
            (
                qwen3_5(serde_json::json!({"linear_num_key_heads": 3})),
                "multiple of `linear_num_key_heads`",
            ),
            (
                qwen3_5(serde_json::json!({"linear_conv_kernel_dim": 0})),
                "`linear_conv_kernel_dim`",
            ),
            (
                qwen3_5(serde_json::json!({"full_attention_interval": 0})),
                "`full_attention_interval`",
            ),
            (
                qwen3_5(serde_json::json!({"num_experts": 8})),
                "`num_experts_per_tok` must be between 1 and 8, got 0",
            ),
            (
                qwen3_5(
                    serde_json::json!({"num_experts": 8, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32}),
                ),
                "`shared_expert_intermediate_size`",
            ),
            (
                qwen3_5(serde_json::json!({"num_experts": "8"})),
                "num_experts: invalid type",
            ),
            (
                qwen3_5(serde_json::json!({"rope_parameters": {"partial_rotary_factor": 2.0}})),
                "`partial_rotary_factor`",
            ),
            (
                qwen3_5(serde_json::json!({"head_dim": 6})),
                "RoPE covers 1 features",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    /// Shaped like allenai/OLMo-2-0425-1B's config.json (fields abridged).
    const OLMO2_1B: &str = r#"{"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2",
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 500000, "rope_scaling": null, "max_position_embeddings": 4096,
        "attention_bias": false, "tie_word_embeddings": false, "vocab_size": 100352}"#;

    /// Shaped like mistralai/Ministral-3-3B-Instruct-2512's config.json: the text model nested
    /// in `text_config`, YaRN and Llama 4 scaling in `rope_parameters`, a vision tower's config.
    const MINISTRAL3_3B: &str = r#"{"architectures": ["Mistral3ForConditionalGeneration"],
        "model_type": "mistral3", "image_token_index": 10,
        "text_config": {"model_type": "ministral3", "hidden_size": 3072,
            "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
            "vocab_size": 131072, "max_position_embeddings": 262144, "sliding_window": null,
            "tie_word_embeddings": true,
            "rope_parameters": {"rope_type": "yarn", "type": "yarn", "rope_theta": 1000000.0,
                "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1}},
        "vision_config": {"model_type": "pixtral", "hidden_size": 1024}}"#;

    #[test]
    fn smollm3_config_errors_name_the_field() {
        let config = |extra: Value| {
            let mut config = serde_json::json!({"model_type": "smollm3", "hidden_size": 2048,
                "num_hidden_layers": 4, "intermediate_size": 11008, "num_attention_heads": 16,
                "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "vocab_size": 128256});
            for (key, value) in extra.as_object().unwrap() {
                config[key] = value.clone();
            }
            config.to_string()
        };
        assert_eq!(
            check_config(&config(serde_json::json!({}))).unwrap(),
            "smollm3"
        );
        for (extra, expected) in [
            (serde_json::json!({"hidden_size": "2048"}), "hidden_size"),
            (
                serde_json::json!({"no_rope_layers": "all"}),
                "no_rope_layers",
            ),
            (
                serde_json::json!({"no_rope_layers": [1, 0]}),
                "2 entries for 4 layers",
            ),
            (
                serde_json::json!({"no_rope_layer_interval": 0}),
                "at least 1",
            ),
        ] {
            let err = check_config(&config(extra.clone()))
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{extra}: {err}");
        }
    }

    #[test]
    fn olmo2_and_mistral3_configs_are_checked() {
        assert_eq!(check_config(OLMO2_1B).unwrap(), "olmo2");
        assert_eq!(check_config(MINISTRAL3_3B).unwrap(), "mistral3");
        let ministral: Value = serde_json::from_str(MINISTRAL3_3B).unwrap();
        // The text model alone, as `ministral3`.
        assert_eq!(
            check_config(&ministral["text_config"].to_string()).unwrap(),
            "ministral3"
        );
        // Mistral Small 3.1's layout: a Llama (`mistral`) text model.
        let small = serde_json::json!({"model_type": "mistral3", "text_config": {
            "model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": 131072,
            "rope_theta": 1e9, "max_position_embeddings": 131072}});
        assert_eq!(check_config(&small.to_string()).unwrap(), "mistral3");
        let text = |key: &str, value: Value| {
            let mut config = ministral.clone();
            config["text_config"][key] = value;
            config.to_string()
        };
        let rope = |key: &str, value: Value| {
            let mut config = ministral.clone();
            config["text_config"]["rope_parameters"][key] = value;
            config.to_string()
        };
        let layers = |types: Value, window: Value| {
            let mut config = ministral.clone();
            config["text_config"]["num_hidden_layers"] = 2.into();
            config["text_config"]["layer_types"] = types;
            config["text_config"]["sliding_window"] = window;
            config.to_string()
        };
        for (text, expected) in [
            (
                serde_json::json!({"model_type": "mistral3"}).to_string(),
                "`text_config` must be an object",
            ),
            (text("model_type", "mistral4".into()), "`mistral4`"),
            (
                text("hidden_size", "3072".into()),
                "text_config: hidden_size",
            ),
            (
                rope("llama_4_scaling_beta", Value::Null),
                "`llama_4_scaling_beta`",
            ),
            (
                rope("factor", Value::Null),
                "`yarn` needs a numeric `factor`",
            ),
            (rope("type", "dynamic".into()), "`dynamic` is not supported"),
            (
                rope("original_max_position_embeddings", 0.into()),
                "`original_max_position_embeddings` of at least 1",
            ),
            (
                layers(serde_json::json!(["full_attention", "chunked"]), 8.into()),
                "`layer_types` lists `chunked`",
            ),
            (
                layers(
                    serde_json::json!(["full_attention", "sliding_attention"]),
                    Value::Null,
                ),
                "need a `sliding_window`",
            ),
            (
                layers(serde_json::json!(["sliding_attention"]), 8.into()),
                "sliding-window layer list has 1 entries for 2 layers",
            ),
            (
                {
                    let mut olmo: Value = serde_json::from_str(OLMO2_1B).unwrap();
                    olmo["num_key_value_heads"] = 3.into();
                    olmo.to_string()
                },
                "multiple of `num_key_value_heads`",
            ),
        ] {
            match check_config(&text) {
                Err(e @ EngineError::Config { .. }) => {
                    assert!(e.to_string().contains(expected), "{text}: {e}")
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }
}
