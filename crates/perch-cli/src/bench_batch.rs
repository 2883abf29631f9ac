//! `perch bench --concurrency N`: N requests submitted at once to the batch engine; reports
//! throughput, TTFT and ITL percentiles and peak memory, with a JSON object as the last line
//! (`--json`). With `--http`, the same prompts (from an emptied prefix cache) then go through
//! the local API (an in-process `perch serve`, streamed completions over 127.0.0.1); the pair runs
//! twice and the second is printed, with the HTTP run's share of the direct generation throughput.

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use anyhow::Context;

use perch_engine::device::{memory_stats, reset_peak_memory, Backend};
use perch_engine::StepTimes;
use perch_engine::{
    EngineConfig, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenerateRequest, Grammar,
    KvQuantization, Prompt, Tokenizer,
};
use serde::Serialize;

use crate::bench::{filler_tokens, warm_up_tokens, write_ids, BenchArgs};
use crate::model_dir;

#[derive(Serialize)]
struct BatchReport {
    backend: Backend,
    concurrency: usize,
    prompt_tokens: usize,
    shared_prefix_tokens: usize,
    generation_tokens: usize,
    /// All prompt tokens over the time until every request had its first token.
    prompt_tps: f64,
    /// All generated tokens over the time from the first first token to the last token.
    generation_tps: f64,
    /// All generated tokens over the time from the first submission to the last token: the
    /// run's throughput end to end, prefills included.
    wall_tps: f64,
    ttft_ms_p50: f64,
    ttft_ms_p95: f64,
    itl_ms_p50: f64,
    itl_ms_p95: f64,
    peak_memory_bytes: usize,
    /// The KV cache budget the engine runs with (the configured one, or less where memory is
    /// short: `EngineLimits::kv_cache_bytes`).
    kv_cache_bytes: usize,
    /// Share of the measured requests' prompt tokens served from the prefix cache.
    prefix_cache_hit_rate: f64,
    /// Prompt tokens over the seconds spent in prefill forward passes only (mlx_lm's
    /// `BatchGenerator` reports its `prompt_tps` this way).
    engine_prefill_tps: f64,
    /// Prefill forward passes in the measured run, and their milliseconds in all.
    engine_prefill_passes: u64,
    engine_prefill_ms: f64,
    /// Milliseconds in all putting full blocks into the prefix cache (after prefill passes and,
    /// for models with sliding layers, after decode steps).
    engine_publish_ms: f64,
    /// Milliseconds per decode step building and dispatching its forward pass and sampling,
    /// plus waiting for its tokens.
    engine_decode_step_ms: f64,
    /// The wait alone, per step: ~0 when the host bounds the step, most of it when the device does.
    engine_decode_wait_ms: f64,
    /// Milliseconds per decode step handing its tokens to their requests (detokenizing, stops).
    engine_token_ms: f64,
    /// Milliseconds per decode step building its graph (before MLX encodes and launches it).
    engine_decode_build_ms: f64,
    /// Milliseconds per engine step planning it and admitting requests, and putting full blocks
    /// into the prefix cache (after prefill passes, and after decode steps of models with
    /// sliding layers): parts of the time outside forward passes.
    engine_schedule_ms: f64,
    engine_publish_step_ms: f64,
    /// Engine steps in the measured run, and the share of their time outside forward passes
    /// and sampling (admission, slot moves, prefix-cache copies, detokenizing).
    engine_steps: u64,
    engine_other_share: f64,
    /// Speculative decoding's verify steps (prompt lookup or a draft model), and the tokens
    /// proposed and accepted in them.
    engine_verify_steps: u64,
    /// Of a verify step, the draft model's proposals (ms).
    engine_draft_ms: f64,
    engine_draft_tokens: u64,
    engine_accepted_draft_tokens: u64,
}

