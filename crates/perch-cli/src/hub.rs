//! `perch search [TEXT]` and `perch pull ORG/NAME`: the Hugging Face Hub from the terminal.
//! Downloads go into the Hugging Face cache, where mlx-lm finds them too.

use std::io::Write;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use clap::Args;
use perch_hub::{memory_fit, HubClient, MemoryFit, SearchQuery, MLX_COMMUNITY};

#[derive(Args)]
pub struct SearchArgs {
    /// Words to find in the repository id; none lists the most downloaded.
    #[arg(default_value = "")]
    pub text: String,
    /// Only this user's or organisation's models.
    #[arg(long, default_value = MLX_COMMUNITY)]
    pub author: String,
    /// Search every author's models.
    #[arg(long, conflicts_with = "author")]
    pub all: bool,
    /// At most this many results.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// The KV cache budget the "fits" column reserves, in MiB.
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_mib: u64,
}

#[derive(Args)]
pub struct PullArgs {
    /// The repository, e.g. mlx-community/Qwen3-0.6B-4bit.
    pub repo: String,
    /// Branch, tag or commit.
    #[arg(long, default_value = "main")]
    pub revision: String,
}

fn client() -> anyhow::Result<HubClient> {
    let cache = perch_hub::hf_cache_dir()
        .context("no Hugging Face cache directory: set HF_HUB_CACHE or HOME")?;
    Ok(HubClient::from_env(cache))
}

pub fn search(args: SearchArgs) -> anyhow::Result<()> {
    let query = SearchQuery {
        text: args.text,
        author: (!args.all).then_some(args.author),
        limit: args.limit,
    };
    let client = client()?;
    let models = client
        .search(&query)
        .with_context(|| format!("searching {}", client.endpoint()))?;
    let total_memory = perch_hub::total_memory_bytes();
    let kv_cache_bytes = args.kv_cache_mib << 20;
    println!(
        "{:<60} {:>9} {:>9} {:>10}  ARCHITECTURE",
        "MODEL", "SIZE", "FITS", "DOWNLOADS"
    );
    let mut unsupported = false;
    for model in &models {
        let size = model.weights_bytes.map_or("?".to_owned(), format_bytes);
        let fit = match memory_fit(model.weights_bytes, kv_cache_bytes, total_memory) {
            MemoryFit::Fits => "yes",
            MemoryFit::Tight => "tight",
            MemoryFit::TooLarge => "no",
            MemoryFit::Unknown => "?",
        };
        let architecture = match model.model_type.as_deref() {
            None => "?".to_owned(),
            Some(model_type) => {
                match perch_engine::models::unsupported_architecture_note(model_type) {
                    None => model_type.to_owned(),
                    Some(_) => {
                        unsupported = true;
                        format!("{model_type} (not supported yet)")
                    }
                }
            }
        };
        println!(
            "{:<60} {size:>9} {fit:>9} {:>10}  {architecture}",
            model.id, model.downloads
        );
    }
    if unsupported {
        eprintln!(
            "Perch runs these architectures: {}",
            perch_engine::models::supported_architectures().join(", ")
        );
    }
    if models.is_empty() {
        eprintln!("no models found");
    }
    Ok(())
}

pub fn pull(args: PullArgs) -> anyhow::Result<()> {
    let client = client()?;
    let snapshot = client
        .snapshot(&args.repo, &args.revision)
        .with_context(|| format!("listing {} at {}", args.repo, args.revision))?;
    let mut stderr = std::io::stderr();
    let done = client
        .download(&snapshot, &AtomicBool::new(false), &mut |p| {
            let _ = write!(
                stderr,
                "\r{} / {} ({}/{} files) {:<40}",
                format_bytes(p.bytes_done),
                format_bytes(p.bytes_total),
                p.files_done,
                p.files_total,
                p.file
            );
        })
        .with_context(|| format!("downloading {}", args.repo))?;
    eprintln!(
        "\n{}: {} fetched, {} already here",
        args.repo,
        format_bytes(done.bytes_fetched),
        format_bytes(done.bytes_reused)
    );
    println!("{}", done.snapshot_dir.display());
    Ok(())
}

/// Decimal units, as the Hub shows sizes.
fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
