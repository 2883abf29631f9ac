//! `perch bench`: single-request throughput and memory on a model, printed as numbers (and as
//! one JSON object on the last line with `--json`). `scripts/bench_vs_mlx_lm.py` runs it next to
//! mlx_lm on the same prompt ids.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use mlx_rs::Array;
use perch_engine::device::{memory_stats, Backend};
use perch_engine::SlotAttention;
use perch_engine::{GenerationStats, KvQuantization};
use serde::Serialize;

use crate::model_dir;

#[derive(Args)]
pub struct BenchArgs {
    /// Model directory (mlx-community layout) or a downloaded Hub id (ORG/NAME); default: the model installed by setup.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens to generate per run (EOS is ignored).
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Measured runs after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// A JSON file with the prompt's token ids, to measure the exact prompt another tool uses;
    /// with --concurrency, an array of N such arrays, one per request.
    #[arg(long)]
    pub prompt_ids: Option<PathBuf>,
    /// Write the generated token ids to this JSON file: an array of ids (the last measured run),
    /// with --concurrency one array per request in prompt order. To compare paths or engines
    /// token by token (greedy by default; EOS is ignored).
    #[arg(long)]
    pub output_ids: Option<PathBuf>,
    /// Print a JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    /// Run N requests at once through the batch engine instead of one request at a time.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// With --concurrency: tokens at the start of every prompt that all requests share; a
    /// warm-up request puts them in the prefix cache first.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix_tokens: usize,
    /// With --concurrency: the engine's KV cache budget in MiB (default: the engine's).
    #[arg(long)]
    pub kv_cache_mib: Option<usize>,
    /// Quantize the KV cache to this many bits (8 or 4; MLX affine): with --concurrency the
    /// engine's whole pool, else the sequence's cache from --quantized-kv-start positions on.
    #[arg(long)]
    pub kv_bits: Option<i32>,
    /// With --kv-bits: elements per quantization group.
    #[arg(long, default_value_t = KvQuantization::DEFAULT_GROUP_SIZE)]
    pub kv_group_size: i32,
    /// Without --concurrency, with --kv-bits: positions kept in full precision first.
    #[arg(long, default_value_t = perch_engine::GenerateRequest::DEFAULT_QUANTIZED_KV_START)]
    pub quantized_kv_start: usize,
    /// Bound the KV cache to N positions (mlx_lm's --max-kv-size): the request's, or with
    /// --concurrency every request's (bounded rows of the batch).
    #[arg(long)]
    pub max_kv_size: Option<usize>,
    /// With --concurrency: sampling temperature of every request (mlx_lm's `--temp`; 0 =
    /// greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// With --concurrency and --temp: request i draws from seed `SEED + i`.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Speculative decoding with this draft model: without --concurrency one sequence; with it
    /// every request in the batch, the draft proposing in the batch's verify steps.
    #[command(flatten)]
    pub draft: crate::generate::DraftOptions,
    /// With --concurrency: prompt lookup in the batch.
    #[command(flatten)]
    pub prompt_lookup: crate::generate::PromptLookupOptions,
    /// With --concurrency: sequences prefilled in one step (default: the engine's for this
    /// backend).
    #[arg(long)]
    pub prefill_batch_size: Option<usize>,
    /// With --concurrency: the most prompt tokens one step prefills while others decode
    /// (default: the engine's for this backend).
    #[arg(long)]
    pub prefill_token_budget: Option<usize>,
    /// With --concurrency: how batched steps read their slot caches (auto: the backend's
    /// choice; fused: MLX's fused attention with a boolean mask; explicit: matmul, mask,
    /// softmax, matmul).
    #[arg(long, value_enum, default_value_t = SlotAttentionArg::Auto)]
    pub slot_attention: SlotAttentionArg,
    /// With --concurrency: run batched decode steps through MLX's compiler (default: on for a
    /// GPU, off on CPU).
    #[arg(long)]
    pub compile_decode: Option<bool>,
    /// With --concurrency: microseconds the engine waits for more requests after the first
    /// reaches it idle (default: the engine's for this backend; 0 starts at once).
    #[arg(long)]
    pub arrival_window_us: Option<u64>,
    /// With --concurrency: this many of the requests constrain their output to a JSON object
    /// (`response_format` json_object; they then generate end-of-sequence tokens after it, as
    /// end of sequence is ignored), to measure what a constrained request costs the batch.
    #[arg(long, default_value_t = 0)]
    pub json_requests: usize,
    /// With --concurrency: every request a chat message holding its own filler text
    /// (--prompt-tokens long), then this image (PNG, JPEG, WebP, GIF), then a question, for a
    /// model that takes images; each request's tower pass is its own (its text comes first, so
    /// no prefix-cache block holds another's image).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// With --concurrency: run the engine's idle warm-up (prefill passes and decode steps
    /// of the shapes requests meet most; default: the engine's for this backend, on for CUDA).
    #[arg(long)]
    pub idle_warm_up: Option<bool>,
    /// With --concurrency: instead of the workload, wait for the engine's idle warm-up, then send
    /// one request of each of these prompt lengths (in tokens, comma-separated), one at a time,
    /// twice (the prefix cache cleared between), and print each one's TTFT: the first time the
    /// engine meets its prompt's shapes, and again.
    #[arg(long, value_delimiter = ',')]
    pub first_prompts: Vec<usize>,
    /// With --concurrency: then run the same workload through the local API (an in-process
    /// `perch serve`, streamed completions over 127.0.0.1) and print both.
    #[arg(long)]
    pub http: bool,
    /// Instead of the workload: a chat of --prompt-tokens tokens (--gen-tokens generated), its
    /// time to first token alone and while a background prompt of this many tokens prefills,
    /// in the high lane and in the normal one (`--runs` rounds each; see `bench_priority`).
    #[arg(long)]
    pub background_prompt_tokens: Option<usize>,
    /// With --concurrency: the batch engine over a group of ranks (`--distributed tensor` or
    /// `pipeline`, as `perch serve` takes them): rank 0 runs the workload and prints it, the
    /// others follow its batch; `--hosts` or `--hostfile` start the ranks from here.
    #[command(flatten)]
    pub group: crate::distributed::DistributedArgs,
}

