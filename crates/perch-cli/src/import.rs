//! `perch import FILE.gguf [--out DIR]`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::model_dir;

#[derive(Args)]
pub struct ImportArgs {
    /// The GGUF file to convert.
    pub gguf: PathBuf,
    /// Output directory; default: the models directory, named after the file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: ImportArgs) -> anyhow::Result<()> {
    let out = match args.out {
        Some(out) => out,
        None => {
            let stem = args
                .gguf
                .file_stem()
                .map(|s| s.to_string_lossy().replace('.', "-"))
                .context("the GGUF path has no file name")?;
            model_dir::models_dir().join(stem)
        }
    };
    let summary = perch_gguf::import(&args.gguf, &out)
        .with_context(|| format!("importing {}", args.gguf.display()))?;
    println!("{}", out.display());
    let types: Vec<String> = summary
        .tensor_types
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    eprintln!(
        "imported a {} model: {} tensors ({}), {:.1} MB written",
        summary.architecture,
        summary.tensor_count,
        types.join(", "),
        summary.bytes_written as f64 / 1e6
    );
    Ok(())
}
