//! Where models live and which one is used when `--model` is not given.

use std::path::PathBuf;

use anyhow::{bail, Context};
use perch_engine::models;
use perch_engine::models::Model;
use perch_engine::Tokenizer;

pub use perch_hub::{models_dir, DEFAULT_MODEL_NAME};

/// `--model`, else `$PERCH_MODEL`, else the default model in [`models_dir`]. A model is a
/// directory, or a Hub repository id (`org/name`) found in the Hugging Face cache (as mlx-lm
/// resolves it; `perch pull` puts it there).
pub fn resolve(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let dir = model
        .or_else(|| std::env::var_os("PERCH_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| models_dir().join(DEFAULT_MODEL_NAME));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let repo_id = dir.to_string_lossy();
    if !dir.exists() && repo_id.matches('/').count() == 1 && !repo_id.starts_with(['/', '.']) {
        let cache = perch_hub::hf_cache_dir();
        if let Some(snapshot) = cache.and_then(|c| perch_hub::cached_snapshot(&c, &repo_id)) {
            return Ok(snapshot);
        }
        bail!("{repo_id} is not downloaded (not in the Hugging Face cache); run `perch pull {repo_id}`");
    }
    bail!(
        "no model at {} (expected config.json there); pass --model DIR or ORG/NAME, or run scripts/setup.sh to install the default model",
        dir.display()
    );
}

/// Loads model and tokenizer from a directory.
pub fn load(model: Option<PathBuf>) -> anyhow::Result<(Box<dyn Model>, Tokenizer)> {
    let dir = resolve(model)?;
    let tokenizer = Tokenizer::load(&dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let model =
        models::load(&dir).with_context(|| format!("loading the model in {}", dir.display()))?;
    Ok((model, tokenizer))
}
