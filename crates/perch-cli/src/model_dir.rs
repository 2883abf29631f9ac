//! Where models live and which one is used when `--model` is not given.

use std::path::PathBuf;

use anyhow::{bail, Context};
use perch_engine::models::{self, Model};
use perch_engine::Tokenizer;

pub use perch_hub::{models_dir, DEFAULT_MODEL_NAME};

/// `--model`, else `$PERCH_MODEL`, else the default model in [`models_dir`].
pub fn resolve(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let dir = model
        .or_else(|| std::env::var_os("PERCH_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| models_dir().join(DEFAULT_MODEL_NAME));
    if !dir.join("config.json").is_file() {
        bail!(
            "no model at {} (expected config.json there); pass --model DIR or run scripts/setup.sh to install the default model",
            dir.display()
        );
    }
    Ok(dir)
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
