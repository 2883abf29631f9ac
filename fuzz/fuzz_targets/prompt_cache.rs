//! A prompt-cache file (`perch_engine::prompt_cache::load_prompt_cache`): the safetensors
//! check, MLX's reader, the metadata (model id, cache classes, tokens) and the per-layer shape
//! and offset checks, against a small model that only answers `info()` (all the loader asks of it).

#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx_rs::Array;
use perch_engine::kv::LayerCaches;
use perch_engine::models::{Model, ModelInfo, Output, Spliced};
use perch_engine::prompt_cache::load_prompt_cache;
use perch_engine::{EngineError, Result};

/// Two layers, one KV head of dimension 4, 16 tokens, a context of 64 (the seed corpus's files
/// are written for it).
#[derive(Clone)]
struct InfoOnly(ModelInfo);

impl Model for InfoOnly {
    fn forward(
        &self,
        _: &Array,
        _: Option<&Spliced>,
        _: &mut LayerCaches<'_>,
        _: Output,
    ) -> Result<Option<Array>> {
        Err(EngineError::Request("not a real model".into()))
    }
    fn clone_for_compile(&self) -> Box<dyn Model> {
        Box::new(self.clone())
    }
    fn info(&self) -> &ModelInfo {
        &self.0
    }
}

fuzz_target!(|data: &[u8]| {
    let model = InfoOnly(ModelInfo {
        model_type: "llama".into(),
        vocab_size: 16,
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 4,
        context_length: 64,
        hidden_size: 4,
        num_heads: 1,
        mlp_width: 4,
    });
    let path = perch_fuzz::scratch_file("cache.safetensors", data);
    if let Ok(cache) = load_prompt_cache(&path, &model, "model-a") {
        assert_eq!(cache.layers.len(), 2);
        assert!(cache.offset < 64);
    }
});
