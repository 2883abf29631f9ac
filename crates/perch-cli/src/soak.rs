//! `perch soak`: minutes of mixed traffic through the engine (concurrent streams, cancels,
//! prompts that share a prefix, long prompts), printing memory and the KV pool every report
//! interval, to show that memory stays flat once warm and what the KV cache really takes against
//! its budget. A benchmark for `scripts/soak.sh`, not a test of speed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use perch_engine::device::memory_stats;
use perch_engine::{
    EngineConfig, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenerateRequest, Prompt,
    Tokenizer,
};

use crate::model_dir;

#[derive(Args)]
pub struct SoakArgs {
    /// Model directory or downloaded Hub id; default: the model installed by setup.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// How long to run, in minutes.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seconds between reports.
    #[arg(long, default_value_t = 60.0)]
    pub report_every_s: f64,
    /// Client threads, each with one request in the engine at a time.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The engine's KV cache budget in MiB (default: the engine's).
    #[arg(long)]
    pub kv_cache_mib: Option<usize>,
    /// Longest prompt, in tokens (the long prompts are 60–100% of it).
    #[arg(long, default_value_t = 1536)]
    pub long_prompt_tokens: usize,
    /// Seeds the traffic's choices (prompt kinds, lengths, cancels).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// SplitMix64: the traffic only needs reproducible variety.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `lo..hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo).max(1) as u64) as usize
    }
}

const WORDS: &[&str] = &[
    "the",
    "model",
    "reads",
    "a",
    "long",
    "letter",
    "about",
    "rivers",
    "and",
    "mountains",
    "while",
    "engineers",
    "measure",
    "memory",
    "in",
    "small",
    "steps",
    "every",
    "minute",
    "of",
    "quiet",
    "traffic",
    "cache",
    "blocks",
    "return",
    "to",
    "pool",
    "when",
    "requests",
    "end",
    "or",
    "stop",
];

/// About `tokens` tokens of word salad from `rng`.
fn text_tokens(tokenizer: &Tokenizer, rng: &mut Rng, tokens: usize) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::with_capacity(tokens + 8);
    while ids.len() < tokens {
        let words: Vec<&str> = (0..64).map(|_| WORDS[rng.range(0, WORDS.len())]).collect();
        ids.extend(tokenizer.encode(&words.join(" "), false)?);
    }
    ids.truncate(tokens);
    Ok(ids)
}

#[derive(Default)]
struct Counters {
    finished: AtomicU64,
    cancelled: AtomicU64,
    errors: AtomicU64,
    generated: AtomicU64,
}

/// One memory reading.
#[derive(Clone, Copy)]
struct Reading {
    active: usize,
    peak: usize,
    cache: usize,
    rss: Option<u64>,
}

fn reading() -> Reading {
    let m = memory_stats();
    Reading {
        active: m.active_bytes,
        peak: m.peak_bytes,
        cache: m.cache_bytes,
        rss: resident_bytes(),
    }
}