/// [`SlotAttention`] as a command-line value.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum SlotAttentionArg {
    Auto,
    Fused,
    Explicit,
}

impl From<SlotAttentionArg> for SlotAttention {
    fn from(arg: SlotAttentionArg) -> Self {
        match arg {
            SlotAttentionArg::Auto => SlotAttention::Auto,
            SlotAttentionArg::Fused => SlotAttention::Fused,
            SlotAttentionArg::Explicit => SlotAttention::Explicit,
        }
    }
}

#[derive(Serialize)]
struct BenchReport {
    backend: Backend,
    mlx_version: &'static str,
    prompt_tokens: usize,
    generation_tokens: usize,
    runs: usize,
    prompt_tps: f64,
    generation_tps: f64,
    ttft_ms: f64,
    peak_memory_bytes: usize,
    /// float32 1024x1024 matmul throughput: what the BLAS behind libmlx delivers.
    gemm_gflops: f64,
    /// With --draft-model: the share of proposed tokens the model accepted (all runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    acceptance_rate: Option<f64>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.group.distributed.is_some() {
        anyhow::ensure!(
            args.concurrency.is_some() && args.background_prompt_tokens.is_none(),
            "--distributed measures the batch engine over ranks: give --concurrency (and no \
             --background-prompt-tokens)"
        );
        if args.group.launches() {
            return args.group.launch();
        }
    }
    if let Some(tokens) = args.background_prompt_tokens {
        return crate::bench_priority::run(&args, tokens);
    }
    if let Some(concurrency) = args.concurrency {
        return crate::bench_batch::run(&args, concurrency);
    }
    let (model, tokenizer) = model_dir::load(args.model.clone())?;
    let draft = args.draft.load()?;
    // Metal: the models stay resident while the command runs (mlx_lm's `wired_limit` around
    // generation); the engine does the same for `serve`, the app and `bench --concurrency`.
    let _wired = perch_engine::device::WiredLimit::raise();
    let prompt = match &args.prompt_ids {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<Vec<u32>>(&text)
                .with_context(|| format!("{} is not a JSON array of token ids", path.display()))?
        }
        None => filler_tokens(&tokenizer, 0, args.prompt_tokens)?,
    };
    let mut request = perch_engine::GenerateRequest::new(prompt);
    request.max_tokens = args.gen_tokens;
    request.ignore_eos = true;
    crate::generate::KvCacheOptions {
        max_kv_size: args.max_kv_size,
        kv_bits: args.kv_bits,
        kv_group_size: args.kv_group_size,
        quantized_kv_start: args.quantized_kv_start,
    }
    .apply(&mut request);

    let mut runs: Vec<GenerationStats> = Vec::new();
    let mut last_ids = Vec::new();
    for i in 0..=args.runs.max(1) {
        let out = crate::generate::run_generation(
            model.as_ref(),
            draft.as_ref(),
            &tokenizer,
            &request,
            |_| ControlFlow::Continue(()),
        )?;
        last_ids = out.token_ids;
        if i > 0 {
            eprintln!(
                "run {i}: prompt {:.1} tok/s, generation {:.1} tok/s, TTFT {:.0} ms, peak {:.1} MB",
                out.stats.prompt_tps,
                out.stats.generation_tps,
                out.stats.ttft_s * 1e3,
                out.stats.peak_memory_bytes as f64 / 1e6
            );
            runs.push(out.stats);
        }
    }
    if let Some(path) = &args.output_ids {
        write_ids(path, &last_ids)?;
    }
    let median = |f: fn(&GenerationStats) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let report = BenchReport {
        backend: Backend::current(),
        mlx_version: mlx_sys::MLX_VERSION,
        prompt_tokens: request.prompt.len(),
        generation_tokens: args.gen_tokens,
        runs: runs.len(),
        prompt_tps: median(|s| s.prompt_tps),
        generation_tps: median(|s| s.generation_tps),
        ttft_ms: median(|s| s.ttft_s * 1e3),
        peak_memory_bytes: runs.iter().map(|s| s.peak_memory_bytes).max().unwrap_or(0),
        gemm_gflops: gemm_gflops()?,
        acceptance_rate: draft.as_ref().map(|_| {
            let proposed: usize = runs.iter().map(|s| s.draft_tokens).sum();
            let accepted: usize = runs.iter().map(|s| s.accepted_draft_tokens).sum();
            accepted as f64 / proposed.max(1) as f64
        }),
    };
    println!(
        "prompt: {:.1} tok/s | generation: {:.1} tok/s | TTFT: {:.0} ms | peak memory: {:.1} MB | f32 GEMM: {:.1} GFLOP/s | active now: {:.1} MB",
        report.prompt_tps,
        report.generation_tps,
        report.ttft_ms,
        report.peak_memory_bytes as f64 / 1e6,
        report.gemm_gflops,
        memory_stats().active_bytes as f64 / 1e6
    );
    if let Some(rate) = report.acceptance_rate {
        println!("draft tokens accepted: {:.1}%", rate * 100.0);
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

/// Writes `ids` (any serializable shape of token ids) to `path` as JSON.
pub fn write_ids(path: &std::path::Path, ids: &impl Serialize) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string(ids)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// `len` tokens of English filler text, starting `skip` tokens into the cycle (so prompts with
/// different `skip` differ from their first token).
pub fn filler_tokens(
    tokenizer: &perch_engine::Tokenizer,
    skip: usize,
    len: usize,
) -> anyhow::Result<Vec<u32>> {
    let text = "The quick brown fox jumps over the lazy dog while the farmer counts sheep in the valley. \
                Rivers carry silt to the delta, where herons wait and fishermen mend their nets at dawn. ";
    cycled(tokenizer, text, skip, len)
}

/// Like [`filler_tokens`] from another text: warm-up prompts that share no prefix-cache block
/// with the measured ones.
pub fn warm_up_tokens(
    tokenizer: &perch_engine::Tokenizer,
    skip: usize,
    len: usize,
) -> anyhow::Result<Vec<u32>> {
    let text =
        "Seven orange kites drifted above the harbour; a baker sold warm bread to the sailors, \
                and the old lighthouse keeper wrote letters nobody would ever read. ";
    cycled(tokenizer, text, skip, len)
}

fn cycled(
    tokenizer: &perch_engine::Tokenizer,
    text: &str,
    skip: usize,
    len: usize,
) -> anyhow::Result<Vec<u32>> {
    let ids = tokenizer.encode(text, false)?;
    Ok(ids.iter().copied().cycle().skip(skip).take(len).collect())
}

/// GFLOP/s of a float32 1024x1024 matmul (best of 5).
pub fn gemm_gflops() -> anyhow::Result<f64> {
    let n = 1024;
    let a = mlx_rs::random::normal::<f32>(&[n, n], None, None, None)?;
    let b = mlx_rs::random::normal::<f32>(&[n, n], None, None, None)?;
    a.eval()?;
    b.eval()?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let c: Array = mlx_rs::ops::matmul(&a, &b)?;
        c.eval()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / best / 1e9)
}
