//! The cache Perch writes is the one Python's `huggingface_hub` and mlx-lm read, and the other
//! way round: the test model (the default SmolLM2 in the layout `mlx_lm.convert` writes, from
//! `scripts/test-inputs.sh`), served by the fake hub.
//!
//! Needs the oracle Python (mlx-lm 0.32.2, and so `huggingface_hub`): `PERCH_TEST_PYTHON`, else
//! `target/oracle-venv`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;

use perch_hub::fake_hub::{FakeHub, FakeRepo};
use perch_hub::{HubClient, ModelSource};

const REPO: &str = "mlx-community/SmolLM2-135M-Instruct-4bit";

fn python(cache: &Path, envs: &[(&str, &str)], script: &str, args: &[&str]) -> String {
    let out = Command::new(perch_test_support::oracle_python())
        .arg("-c")
        .arg(script)
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .env("HF_HUB_DISABLE_XET", "1")
        .envs(envs.iter().copied())
        .output()
        .expect("run Python");
    assert!(
        out.status.success(),
        "Python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn fake_hub() -> FakeHub {
    let model = perch_test_support::model_dir();
    FakeHub::start(vec![
        FakeRepo::from_dir(REPO, &model).expect("read the test model")
    ])
}

#[test]
fn mlx_lm_runs_a_model_perch_downloaded() {
    let hub = fake_hub();
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());
    let snapshot = client.snapshot(REPO, "main").unwrap();
    client
        .download(&snapshot, &AtomicBool::new(false), &mut |_| {})
        .unwrap();

    // Offline, so mlx-lm can only use what is in the cache.
    let reference = perch_test_support::fixture("smollm2-greedy.json");
    let script = r#"
import json, sys
from mlx_lm import load, generate
reference = json.load(open(sys.argv[1]))
model, tokenizer = load(sys.argv[2])
case = reference["cases"][0]
text = generate(model, tokenizer, prompt=case["prompt_ids"], max_tokens=reference["max_tokens"])
print(json.dumps({"text": text, "expected": case["greedy_text"]}))
"#;
    let out = python(
        cache.path(),
        &[("HF_HUB_OFFLINE", "1")],
        script,
        &[reference.to_str().unwrap(), REPO],
    );
    let result: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        result["text"].as_str().is_some_and(|t| !t.is_empty()),
        "{out}"
    );
    assert_eq!(
        result["text"], result["expected"],
        "mlx-lm's greedy answer from Perch's download"
    );
}

#[test]
fn perch_finds_complete_what_huggingface_hub_downloaded() {
    let hub = fake_hub();
    let cache = tempfile::tempdir().unwrap();
    let script = r#"
import sys
from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
print(snapshot_download(sys.argv[1], allow_patterns=DEFAULT_ALLOW_PATTERNS))
"#;
    let printed = python(cache.path(), &[("HF_ENDPOINT", hub.url())], script, &[REPO]);
    let python_snapshot = PathBuf::from(printed.trim());

    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());
    let snapshot = client.snapshot(REPO, "main").unwrap();
    let before = hub.requests().len();
    let done = client
        .download(&snapshot, &AtomicBool::new(false), &mut |_| {})
        .unwrap();
    assert_eq!(
        done.snapshot_dir, python_snapshot,
        "the same snapshot directory"
    );
    assert_eq!(done.bytes_fetched, 0, "every blob Python fetched is reused");
    assert!(hub.requests()[before..]
        .iter()
        .all(|r| r.uri.starts_with("/api/")));

    let local = perch_hub::local_models(&cache.path().join("none"), Some(cache.path()));
    assert_eq!(local.len(), 1);
    assert_eq!(
        (local[0].name.as_str(), local[0].source),
        (REPO, ModelSource::HuggingFace)
    );
}

#[test]
fn the_searched_size_of_a_real_model_is_its_weights_file() {
    let hub = fake_hub();
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());
    let found = client.search(&perch_hub::SearchQuery::default()).unwrap();
    let weights = std::fs::read(perch_test_support::model_dir().join("model.safetensors")).unwrap();
    // The file is an 8-byte header length, the JSON header, then the tensors' bytes, no gaps.
    let header = u64::from_le_bytes(weights[..8].try_into().unwrap());
    let tensor_bytes = weights.len() as u64 - 8 - header;
    assert_eq!(
        found[0].weights_bytes,
        Some(tensor_bytes),
        "the size from the Hub's safetensors metadata is the tensors' bytes"
    );
}
