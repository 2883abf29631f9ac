//! Shared test fixtures: the project's `shared/` directory (real model, reference outputs).
#![allow(dead_code)]

use std::path::PathBuf;

/// `../shared` beside the repository, or `PERCH_SHARED_DIR`.
pub fn shared_dir() -> PathBuf {
    let dir = std::env::var_os("PERCH_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    assert!(dir.join("models").is_dir(), "shared/ not found at {} (set PERCH_SHARED_DIR)", dir.display());
    dir
}

pub fn smollm_dir() -> PathBuf {
    shared_dir().join("models/SmolLM2-135M-Instruct-4bit")
}

/// One case of `reference/smollm2-135m-4bit-greedy.json`.
#[derive(serde::Deserialize, Clone)]
pub struct ReferenceCase {
    pub id: String,
    pub messages: Option<Vec<perch_engine::ChatMessage>>,
    pub text: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
}

pub fn reference_cases() -> Vec<ReferenceCase> {
    #[derive(serde::Deserialize)]
    struct File {
        max_tokens: usize,
        cases: Vec<ReferenceCase>,
    }
    let path = shared_dir().join("reference/smollm2-135m-4bit-greedy.json");
    let file: File = serde_json::from_str(&std::fs::read_to_string(&path).expect("reference file")).expect("reference json");
    assert_eq!(file.max_tokens, 32);
    file.cases
}
