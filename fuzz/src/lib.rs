//! What each fuzz target feeds its input to, as plain functions: the cargo-fuzz binaries
//! (`fuzz_targets/`, libFuzzer) call them, and the test suite's corpus replay
//! (`tests/fuzz_corpus.rs`, which includes this file as a module) runs them in the ordinary test
//! build on the committed corpus and on mutations of it. A function returns normally for any
//! input; a panic or an abort is a bug.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlx_rs::Array;
use perch_engine::device::Backend;
use perch_engine::kv::LayerCaches;
use perch_engine::models::{Model, ModelInfo, Output, Spliced};
use perch_engine::nn::weights::{check_safetensors_header, Weights};
use perch_engine::prompt_cache::load_prompt_cache;
use perch_engine::text::chat_template::{ChatMessage, ChatTemplate, TEMPLATE_FUEL};
use perch_engine::{EngineError, Result};
use perch_gguf::GgufFile;

/// A fuzz target: the name of its binary and corpus directory (`fuzz/corpus/<name>`), and the
/// function that takes one input.
pub type Target = (&'static str, fn(&[u8]));

/// The targets.
pub const TARGETS: [Target; 5] = [
    ("chat_template", chat_template),
    ("config", config),
    ("gguf", gguf),
    ("prompt_cache", prompt_cache),
    ("safetensors_header", safetensors_header),
];

/// A directory for this process's scratch files (under `$TMPDIR`; scripts/fuzz.sh points that
/// at a directory it removes afterwards, since libFuzzer exits without running destructors).
pub fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        tempfile::Builder::new()
            .prefix("perch-fuzz-")
            .tempdir()
            .expect("create a scratch directory")
    })
    .path()
}

/// Writes `data` to `name` in the scratch directory and returns its path.
pub fn scratch_file(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch_dir().join(name);
    std::fs::write(&path, data).expect("write a scratch file");
    path
}

/// A chat template, a NUL byte, then the messages as JSON (two fixed messages when that part is
/// not a list of messages): `ChatTemplate::new` and `render`, and `render_with_tools` when the
/// template reads `tools`.
pub fn chat_template(data: &[u8]) {
    let (source, rest) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let source = String::from_utf8_lossy(source).into_owned();
    let messages: Vec<ChatMessage> = serde_json::from_slice(rest).unwrap_or_else(|_| {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi <b>there</b>"),
        ]
    });
    let Ok(mut template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))
    else {
        return;
    };
    // A twentieth of the app's fuel: the fuzz build (AddressSanitizer, coverage) runs some 30
    // times slower, and a template that loops until its fuel runs out should take about as long
    // (under a second) as in the app, not most of libFuzzer's 10 s timeout.
    template.set_fuel(TEMPLATE_FUEL / 20);
    let _ = template.render(&messages, true);
    if template.tool_call_format().is_some() {
        let tool = serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let _ = template.render_with_tools(&messages, Some(&[tool]), false);
    }
}

/// A model's `config.json`, checked for the architecture it names as a model load does before
/// reading weights (`perch_engine::models::check_config`).
pub fn config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = perch_engine::models::check_config(text);
    }
}

/// A GGUF file: opened, every tensor's bytes read, then imported into a scratch directory.
pub fn gguf(data: &[u8]) {
    let path = scratch_file("model.gguf", data);
    if let Ok(file) = GgufFile::open(&path) {
        let _ = file.architecture();
        for info in file.tensors() {
            let _ = (info.shape(), info.n_elements());
            if let Ok(bytes) = file.read_tensor_bytes(info) {
                assert_eq!(Some(bytes.len() as u64), info.n_bytes);
            }
        }
    }
    let out = scratch_dir().join("imported");
    let _ = perch_gguf::import(&path, &out);
    let _ = std::fs::remove_dir_all(&out);
}

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

/// A prompt-cache file, loaded against a model that only answers `info()`: two layers, one KV
/// head of dimension 4, 16 tokens, a context of 64 (the seed corpus's files are written for it).
pub fn prompt_cache(data: &[u8]) {
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
    let path = scratch_file("cache.safetensors", data);
    if let Ok(cache) = load_prompt_cache(&path, &model, "model-a") {
        assert_eq!(cache.layers.len(), 2);
        assert!(cache.offset < 64);
    }
}

/// A weight file: its safetensors header checked, and a file that passes loaded by MLX's reader
/// (`Weights::load`: cast, eval).
pub fn safetensors_header(data: &[u8]) {
    if check_safetensors_header(data).is_err() {
        return;
    }
    let dir = scratch_dir().join("model");
    std::fs::create_dir_all(&dir).expect("create the model directory");
    std::fs::write(dir.join("model.safetensors"), data).expect("write the weights");
    let _ = Weights::load(&dir, Backend::current());
}
