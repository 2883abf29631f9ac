//! `perch generate`.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use perch_engine::models::Model;
use perch_engine::sample::sampler::SamplingParams;
use perch_engine::{
    generate, generate_speculative, ChatMessage, Draft, GenerateOutput, GenerateRequest,
    KvQuantization, PromptLookup, TokenEvent, Tokenizer,
};
use serde_json::json;

use crate::distributed::{self, DistributedArgs};
use crate::model_dir;

#[derive(Args)]
pub struct GenerateArgs {
    /// Model directory (mlx-community layout) or a downloaded Hub id (ORG/NAME); default: the model installed by setup.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A user message, wrapped in the model's chat template.
    #[arg(long, group = "input")]
    pub prompt: Option<String>,
    /// A JSON file with an OpenAI-style messages array.
    #[arg(long, group = "input")]
    pub messages: Option<PathBuf>,
    /// Text passed to the model as is, without the chat template.
    #[arg(long, group = "input")]
    pub raw: Option<String>,
    /// A system message placed before the prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// An image file (PNG, JPEG, WebP, GIF) placed before the --prompt text in its message,
    /// for a model that takes images (repeatable).
    #[arg(long = "image")]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub options: GenerationOptions,
    /// Print one JSON object per token and a final one with the finish reason and stats.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub group: DistributedArgs,
}

/// Sampling and length flags shared by `generate` and `chat`.
#[derive(Args, Clone)]
pub struct GenerationOptions {
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub repetition_penalty: f32,
    /// Number of recent tokens the repetition penalty looks at.
    #[arg(long, default_value_t = 20)]
    pub repetition_context_size: usize,
    /// Subtract this from the logit of every token among the last 20 (OpenAI's presence penalty).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this once per occurrence among the last 20 tokens (OpenAI's frequency penalty).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// XTC: the probability, per token, of excluding every top choice but the least likely
    /// (mlx_lm's `--xtc-probability`; 0 = off; needs --temp above 0).
    #[arg(long, default_value_t = 0.0)]
    pub xtc_probability: f32,
    /// XTC: the probability above which a token is a top choice, in [0, 0.5].
    #[arg(long, default_value_t = perch_engine::sample::sampler::DEFAULT_XTC_THRESHOLD)]
    pub xtc_threshold: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this string appears (repeatable).
    #[arg(long = "stop")]
    pub stop_strings: Vec<String>,
    /// Add BIAS to token ID's logit, as ID=BIAS (repeatable), e.g. `--logit-bias 2=-100`.
    #[arg(long = "logit-bias", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// With --json: each token's log-probability and those of the N most likely tokens.
    #[arg(long)]
    pub logprobs: Option<usize>,
    #[command(flatten)]
    pub kv: KvCacheOptions,
    #[command(flatten)]
    pub draft: DraftOptions,
}

/// Speculative decoding (mlx_lm's flags).
#[derive(Args, Clone)]
pub struct DraftOptions {
    /// A smaller model with the same tokenizer (directory or downloaded Hub id) that proposes
    /// tokens for the model to verify in one forward pass (speculative decoding).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// With --draft-model: tokens proposed per step.
    #[arg(long, default_value_t = Draft::DEFAULT_NUM_DRAFT_TOKENS)]
    pub num_draft_tokens: usize,
}

/// Prompt lookup (n-gram) speculative decoding in the batch ([`PromptLookup`]).
#[derive(Args, Clone, Debug)]
pub struct PromptLookupOptions {
    /// Speculative decoding without a draft model: a greedy request whose last tokens occurred
    /// earlier in its prompt or output proposes what followed them, and the model verifies the
    /// proposals in one forward pass (pays on output that repeats its input, as edits of a file
    /// do; the output is the model's own greedy tokens).
    #[arg(long)]
    pub prompt_lookup: bool,
    /// With --prompt-lookup: tokens proposed a step at most.
    #[arg(long, default_value_t = PromptLookup::default().num_draft_tokens)]
    pub lookup_draft_tokens: usize,
    /// With --prompt-lookup: propose only while at most this many requests decode.
    #[arg(long, default_value_t = PromptLookup::default().max_rows)]
    pub lookup_max_rows: usize,
    /// With --prompt-lookup: verify proposals whenever a request has some, instead of only
    /// where verify steps have lately given more tokens a second than plain ones.
    #[arg(long)]
    pub lookup_every_step: bool,
}