struct Timeline {
    submitted: Instant,
    /// When each piece of output arrived (a token directly; a non-empty text chunk over HTTP).
    tokens: Vec<Instant>,
    ids: Vec<u32>,
    /// Tokens generated (over HTTP, from the usage: a chunk may hold none or several).
    generated: usize,
    prompt_tokens: usize,
    cached_prompt_tokens: usize,
}

impl Timeline {
    fn new(submitted: Instant) -> Self {
        Self {
            submitted,
            tokens: Vec::new(),
            ids: Vec::new(),
            generated: 0,
            prompt_tokens: 0,
            cached_prompt_tokens: 0,
        }
    }
}

/// How the measured requests reach the engine.
enum Client<'a> {
    /// The engine itself, each request shaped by `options`.
    Direct {
        engine: &'a EngineHandle,
        options: RequestOptions,
    },
    /// `POST /v1/completions` of a server at this base URL, streamed.
    Http(String),
}

/// What the measured requests ask for besides their prompt and length.
#[derive(Clone, Default)]
struct RequestOptions {
    /// The first this many prompts are constrained to a JSON object.
    json_requests: usize,
    /// Every request's KV cache is bounded to this many positions.
    max_kv_size: Option<usize>,
    /// `--image`: every request a chat message of its prompt's text, this image and a question.
    image: Option<std::sync::Arc<ImagePrompt>>,
    /// `--draft-model`: every request speculates with this many tokens a step.
    num_draft_tokens: Option<usize>,
    /// `--temp`, and `--seed` (request `i` seeded `seed + i`).
    temperature: f32,
    seed: Option<u64>,
}

impl RequestOptions {
    /// Shapes the `i`-th measured request.
    fn apply(&self, i: usize, request: &mut EngineRequest) {
        if i < self.json_requests {
            request.params.grammar = Some(Grammar::JsonObject);
        }
        request.params.max_kv_size = self.max_kv_size;
        request.params.num_draft_tokens = self.num_draft_tokens;
        request.params.sampling.temperature = self.temperature;
        request.params.sampling.seed = self.seed.map(|s| s.wrapping_add(i as u64));
        if let Some(image) = &self.image {
            request.prompt = image.chat(&image.texts[i]);
        }
    }
}

/// `--image`'s requests: each prompt's text before the image.
struct ImagePrompt {
    /// The image as a content part (a data URL).
    part: perch_engine::ContentPart,
    /// The measured prompts' texts.
    texts: Vec<String>,
}

impl ImagePrompt {
    fn chat(&self, text: &str) -> Prompt {
        Prompt::Chat(vec![perch_engine::ChatMessage::from_parts(
            "user",
            vec![
                perch_engine::ContentPart::Text(text.to_string()),
                self.part.clone(),
                perch_engine::ContentPart::Text("What is in the picture?".into()),
            ],
        )])
    }
}

/// The model id the in-process server serves.
const HTTP_MODEL: &str = "bench";

