//! The repository stands alone: no file in it reads the `shared/` folder our own machines keep
//! beside the checkout (a real model, references, notes), so a fresh clone with nothing beside it
//! passes the tests. And the test inputs are the ones the committed references were made on.

use std::path::{Path, PathBuf};

use perch_test_support::{fixture_json, sha256_file, workspace_dir};

/// What would make a test lean on `shared/`: its path beside the repository, its environment
/// variable, or its model and reference folders. Spelled in pieces, so this file does not match.
const FORBIDDEN: &[&str] = &[
    concat!("..", "/shared"),
    concat!("PERCH_", "SHARED_DIR"),
    concat!("shared", "/models"),
    concat!("shared", "/reference"),
    concat!("parent / \"", "shared"),
];

/// Build output and installed packages, not the repository's own files.
const SKIPPED_DIRS: &[&str] = &[".git", "target", "node_modules", "dist"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        let name = entry.file_name();
        if entry.file_type().unwrap().is_dir() {
            if !SKIPPED_DIRS.contains(&name.to_str().unwrap_or_default()) {
                files(&path, out);
            }
        } else {
            out.push(path);
        }
    }
}

#[test]
fn no_file_refers_to_the_shared_folder() {
    let root = workspace_dir();
    let mut all = Vec::new();
    files(&root, &mut all);
    assert!(
        all.len() > 100,
        "walked the repository: {} files",
        all.len()
    );
    let mut found = Vec::new();
    for path in &all {
        let Ok(text) = std::fs::read_to_string(path) else {
            continue; // binary
        };
        for (number, line) in text.lines().enumerate() {
            if let Some(needle) = FORBIDDEN.iter().find(|n| line.contains(*n)) {
                let relative = path.strip_prefix(&root).unwrap();
                found.push(format!("{}:{}: {needle}", relative.display(), number + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "these read the shared folder beside the checkout, which a user's clone lacks:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_test_model_is_the_one_the_references_were_made_on() {
    let model = sha256_file(&perch_test_support::model_dir().join("model.safetensors"));
    // Every fixture mlx_lm made on the test model.
    for name in MADE_ON_THE_TEST_MODEL {
        let fixture: serde_json::Value = fixture_json(name);
        assert_eq!(
            fixture["model_sha256"].as_str(),
            Some(model.as_str()),
            "the test model differs from the one tests/fixtures/{name} was made on: \
             remove target/test-inputs and run bash scripts/test-inputs.sh (or remake the fixture)"
        );
    }
    // And the import it was converted from is the committed import.
    let import: serde_json::Value = fixture_json("smollm2-import.json");
    let weights = import["files"]["model.safetensors"].as_str().unwrap();
    assert_eq!(
        sha256_file(&perch_test_support::imported_model_dir().join("model.safetensors")),
        weights
    );
}

/// The fixtures `scripts/make_references.py` made with mlx_lm on the test model.
const MADE_ON_THE_TEST_MODEL: [&str; 3] = [
    "smollm2-greedy.json",
    "smollm2-speculative.json",
    "smollm2-bounded.json",
];

#[test]
fn every_json_fixture_says_how_to_remake_it() {
    for name in MADE_ON_THE_TEST_MODEL.into_iter().chain([
        "smollm2-import.json",
        "mlx-community/SmolLM2-135M-Instruct-4bit/weights-sample.json",
    ]) {
        let text = std::fs::read_to_string(perch_test_support::fixture(name)).unwrap();
        assert!(
            text.trim_start().starts_with("{\n \"regenerate\": \""),
            "{name} starts with its regenerate command"
        );
    }
}