impl PromptLookupOptions {
    /// The engine's setting: `None` without --prompt-lookup; an error for bad values.
    pub fn config(&self) -> anyhow::Result<Option<PromptLookup>> {
        if !self.prompt_lookup {
            return Ok(None);
        }
        let default = PromptLookup::default();
        let lookup = PromptLookup {
            num_draft_tokens: self.lookup_draft_tokens,
            max_rows: self.lookup_max_rows,
            adaptive: !self.lookup_every_step,
            ..default
        };
        lookup.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(lookup))
    }
}

/// A loaded draft model and its tokenizer.
pub struct LoadedDraft {
    model: Box<dyn Model>,
    tokenizer: Tokenizer,
    num_draft_tokens: usize,
}

impl DraftOptions {
    /// Loads --draft-model, if given.
    pub fn load(&self) -> anyhow::Result<Option<LoadedDraft>> {
        let Some(path) = &self.draft_model else {
            return Ok(None);
        };
        let (model, tokenizer) = model_dir::load(Some(path.clone()))
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        Ok(Some(LoadedDraft {
            model,
            tokenizer,
            num_draft_tokens: self.num_draft_tokens,
        }))
    }
}

/// [`generate`], or [`generate_speculative`] with `draft`.
pub fn run_generation(
    model: &dyn Model,
    draft: Option<&LoadedDraft>,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
    on_token: impl FnMut(&TokenEvent) -> ControlFlow<()>,
) -> perch_engine::Result<GenerateOutput> {
    match draft {
        None => generate(model, tokenizer, request, on_token),
        Some(draft) => generate_speculative(
            model,
            &Draft {
                model: draft.model.as_ref(),
                tokenizer: &draft.tokenizer,
                num_draft_tokens: draft.num_draft_tokens,
            },
            tokenizer,
            request,
            on_token,
        ),
    }
}

/// mlx_lm's KV cache flags for one sequence (`generate`, `chat`, `bench` without --concurrency).
#[derive(Args, Clone)]
pub struct KvCacheOptions {
    /// Bound each layer's KV cache to N positions: the first 4 and the most recent (mlx_lm's
    /// --max-kv-size, a rotating cache): memory stays bounded, older context is forgotten.
    #[arg(long)]
    pub max_kv_size: Option<usize>,
    /// Quantize the KV cache to this many bits (2-8; MLX affine) once it holds
    /// --quantized-kv-start positions.
    #[arg(long)]
    pub kv_bits: Option<i32>,
    /// With --kv-bits: elements per quantization group (32, 64 or 128).
    #[arg(long, default_value_t = KvQuantization::DEFAULT_GROUP_SIZE)]
    pub kv_group_size: i32,
    /// With --kv-bits: positions kept in full precision before the cache is quantized.
    #[arg(long, default_value_t = GenerateRequest::DEFAULT_QUANTIZED_KV_START)]
    pub quantized_kv_start: usize,
}

impl KvCacheOptions {
    /// Sets the request's KV cache options (checked against the model by `generate`).
    pub fn apply(&self, request: &mut GenerateRequest) {
        request.max_kv_size = self.max_kv_size;
        request.kv_quantization = self.kv_bits.map(|bits| KvQuantization {
            bits,
            group_size: self.kv_group_size,
        });
        request.quantized_kv_start = self.quantized_kv_start;
    }
}