/// This process's resident set (`sysinfo`).
fn resident_bytes() -> Option<u64> {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate, System};
    let pid = sysinfo::get_current_pid().ok()?;
    let mut system = System::new();
    system.refresh_processes_specifics(
        ProcessesToUpdate::Some(&[pid]),
        false,
        ProcessRefreshKind::nothing().with_memory(),
    );
    system.process(pid).map(|p| p.memory())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(
        args.minutes > 0.0 && args.report_every_s > 0.0,
        "--minutes and --report-every-s must be positive"
    );
    let dir = model_dir::resolve(args.model.clone())?;
    let mut config = EngineConfig {
        max_running: args.concurrency,
        ..EngineConfig::default()
    };
    if let Some(mib) = args.kv_cache_mib {
        config.kv_cache_bytes = mib << 20;
    }
    let budget = config.kv_cache_bytes;
    let engine = EngineHandle::load(&dir, config)?;
    let loaded = reading();
    let limits = engine.limits();
    let long = args
        .long_prompt_tokens
        .min(limits.max_prompt_tokens(64) / 2)
        .max(64);
    let mut rng = Rng(args.seed);
    let shared_prefix = Arc::new(text_tokens(engine.tokenizer(), &mut rng, 256)?);
    println!(
        "soak: {} for {} min, {} streams; KV budget {:.0} MiB ({} tokens), long prompts up to {long} tokens; weights and buffers after load: {:.0} MiB",
        dir.display(),
        args.minutes,
        args.concurrency,
        mib(budget as u64),
        limits.kv_cache_tokens,
        mib(loaded.active as u64),
    );
    println!(
        "{:>6} {:>8} {:>9} {:>6} {:>9} {:>10} {:>9} {:>9} {:>8} {:>14} {:>12}",
        "min",
        "finished",
        "cancelled",
        "errors",
        "gen tok/s",
        "MLX active",
        "MLX peak",
        "MLX cache",
        "RSS",
        "KV blocks used",
        "prefix cache"
    );

    let counters = Arc::new(Counters::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..args.concurrency)
        .map(|client| {
            let (engine, counters, stop, shared_prefix) = (
                engine.clone(),
                Arc::clone(&counters),
                Arc::clone(&stop),
                Arc::clone(&shared_prefix),
            );
            let mut rng = Rng(args.seed ^ (client as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
            std::thread::spawn(move || -> anyhow::Result<()> {
                while !stop.load(Ordering::Relaxed) {
                    client_request(&engine, &counters, &mut rng, &shared_prefix, long)?;
                }
                Ok(())
            })
        })
        .collect();

    let started = Instant::now();
    let every = Duration::from_secs_f64(args.report_every_s);
    let end = started + Duration::from_secs_f64(args.minutes * 60.0);
    let mut readings = Vec::new();
    let mut last_generated = 0;
    let mut last_report = started;
    while Instant::now() < end {
        std::thread::sleep(every.min(end.saturating_duration_since(Instant::now())));
        let now = Instant::now();
        let generated = counters.generated.load(Ordering::Relaxed);
        let rate = (generated - last_generated) as f64 / (now - last_report).as_secs_f64();
        (last_generated, last_report) = (generated, now);
        let r = reading();
        let kv = engine.stats()?.kv_cache;
        println!(
            "{:>6.1} {:>8} {:>9} {:>6} {:>9.1} {:>6.0} MiB {:>5.0} MiB {:>5.0} MiB {:>4} MiB {:>6}/{:<7} {:>8.0} MiB",
            (now - started).as_secs_f64() / 60.0,
            counters.finished.load(Ordering::Relaxed),
            counters.cancelled.load(Ordering::Relaxed),
            counters.errors.load(Ordering::Relaxed),
            rate,
            mib(r.active as u64),
            mib(r.peak as u64),
            mib(r.cache as u64),
            r.rss.map_or("?".into(), |b| format!("{:.0}", mib(b))),
            kv.blocks_used,
            kv.blocks_total,
            mib(kv.prefix_cache_bytes as u64),
        );
        readings.push(r);
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    // Each client ends the request it had when time ran out: these are all of them.
    println!(
        "requests: {} finished, {} cancelled, {} errors",
        counters.finished.load(Ordering::Relaxed),
        counters.cancelled.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
    );

    // Flatness: the run's second half (the prefix cache fills its share of the pool in the
    // first); the KV bound: the peak above what the model held after loading, against the
    // budget.
    let peak = readings.iter().map(|r| r.peak).max().unwrap_or(loaded.peak);
    println!(
        "KV and activations at peak: {:.0} MiB above the model ({:.2}x the {:.0} MiB KV budget)",
        mib(peak.saturating_sub(loaded.active) as u64),
        peak.saturating_sub(loaded.active) as f64 / budget as f64,
        mib(budget as u64),
    );
    if let (Some(warm), Some(last)) = (readings.get(readings.len() / 2), readings.last()) {
        let growth = |a: u64, b: u64| (b as f64 - a as f64) / a.max(1) as f64 * 100.0;
        println!(
            "second half: MLX active {:.0} -> {:.0} MiB ({:+.1}%), RSS {} -> {} MiB ({})",
            mib(warm.active as u64),
            mib(last.active as u64),
            growth(warm.active as u64, last.active as u64),
            warm.rss.map_or("?".into(), |b| format!("{:.0}", mib(b))),
            last.rss.map_or("?".into(), |b| format!("{:.0}", mib(b))),
            match (warm.rss, last.rss) {
                (Some(a), Some(b)) => format!("{:+.1}%", growth(a, b)),
                _ => "?".into(),
            },
        );
    }
    let errors = counters.errors.load(Ordering::Relaxed);
    anyhow::ensure!(errors == 0, "{errors} requests ended with an error");
    engine.shutdown();
    Ok(())
}

/// One request of a random kind, cancelled partway one time in four.
fn client_request(
    engine: &EngineHandle,
    counters: &Counters,
    rng: &mut Rng,
    shared_prefix: &[u32],
    long: usize,
) -> anyhow::Result<()> {
    let tokenizer = engine.tokenizer();
    // (tokens of text, tokens to generate); chat-like requests go after the shared prefix.
    let (shared, length, max_tokens) = match rng.range(0, 10) {
        // A chat-like request after the shared system prompt.
        0..=4 => (true, rng.range(16, 96), rng.range(32, 128)),
        // A long document.
        5 | 6 => (false, rng.range(long * 6 / 10, long), rng.range(16, 64)),
        // A short prompt.
        _ => (false, rng.range(8, 64), rng.range(16, 96)),
    };
    let text = text_tokens(tokenizer, rng, length)?;
    let prompt = if shared {
        [shared_prefix, &text[..]].concat()
    } else {
        text
    };
    let cancel_after = (rng.range(0, 4) == 0).then(|| rng.range(1, 24));
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = max_tokens;
    params.ignore_eos = true;
    let stream = engine.submit(EngineRequest {
        prompt: Prompt::Tokens(prompt),
        params,
    })?;
    let mut tokens = 0;
    for event in stream.events.iter() {
        match event {
            EngineEvent::Admitted { .. } => {}
            EngineEvent::Token { .. } => {
                tokens += 1;
                counters.generated.fetch_add(1, Ordering::Relaxed);
                if cancel_after == Some(tokens) {
                    engine.cancel(stream.id);
                }
            }
            EngineEvent::Finished {
                finish_reason,
                error,
                ..
            } => {
                let counter = match finish_reason {
                    FinishReason::Cancelled => &counters.cancelled,
                    FinishReason::Error => {
                        eprintln!(
                            "soak: a request failed: {}",
                            error.map(|e| e.message).unwrap_or_default()
                        );
                        &counters.errors
                    }
                    _ => &counters.finished,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
    }
    anyhow::bail!("a stream ended without its Finished event")
}
