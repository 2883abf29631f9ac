//! `perch search [TEXT]` and `perch pull ORG/NAME`: the Hugging Face Hub from the terminal.
//! Downloads go into the Hugging Face cache, where mlx-lm finds them too.

use std::io::Write;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use clap::Args;
use perch_hub::{group_memory_fit, memory_fit, HubClient, MemoryFit, SearchQuery, MLX_COMMUNITY};

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
    /// The KV cache budget the "fits" and "context" columns reckon with, in MiB.
    #[arg(long, default_value_t = 2048)]
    pub kv_cache_mib: u64,
    /// The hosts a model would be divided over (`perch serve --distributed … --hosts`, the
    /// same comma-separated list): "fits" judges each rank holding an even share of the
    /// weights and the KV budget, each machine what its ranks hold, the worst machine deciding
    /// (memory read here for `localhost` and `127.0.0.1`, over `ssh` elsewhere).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// The hosts of an mlx.launch hostfile instead (`perch serve --distributed … --hostfile`).
    #[arg(long, conflicts_with = "hosts")]
    pub hostfile: Option<std::path::PathBuf>,
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
    // Each machine's memory and ranks, when the model would be divided over several hosts (bad
    // hosts refused before the Hub is asked).
    let group = crate::launch::group_memory(crate::launch::GroupSpec::new(
        args.hostfile.as_deref(),
        &args.hosts,
    ))?;
    if let Some(least) = group.iter().map(|&(total, _)| total).min() {
        let machines = match group.len() {
            1 => "1 machine".to_owned(),
            n => format!("{n} machines"),
        };
        eprintln!(
            "fits: a model divided over {} ranks on {machines}, each rank holding an even share \
             of its weights and the KV budget (the least memory of them: {})",
            group.iter().map(|&(_, ranks)| ranks).sum::<usize>(),
            format_bytes(least)
        );
    }
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
    // Each runnable model's config, for its KV cache's real size (none for the others).
    let runnable = |m: &perch_hub::HubModel| {
        m.model_type
            .as_deref()
            .is_none_or(|t| perch_engine::models::unsupported_architecture_note(t).is_none())
    };
    let ids: Vec<String> = models
        .iter()
        .filter(|m| runnable(m))
        .map(|m| m.id.clone())
        .collect();
    let mut configs = client.config_texts(&ids).into_iter();
    println!(
        "{:<60} {:>9} {:>9} {:>9} {:>10}  ARCHITECTURE",
        "MODEL", "SIZE", "FITS", "CONTEXT", "DOWNLOADS"
    );
    let mut unsupported = false;
    for model in &models {
        let size = model.weights_bytes.map_or("?".to_owned(), format_bytes);
        // What the KV budget holds for this model (tokens of one conversation), and the bytes
        // of it that count against memory; the whole budget when the config is not known.
        let budget = runnable(model)
            .then(|| configs.next())
            .flatten()
            .and_then(|config| config.ok())
            .and_then(|text| perch_engine::models::kv_footprint(&text, None).ok())
            .map(|footprint| footprint.within_budget(kv_cache_bytes));
        let context = budget.map_or("?".to_owned(), |b| format_count(b.tokens));
        let kv_bytes = budget.map_or(kv_cache_bytes, |b| b.bytes);
        let fit = match group.is_empty() {
            true => memory_fit(model.weights_bytes, kv_bytes, total_memory),
            false => group_memory_fit(model.weights_bytes, kv_bytes, &group),
        };
        let fit = match fit {
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
            "{:<60} {size:>9} {fit:>9} {context:>9} {:>10}  {architecture}",
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

/// `n` with thousands separators (`131,072`).
fn format_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