fn parse_logit_bias(arg: &str) -> Result<(u32, f32), String> {
    let (id, bias) = arg
        .split_once('=')
        .ok_or_else(|| format!("`{arg}` is not ID=BIAS"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("`{id}` is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("`{bias}` is not a number"))?;
    Ok((id, bias))
}

impl GenerationOptions {
    pub fn request(&self, prompt: Vec<u32>) -> GenerateRequest {
        let mut request = GenerateRequest::new(prompt);
        request.max_tokens = self.max_tokens;
        request.stop_strings = self.stop_strings.clone();
        request.logprobs = self.logprobs;
        request.sampling = SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            xtc_probability: self.xtc_probability,
            xtc_threshold: self.xtc_threshold,
            seed: self.seed,
            logit_bias: self.logit_bias.iter().copied().collect(),
            ..SamplingParams::default()
        };
        self.kv.apply(&mut request);
        request
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if args.group.launches() {
        return args.group.launch();
    }
    let messages = messages(&args)?;
    if let Some(messages) = messages.as_ref().filter(|m| has_images(m)) {
        return run_with_images(&args, messages.clone());
    }
    if args.group.distributed.is_some() && args.options.draft.draft_model.is_some() {
        bail!("--distributed runs without a draft model");
    }
    let (model, tokenizer, rank, seed) = match args.group.distributed {
        Some(split) => {
            let dir = model_dir::resolve(args.model.clone())?;
            let tokenizer = Tokenizer::load(&dir)
                .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
            let (model, rank, seed) =
                distributed::load(&dir, split, &args.group, args.options.seed)?;
            (model, tokenizer, rank, Some(seed))
        }
        None => {
            let (model, tokenizer) = model_dir::load(args.model.clone())?;
            (model, tokenizer, 0, args.options.seed)
        }
    };
    // Every rank computes the tokens; rank 0 alone prints them.
    let prints = rank == 0;
    let draft = args.options.draft.load()?;
    // Metal: the models stay resident while the command runs (mlx_lm's `wired_limit` around
    // generation); the engine does the same for `serve`, the app and `bench --concurrency`.
    let _wired = perch_engine::device::WiredLimit::raise();
    let prompt = match &messages {
        Some(messages) => tokenizer.encode_chat(messages)?,
        None => raw_ids(&args, &tokenizer)?,
    };
    let mut request = args.options.request(prompt);
    request.sampling.seed = seed;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let drafting = draft.is_some();
    let result = run_generation(
        model.as_ref(),
        draft.as_ref(),
        &tokenizer,
        &request,
        |event| {
            let written = if !prints {
                Ok(())
            } else if args.json {
                let mut line = match event.id {
                    Some(id) => match &event.logprobs {
                        Some(logprobs) => {
                            json!({ "token": id, "text": event.text, "logprobs": logprobs })
                        }
                        None => json!({ "token": id, "text": event.text }),
                    },
                    None => json!({ "text": event.text }),
                };
                if drafting && event.id.is_some() {
                    line["from_draft"] = json!(event.from_draft);
                }
                writeln!(out, "{line}")
            } else {
                write!(out, "{}", event.text).and_then(|_| out.flush())
            };
            match written {
                Ok(()) => ControlFlow::Continue(()),
                Err(e) => {
                    // A closed pipe (e.g. `| head`) ends generation quietly.
                    write_error = Some(e);
                    ControlFlow::Break(())
                }
            }
        },
    )?;
    if write_error.is_some() || !prints {
        return Ok(());
    }
    if args.json {
        writeln!(
            out,
            "{}",
            json!({ "finish_reason": result.finish_reason, "stats": result.stats })
        )?;
    } else {
        writeln!(out)?;
        let s = &result.stats;
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s | {} generated, {:.1} tok/s | TTFT {:.0} ms | peak {:.1} MB | finish: {:?}]",
            s.prompt_tokens,
            s.prompt_tps,
            s.generation_tokens,
            s.generation_tps,
            s.ttft_s * 1000.0,
            s.peak_memory_bytes as f64 / 1e6,
            result.finish_reason
        );
        if s.draft_tokens > 0 {
            eprintln!(
                "[draft: {} of {} proposed tokens accepted ({:.0}%)]",
                s.accepted_draft_tokens,
                s.draft_tokens,
                100.0 * s.accepted_draft_tokens as f64 / s.draft_tokens as f64
            );
        }
    }
    Ok(())
}

/// Whether any of `messages` holds an image.
fn has_images(messages: &[ChatMessage]) -> bool {
    messages.iter().any(|m| m.image_urls().next().is_some())
}

/// `--image FILE` as a data URL part, read as the API reads an image (`Err`: a sentence).
pub(crate) fn image_part(path: &std::path::Path) -> anyhow::Result<perch_engine::ContentPart> {
    use base64::Engine as _;
    let size = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    let most = perch_engine::image_processor::MAX_IMAGE_BYTES as u64;
    if size > most {
        bail!(
            "{} has {} MB; the most an image may have is {} MB",
            path.display(),
            size >> 20,
            most >> 20
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let data = base64::engine::general_purpose::STANDARD.encode(bytes);
    Ok(perch_engine::ContentPart::Image(format!(
        "data:image;base64,{data}"
    )))
}

/// A request with images (`--image`, or image parts in `--messages`): it runs in the batch
/// engine (the path that takes images), its images read as the API reads them.
fn run_with_images(args: &GenerateArgs, messages: Vec<ChatMessage>) -> anyhow::Result<()> {
    use perch_engine::{EngineConfig, EngineEvent, EngineHandle, EngineRequest, Prompt};
    if args.options.draft.draft_model.is_some() {
        bail!("a request with images runs without a draft model: leave out --draft-model");
    }
    let dir = model_dir::resolve(args.model.clone())?;
    let _wired = perch_engine::device::WiredLimit::raise();
    let engine = match args.group.distributed {
        None => EngineHandle::load(&dir, EngineConfig::default())
            .with_context(|| format!("loading the model in {}", dir.display()))?,
        // Over ranks, through the batch engine as `perch serve --distributed` runs it: rank 0's
        // request carries the image's pixels to the other ranks, which print nothing.
        Some(split) => {
            match crate::distributed::engine(&dir, split, &args.group, EngineConfig::default())? {
                Some(engine) => engine,
                None => return Ok(()),
            }
        }
    };
    let stream = engine.submit(EngineRequest {
        prompt: Prompt::Chat(messages),
        params: args.options.request(Vec::new()),
    })?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let result = loop {
        let event = stream
            .events
            .recv()
            .context("the engine stopped before the request ended")?;
        match event {
            EngineEvent::Token { id, text, logprobs } => {
                let written = if args.json {
                    let line = match (id, logprobs) {
                        (Some(id), Some(logprobs)) => {
                            json!({ "token": id, "text": text, "logprobs": logprobs })
                        }
                        (Some(id), None) => json!({ "token": id, "text": text }),
                        (None, _) => json!({ "text": text }),
                    };
                    writeln!(out, "{line}")
                } else {
                    write!(out, "{text}").and_then(|_| out.flush())
                };
                if written.is_err() {
                    // A closed pipe (e.g. `| head`) ends generation quietly.
                    engine.cancel(stream.id);
                    engine.shutdown();
                    return Ok(());
                }
            }
            EngineEvent::Finished {
                finish_reason,
                stats,
                error,
                ..
            } => break (finish_reason, stats, error),
            EngineEvent::Admitted { .. } => {}
        }
    };
    engine.shutdown();
    let (finish_reason, stats, error) = result;
    if let Some(error) = error {
        bail!("{}", error.message);
    }
    if args.json {
        writeln!(
            out,
            "{}",
            json!({ "finish_reason": finish_reason, "stats": stats })
        )?;
    } else {
        writeln!(out)?;
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s | {} generated, {:.1} tok/s | TTFT {:.0} ms | finish: {:?}]",
            stats.prompt_tokens,
            stats.prompt_tps,
            stats.generation_tokens,
            stats.generation_tps,
            stats.ttft_s * 1000.0,
            finish_reason
        );
    }
    Ok(())
}

/// The `--raw` prompt's ids.
fn raw_ids(args: &GenerateArgs, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    let raw = args.raw.as_deref().unwrap_or_default();
    if raw.is_empty() {
        bail!("the prompt is empty");
    }
    Ok(tokenizer.encode(raw, true)?)
}

/// The chat `--prompt` (with its `--image`s) or `--messages` make, `--system` first; `None`
/// for `--raw`.
fn messages(args: &GenerateArgs) -> anyhow::Result<Option<Vec<ChatMessage>>> {
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system.clone()));
    }
    if !args.images.is_empty() && args.prompt.is_none() {
        bail!("--image goes with --prompt (a messages file carries its images as image_url parts)");
    }
    if args.raw.is_some() {
        if args.system.is_some() {
            bail!("--system needs --prompt or --messages (--raw skips the chat template)");
        }
        return Ok(None);
    }
    if let Some(prompt) = &args.prompt {
        if prompt.trim().is_empty() {
            bail!("the prompt is empty");
        }
        let mut parts = args
            .images
            .iter()
            .map(|path| image_part(path))
            .collect::<anyhow::Result<Vec<_>>>()?;
        parts.push(perch_engine::ContentPart::Text(prompt.clone()));
        messages.push(ChatMessage::from_parts("user", parts));
    } else if let Some(path) = &args.messages {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let parsed: Vec<ChatMessage> = serde_json::from_str(&text).with_context(|| {
            format!(
                "{} is not a JSON array of {{\"role\", \"content\"}} messages",
                path.display()
            )
        })?;
        if parsed.is_empty() {
            bail!("{} holds no messages", path.display());
        }
        messages.extend(parsed);
    } else {
        bail!("give a prompt with --prompt TEXT, --messages FILE.json or --raw TEXT");
    }
    Ok(Some(messages))
}