pub fn run(args: &BenchArgs, concurrency: usize) -> anyhow::Result<()> {
    anyhow::ensure!(concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(
        args.json_requests <= concurrency && (args.json_requests == 0 || !args.http),
        "--json-requests must be at most --concurrency, and not with --http"
    );
    anyhow::ensure!(
        args.max_kv_size.is_none() || !args.http,
        "--max-kv-size with --concurrency is measured on the engine directly, not with --http"
    );
    anyhow::ensure!(
        args.quantized_kv_start == perch_engine::GenerateRequest::DEFAULT_QUANTIZED_KV_START,
        "--quantized-kv-start applies to one sequence's cache: with --concurrency, --kv-bits \
         quantizes the engine's whole pool from the start"
    );
    anyhow::ensure!(
        args.draft.draft_model.is_none() || !args.http,
        "--draft-model with --concurrency is measured on the engine directly, not with --http"
    );
    anyhow::ensure!(
        args.image.is_none()
            || !(args.http || args.shared_prefix_tokens > 0 || args.prompt_ids.is_some()),
        "--image is measured on the engine directly, each request's text its own: not with \
         --http, --shared-prefix-tokens or --prompt-ids"
    );
    let dir = model_dir::resolve(args.model.clone())?;
    let tokenizer = Tokenizer::load(&dir)?;
    let config = engine_config(args, concurrency)?;
    let engine = match args.group.distributed {
        None => EngineHandle::load(&dir, config)?,
        Some(split) => match crate::distributed::engine(&dir, split, &args.group, config)? {
            Some(engine) => engine,
            // Another rank than 0: it followed rank 0's batch until rank 0 stopped.
            None => return Ok(()),
        },
    };
    if !args.first_prompts.is_empty() {
        let result = first_requests(&engine, &tokenizer, &args.first_prompts, args.json);
        engine.shutdown();
        return result;
    }
    let prompts = make_prompts(args, &tokenizer, concurrency)?;
    let image = match &args.image {
        Some(path) => Some(std::sync::Arc::new(ImagePrompt {
            part: crate::generate::image_part(path)?,
            texts: prompts
                .iter()
                .map(|p| tokenizer.decode(p))
                .collect::<Result<_, _>>()?,
        })),
        None => None,
    };
    wait_for_warm_up(&engine)?;
    // Warm-up through the same path, as bench_gpu.py warms mlx_lm: min(N, 8) prompts of the
    // measured length at once, 8 tokens each, so the measured run meets compiled shapes (MLX's
    // CUDA backend spends ~80 ms on the first call of each shape). Their text shares no block
    // with the measured prompts; with a shared prefix, they put it in the prefix cache first.
    let shared = args.shared_prefix_tokens.min(prompts[0].len());
    let draft_tokens = (args.draft.draft_model.as_ref()).map(|_| args.draft.num_draft_tokens);
    let warm_ups = (0..concurrency.min(8))
        .map(|i| {
            let tail = warm_up_tokens(&tokenizer, 3 * i, prompts[0].len() - shared)?;
            let mut request = bench_request([&prompts[0][..shared], &tail[..]].concat(), 8);
            request.params.max_kv_size = args.max_kv_size;
            request.params.num_draft_tokens = draft_tokens;
            if let Some(image) = &image {
                request.prompt = image.chat(&tokenizer.decode(&tail)?);
            }
            // The first constrained request builds the vocabulary's token trie: not measured.
            if i == 0 && args.json_requests > 0 {
                request.params.grammar = Some(Grammar::JsonObject);
            }
            Ok(engine.submit(request)?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for stream in &warm_ups {
        drain(&stream.events)?;
    }

    // With --http the pair (direct, then through the server) runs twice and the second pair is
    // reported: the first warms both paths, so neither meets shapes the other compiled.
    let server = if args.http {
        let runtime = tokio::runtime::Runtime::new()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let url = format!("http://{}/v1/completions", listener.local_addr()?);
        let router = perch_server::router(
            perch_server::ServedModel::new(engine.clone(), HTTP_MODEL),
            perch_server::ServerConfig::new(),
        );
        runtime.spawn(perch_server::serve(listener, router));
        Some((runtime, url))
    } else {
        None
    };
    // Every measured run starts from the same cache: empty but for the shared prefix, which the
    // warm-up put there first (and a request puts there again after the clear).
    let cold_cache = || -> anyhow::Result<()> {
        engine.clear_cache()?;
        if shared > 0 {
            let prefix = prompts[0][..shared + 1].to_vec();
            drain(&engine.submit(bench_request(prefix, 1))?.events)?;
        }
        Ok(())
    };
    let direct_client = Client::Direct {
        engine: &engine,
        options: RequestOptions {
            json_requests: args.json_requests,
            max_kv_size: args.max_kv_size,
            image,
            num_draft_tokens: draft_tokens,
            temperature: args.temperature,
            seed: args.seed,
        },
    };
    // The warm-up's blocks would otherwise stay in the prefix cache and count in the measured
    // peak (four 8,192-token warm-ups hold as much KV as the measured prompts).
    cold_cache()?;
    let mut direct = measure(&engine, &direct_client, &prompts, args.gen_tokens)?;
    let mut http = None;
    if let Some((_, url)) = &server {
        for round in 0..2 {
            if round > 0 {
                cold_cache()?;
                direct = measure(&engine, &direct_client, &prompts, args.gen_tokens)?;
            }
            cold_cache()?;
            let client = Client::Http(url.clone());
            http = Some(measure(&engine, &client, &prompts, args.gen_tokens)?);
        }
    }
    engine.shutdown();
    if let Some(path) = &args.output_ids {
        let ids: Vec<&[u32]> = direct.timelines.iter().map(|t| &t.ids[..]).collect();
        write_ids(path, &ids)?;
    }
    let kv_cache_bytes = engine.limits().kv_cache_bytes;
    let report = report(args, kv_cache_bytes, concurrency, &prompts, &direct);
    print_report("", &report);
    let Some(http) = http else {
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
        return Ok(());
    };
    let through_http = self::report(args, kv_cache_bytes, concurrency, &prompts, &http);
    print_report("through HTTP, ", &through_http);
    let ratio = through_http.generation_tps / report.generation_tps.max(1e-9);
    println!(
        "HTTP / direct: generation {:.3}x, TTFT p50 {:.3}x ({:.1}% of generation throughput {})",
        ratio,
        through_http.ttft_ms_p50 / report.ttft_ms_p50.max(1e-9),
        (1.0 - ratio).abs() * 100.0,
        if ratio < 1.0 {
            "lost"
        } else {
            "gained (noise)"
        }
    );
    if args.json {
        let both = serde_json::json!({
            "direct": report,
            "http": through_http,
            "http_generation_ratio": ratio,
        });
        println!("{both}");
    }
    Ok(())
}

/// The engine's settings for `perch bench` with `concurrency` requests at once: its defaults,
/// with what the command line sets.
pub fn engine_config(args: &BenchArgs, concurrency: usize) -> anyhow::Result<EngineConfig> {
    let mut config = EngineConfig {
        max_running: concurrency,
        ..EngineConfig::default()
    };
    if let Some(mib) = args.kv_cache_mib {
        config.kv_cache_bytes = mib << 20;
    }
    if let Some(n) = args.prefill_batch_size {
        config.prefill_batch_size = n;
    }
    if let Some(n) = args.prefill_token_budget {
        config.prefill_token_budget = n;
    }
    config.slot_attention = args.slot_attention.into();
    if let Some(on) = args.compile_decode {
        config.compile_decode = on;
    }
    if let Some(us) = args.arrival_window_us {
        config.arrival_window = Duration::from_micros(us);
    }
    if let Some(on) = args.idle_warm_up {
        config.idle_warm_up = on;
    }
    config.kv_quantization = args.kv_bits.map(|bits| KvQuantization {
        bits,
        group_size: args.kv_group_size,
    });
    config.prompt_lookup = args.prompt_lookup.config()?;
    if let Some(draft) = &args.draft.draft_model {
        config.draft_model = Some(model_dir::resolve(Some(draft.clone()))?);
    }
    Ok(config)
}

/// Waits until the engine's idle prefill warm-up has run (so that measured requests do not wait
/// for its passes); returns the step times then.
pub fn wait_for_warm_up(engine: &EngineHandle) -> anyhow::Result<StepTimes> {
    let waiting = Instant::now();
    loop {
        let stats = engine.stats()?;
        if stats.warm_ups_left == 0 {
            return Ok(stats.step_times);
        }
        anyhow::ensure!(
            waiting.elapsed() < Duration::from_secs(600),
            "the engine's warm-up did not end within 10 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `--first-prompts`: waits for the engine's idle warm-up, then sends a request of each length
/// in `lengths`, one at a time, twice (the prefix cache cleared between, so both rounds prefill
/// every prompt), and prints each one's time to first token: the first round meets the
/// engine's prefill shapes (unless warm-up met them), the second round meets them again.
fn first_requests(
    engine: &EngineHandle,
    tokenizer: &Tokenizer,
    lengths: &[usize],
    json: bool,
) -> anyhow::Result<()> {
    let warm_up = wait_for_warm_up(engine)?;
    println!(
        "warm-up: {} shapes in {:.2} s",
        warm_up.warm_up_shapes, warm_up.warm_up_seconds
    );
    let mut ttft_ms = vec![Vec::new(), Vec::new()];
    for round in &mut ttft_ms {
        engine.clear_cache()?;
        for (i, &len) in lengths.iter().enumerate() {
            anyhow::ensure!(len > 0, "--first-prompts lengths must be at least 1");
            let prompt = filler_tokens(tokenizer, 1 + 3 * i, len)?;
            let timeline = direct(
                engine,
                &[prompt],
                2,
                RequestOptions::default(),
                Instant::now(),
            )?
            .remove(0);
            let first = timeline
                .tokens
                .first()
                .context("a request ended without a token")?;
            round.push(first.duration_since(timeline.submitted).as_secs_f64() * 1e3);
        }
    }
    println!("prompt tokens | TTFT first ms | TTFT again ms");
    for (i, len) in lengths.iter().enumerate() {
        println!("{len} | {:.1} | {:.1}", ttft_ms[0][i], ttft_ms[1][i]);
    }
    if json {
        let rows: Vec<_> = lengths
            .iter()
            .enumerate()
            .map(|(i, len)| {
                serde_json::json!({
                    "prompt_tokens": len,
                    "ttft_ms_first": ttft_ms[0][i],
                    "ttft_ms_again": ttft_ms[1][i],
                })
            })
            .collect();
        let report = serde_json::json!({
            "warm_up_shapes": warm_up.warm_up_shapes,
            "warm_up_seconds": warm_up.warm_up_seconds,
            "first_prompts": rows,
        });
        println!("{report}");
    }
    Ok(())
}

/// The measured prompts: `--prompt-ids`, or filler text with `--shared-prefix-tokens` in common
/// and each prompt's own rest from filler offset `1 + 3 i`.
fn make_prompts(
    args: &BenchArgs,
    tokenizer: &Tokenizer,
    concurrency: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    if let Some(path) = &args.prompt_ids {
        let prompts: Vec<Vec<u32>> = serde_json::from_str(&std::fs::read_to_string(path)?)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{}: expected an array of {concurrency} token-id arrays: {e}",
                    path.display()
                )
            })?;
        anyhow::ensure!(
            prompts.len() == concurrency,
            "{} holds {} prompts, not {concurrency}",
            path.display(),
            prompts.len()
        );
        return Ok(prompts);
    }
    anyhow::ensure!(
        args.shared_prefix_tokens < args.prompt_tokens,
        "--shared-prefix-tokens must be smaller than --prompt-tokens"
    );
    let shared = filler_tokens(tokenizer, 0, args.shared_prefix_tokens)?;
    (0..concurrency)
        .map(|i| {
            let unique = filler_tokens(tokenizer, 1 + 3 * i, args.prompt_tokens - shared.len())?;
            Ok([shared.clone(), unique].concat())
        })
        .collect()
}

/// One measured run: its start, each request's timeline, the engine's step times before and
/// after, and the peak memory.
struct Measured {
    start: Instant,
    timelines: Vec<Timeline>,
    before: StepTimes,
    after: StepTimes,
    peak: usize,
}

/// Runs `prompts` at once through `client`, `gen_tokens` each (end of sequence ignored).
fn measure(
    engine: &EngineHandle,
    client: &Client,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
) -> anyhow::Result<Measured> {
    let before = engine.stats()?.step_times;
    reset_peak_memory();
    let start = Instant::now();
    let timelines = match client {
        Client::Direct { engine, options } => {
            direct(engine, prompts, gen_tokens, options.clone(), start)?
        }
        Client::Http(url) => over_http(url, prompts, gen_tokens, start)?,
    };
    let peak = memory_stats().peak_bytes;
    let after = engine.stats()?.step_times;
    Ok(Measured {
        start,
        timelines,
        before,
        after,
        peak,
    })
}

pub fn bench_request(prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = max_tokens;
    params.ignore_eos = true;
    EngineRequest {
        prompt: Prompt::Tokens(prompt),
        params,
    }
}

/// Every prompt submitted to the engine at once; streams read concurrently, so timestamps are
/// exact.
fn direct(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    options: RequestOptions,
    start: Instant,
) -> anyhow::Result<Vec<Timeline>> {
    let streams = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut request = bench_request(p.clone(), gen_tokens);
            options.apply(i, &mut request);
            engine.submit(request)
        })
        .collect::<Result<Vec<_>, _>>()?;
    std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .into_iter()
            .map(|stream| {
                scope.spawn(move || -> anyhow::Result<Timeline> {
                    let mut timeline = Timeline::new(start);
                    loop {
                        match stream.events.recv_timeout(Duration::from_secs(3600)) {
                            Ok(EngineEvent::Token { id: Some(id), .. }) => {
                                timeline.tokens.push(Instant::now());
                                timeline.ids.push(id);
                                timeline.generated += 1;
                            }
                            Ok(
                                EngineEvent::Token { id: None, .. } | EngineEvent::Admitted { .. },
                            ) => {}
                            Ok(EngineEvent::Finished {
                                finish_reason: FinishReason::Error,
                                error,
                                ..
                            }) => {
                                anyhow::bail!(
                                    "a benchmark request failed: {}",
                                    error.map(|e| e.message).unwrap_or_default()
                                )
                            }
                            Ok(EngineEvent::Finished { stats, .. }) => {
                                timeline.prompt_tokens = stats.prompt_tokens;
                                timeline.cached_prompt_tokens = stats.cached_prompt_tokens;
                                return Ok(timeline);
                            }
                            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                                anyhow::bail!("the engine stopped answering")
                            }
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread"))
            .collect()
    })
}

/// Every prompt sent at once as a streamed `POST /v1/completions` (greedy, end of sequence
/// ignored, usage asked), one client thread each.
fn over_http(
    url: &str,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    start: Instant,
) -> anyhow::Result<Vec<Timeline>> {
    use std::io::BufRead;
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .http_status_as_error(false)
        .build()
        .into();
    std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|prompt| {
                let agent = agent.clone();
                scope.spawn(move || -> anyhow::Result<Timeline> {
                    let body = serde_json::json!({
                        "model": HTTP_MODEL, "prompt": prompt, "max_tokens": gen_tokens,
                        "temperature": 0, "ignore_eos": true, "stream": true,
                        "stream_options": {"include_usage": true},
                    });
                    let response = agent.post(url).send_json(&body)?;
                    anyhow::ensure!(
                        response.status() == 200,
                        "the server answered {}",
                        response.status()
                    );
                    let mut timeline = Timeline::new(start);
                    let reader = std::io::BufReader::new(response.into_body().into_reader());
                    for line in reader.lines() {
                        let line = line?;
                        let Some(data) = line.strip_prefix("data: ") else {
                            continue;
                        };
                        if data == "[DONE]" {
                            break;
                        }
                        let chunk: serde_json::Value = serde_json::from_str(data)?;
                        if let Some(error) = chunk.get("error") {
                            anyhow::bail!("a benchmark request failed: {error}");
                        }
                        if chunk["choices"][0]["text"]
                            .as_str()
                            .is_some_and(|t| !t.is_empty())
                        {
                            timeline.tokens.push(Instant::now());
                        }
                        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
                            let count = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as usize;
                            timeline.generated = count(&usage["completion_tokens"]);
                            timeline.prompt_tokens = count(&usage["prompt_tokens"]);
                            timeline.cached_prompt_tokens =
                                count(&usage["prompt_tokens_details"]["cached_tokens"]);
                        }
                    }
                    Ok(timeline)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    })
}

/// The numbers of one measured run.
fn report(
    args: &BenchArgs,
    kv_cache_bytes: usize,
    concurrency: usize,
    prompts: &[Vec<u32>],
    measured: &Measured,
) -> BatchReport {
    let Measured {
        start,
        timelines,
        before,
        after,
        peak,
    } = measured;
    let (start, before, after, peak) = (*start, *before, *after, *peak);
    let step_seconds = after.step_seconds - before.step_seconds;
    let prefill_seconds = after.prefill_seconds - before.prefill_seconds;
    let decode_seconds = after.decode_seconds - before.decode_seconds;
    let decode_steps = after.decode_steps - before.decode_steps;

    let secs = |a: Instant, b: Instant| b.duration_since(a).as_secs_f64();
    let firsts: Vec<Instant> = timelines
        .iter()
        .filter_map(|t| t.tokens.first().copied())
        .collect();
    let last = timelines
        .iter()
        .filter_map(|t| t.tokens.last().copied())
        .max()
        .unwrap_or(start);
    let first_min = firsts.iter().min().copied().unwrap_or(start);
    let first_max = firsts.iter().max().copied().unwrap_or(start);
    let mut ttft: Vec<f64> = timelines
        .iter()
        .filter_map(|t| t.tokens.first().map(|f| secs(t.submitted, *f) * 1e3))
        .collect();
    let mut itl: Vec<f64> = timelines
        .iter()
        .flat_map(|t| {
            t.tokens
                .windows(2)
                .map(|w| secs(w[0], w[1]) * 1e3)
                .collect::<Vec<_>>()
        })
        .collect();
    let generated: usize = timelines.iter().map(|t| t.generated).sum();
    // Seconds over the measured run's decode steps, in milliseconds per step.
    let per_step_ms = |seconds: f64| seconds * 1e3 / decode_steps.max(1) as f64;
    BatchReport {
        backend: Backend::current(),
        kv_cache_bytes,
        concurrency,
        // A request's prompt as the engine counted it (a chat's template and image tokens in).
        prompt_tokens: timelines
            .first()
            .map(|t| t.prompt_tokens)
            .filter(|&n| n > 0)
            .unwrap_or(prompts[0].len()),
        shared_prefix_tokens: args.shared_prefix_tokens,
        generation_tokens: args.gen_tokens,
        prompt_tps: match timelines.iter().map(|t| t.prompt_tokens).sum::<usize>() {
            0 => prompts.iter().map(Vec::len).sum::<usize>(),
            counted => counted,
        } as f64
            / secs(start, first_max).max(1e-9),
        generation_tps: generated.saturating_sub(firsts.len()) as f64
            / secs(first_min, last).max(1e-9),
        wall_tps: generated as f64 / secs(start, last).max(1e-9),
        ttft_ms_p50: percentile(&mut ttft, 0.50),
        ttft_ms_p95: percentile(&mut ttft, 0.95),
        itl_ms_p50: percentile(&mut itl, 0.50),
        itl_ms_p95: percentile(&mut itl, 0.95),
        peak_memory_bytes: peak,
        prefix_cache_hit_rate: timelines
            .iter()
            .map(|t| t.cached_prompt_tokens)
            .sum::<usize>() as f64
            / timelines
                .iter()
                .map(|t| t.prompt_tokens)
                .sum::<usize>()
                .max(1) as f64,
        engine_prefill_tps: (after.prefill_tokens - before.prefill_tokens) as f64
            / prefill_seconds.max(1e-9),
        engine_prefill_passes: after.prefill_passes - before.prefill_passes,
        engine_prefill_ms: prefill_seconds * 1e3,
        engine_publish_ms: (after.publish_seconds - before.publish_seconds) * 1e3,
        engine_decode_step_ms: per_step_ms(decode_seconds),
        engine_decode_wait_ms: per_step_ms(after.decode_wait_seconds - before.decode_wait_seconds),
        engine_token_ms: per_step_ms(after.token_seconds - before.token_seconds),
        engine_decode_build_ms: per_step_ms(
            after.decode_build_seconds - before.decode_build_seconds,
        ),
        engine_schedule_ms: (after.schedule_seconds - before.schedule_seconds) * 1e3
            / (after.steps - before.steps).max(1) as f64,
        engine_publish_step_ms: (after.publish_seconds - before.publish_seconds) * 1e3
            / (after.steps - before.steps).max(1) as f64,
        engine_steps: after.steps - before.steps,
        engine_other_share: 1.0 - (prefill_seconds + decode_seconds) / step_seconds.max(1e-9),
        engine_verify_steps: after.verify_steps - before.verify_steps,
        engine_draft_ms: (after.draft_seconds - before.draft_seconds) * 1e3
            / (after.verify_steps - before.verify_steps).max(1) as f64,
        engine_draft_tokens: after.draft_tokens - before.draft_tokens,
        engine_accepted_draft_tokens: after.accepted_draft_tokens - before.accepted_draft_tokens,
    }
}

fn print_report(label: &str, report: &BatchReport) {
    println!(
        "{label}{} concurrent: prompt {:.1} tok/s | generation {:.1} tok/s | TTFT p50 {:.0} ms p95 {:.0} ms | ITL p50 {:.0} ms p95 {:.0} ms | peak {:.1} MB | prefix hit {:.0}%",
        report.concurrency,
        report.prompt_tps,
        report.generation_tps,
        report.ttft_ms_p50,
        report.ttft_ms_p95,
        report.itl_ms_p50,
        report.itl_ms_p95,
        report.peak_memory_bytes as f64 / 1e6,
        report.prefix_cache_hit_rate * 100.0
    );
    println!(
        "engine: {} steps, prefill {:.1} tok/s in its forward passes ({} passes, {:.1} ms), publishing full blocks {:.1} ms in all, decode step {:.2} ms (building {:.2} ms, waiting {:.2} ms), tokens to requests {:.2} ms a step, {:.0}% of step time outside forward passes (a step: planning and admitting {:.2} ms, publishing blocks {:.2} ms)",
        report.engine_steps,
        report.engine_prefill_tps,
        report.engine_prefill_passes,
        report.engine_prefill_ms,
        report.engine_publish_ms,
        report.engine_decode_step_ms,
        report.engine_decode_build_ms,
        report.engine_decode_wait_ms,
        report.engine_token_ms,
        report.engine_other_share * 100.0,
        report.engine_schedule_ms,
        report.engine_publish_step_ms
    );
    if report.engine_verify_steps > 0 {
        println!(
            "speculative decoding: {} verify steps ({:.2} ms of each the draft's proposals), {} \
             of {} proposed tokens accepted ({:.0}%)",
            report.engine_verify_steps,
            report.engine_draft_ms,
            report.engine_accepted_draft_tokens,
            report.engine_draft_tokens,
            100.0 * report.engine_accepted_draft_tokens as f64
                / report.engine_draft_tokens.max(1) as f64
        );
    }
}

fn drain(events: &std::sync::mpsc::Receiver<EngineEvent>) -> anyhow::Result<()> {
    loop {
        match events.recv()? {
            EngineEvent::Finished {
                finish_reason: FinishReason::Error,
                error,
                ..
            } => {
                anyhow::bail!(
                    "warm-up failed: {}",
                    error.map(|e| e.message).unwrap_or_default()
                )
            }
            EngineEvent::Finished { .. } => return Ok(()),
            EngineEvent::Token { .. } | EngineEvent::Admitted { .. } => {}
        }
    }
}

/// The `q` quantile (nearest rank) of `values`; 0 when empty.
pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}
