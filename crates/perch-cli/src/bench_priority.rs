//! `perch bench --background-prompt-tokens N`: how long a chat waits for its first token while
//! a long background prompt (an agent's) prefills, with and without the chat's lane
//! ([`perch_engine::Priority`]), against the same chat on an idle engine.
//!
//! Each round submits a background request of `N` prompt tokens (the normal lane, one token to
//! generate), waits a third of the time such a prompt takes to its first token alone, then
//! submits a chat of `--prompt-tokens` tokens (`--gen-tokens` to generate) and takes its time
//! to first token. Every prompt is its own (no prefix-cache hit). `--runs` rounds each: the chat
//! in the normal lane behind the background prompt (first come, first served), then the chat
//! alone in the high lane, and in the high lane behind the background prompt (the high lane then
//! active, as while a person chats: see `perch_sched::scheduler::lane_budget`). Medians are
//! reported, with the ratio of each to the idle time.

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use perch_engine::{EngineEvent, EngineHandle, FinishReason, Priority, RequestStream, Tokenizer};
use serde::Serialize;

use crate::bench::{filler_tokens, warm_up_tokens, BenchArgs};
use crate::bench_batch::{bench_request, engine_config, percentile, wait_for_warm_up};
use crate::model_dir;

#[derive(Serialize)]
struct PriorityReport {
    backend: perch_engine::device::Backend,
    background_prompt_tokens: usize,
    chat_prompt_tokens: usize,
    runs: usize,
    /// The background prompt's time to first token alone (the median).
    background_ttft_ms: f64,
    /// The chat's time to first token alone, then behind the background prompt in the high lane
    /// and in the normal lane (medians).
    idle_ttft_ms: f64,
    high_lane_ttft_ms: f64,
    normal_lane_ttft_ms: f64,
    /// `high_lane_ttft_ms / idle_ttft_ms` (the target: at most 2) and the same for the
    /// normal lane.
    high_lane_ratio: f64,
    normal_lane_ratio: f64,
}

pub fn run(args: &BenchArgs, background_tokens: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        background_tokens > 0 && args.prompt_tokens > 0 && args.gen_tokens > 0,
        "--background-prompt-tokens, --prompt-tokens and --gen-tokens must be at least 1"
    );
    let runs = args.runs.max(1);
    let dir = model_dir::resolve(args.model.clone())?;
    let tokenizer = Tokenizer::load(&dir)?;
    let engine = EngineHandle::load(&dir, engine_config(args, 2)?)?;
    let result = measure(args, &engine, &tokenizer, background_tokens, runs);
    engine.shutdown();
    let report = result?;
    println!(
        "background prompt {} tokens: {:.0} ms to its first token alone",
        report.background_prompt_tokens, report.background_ttft_ms
    );
    println!(
        "chat of {} tokens, time to first token (median of {}): idle {:.0} ms | behind the \
         background prompt, high lane {:.0} ms ({:.2}x idle) | normal lane {:.0} ms ({:.2}x idle)",
        report.chat_prompt_tokens,
        report.runs,
        report.idle_ttft_ms,
        report.high_lane_ttft_ms,
        report.high_lane_ratio,
        report.normal_lane_ttft_ms,
        report.normal_lane_ratio
    );
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

fn measure(
    args: &BenchArgs,
    engine: &EngineHandle,
    tokenizer: &Tokenizer,
    background_tokens: usize,
    runs: usize,
) -> anyhow::Result<PriorityReport> {
    wait_for_warm_up(engine)?;
    // Prompts: the chats' from one text, the background's from another, each its own start.
    let mut chats = (0..).map(|i| filler_tokens(tokenizer, i, args.prompt_tokens));
    let mut backgrounds = (0..).map(|i| warm_up_tokens(tokenizer, i, background_tokens));
    let mut chat = |lane: Priority| -> anyhow::Result<_> {
        let mut request = bench_request(chats.next().expect("endless")?, args.gen_tokens);
        request.params.priority = lane;
        Ok(engine.submit(request)?)
    };
    let mut background = || -> anyhow::Result<_> {
        let request = bench_request(backgrounds.next().expect("endless")?, 1);
        Ok(engine.submit(request)?)
    };
    // Normal-lane work first: warm-up (the shapes both meet), the background prompt alone, the
    // chat behind it in the normal lane; then the high lane, idle and behind it (a high lane that
    // ran within `ACTIVE_LANE_WINDOW` shrinks the normal lane's passes, as while a person chats).
    ttft(&chat(Priority::Normal)?.events)?;
    ttft(&background()?.events)?;
    let mut alone = (0..runs)
        .map(|_| ttft(&background()?.events))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let background_ttft = Duration::from_secs_f64(percentile(&mut alone, 0.5));
    let mut normal = behind(runs, background_ttft / 3, &mut background, || {
        chat(Priority::Normal)
    })?;
    let mut idle = (0..runs)
        .map(|_| ttft(&chat(Priority::High)?.events))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut high = behind(runs, background_ttft / 3, &mut background, || {
        chat(Priority::High)
    })?;
    let idle_ms = percentile(&mut idle, 0.5) * 1e3;
    let (high_ms, normal_ms) = (
        percentile(&mut high, 0.5) * 1e3,
        percentile(&mut normal, 0.5) * 1e3,
    );
    Ok(PriorityReport {
        backend: perch_engine::device::Backend::current(),
        background_prompt_tokens: background_tokens,
        chat_prompt_tokens: args.prompt_tokens,
        runs,
        background_ttft_ms: background_ttft.as_secs_f64() * 1e3,
        idle_ttft_ms: idle_ms,
        high_lane_ttft_ms: high_ms,
        normal_lane_ttft_ms: normal_ms,
        high_lane_ratio: high_ms / idle_ms.max(1e-9),
        normal_lane_ratio: normal_ms / idle_ms.max(1e-9),
    })
}

/// `runs` rounds of: a background request, then after `wait` a chat; the chat's times to first
/// token (seconds).
fn behind(
    runs: usize,
    wait: Duration,
    mut background: impl FnMut() -> anyhow::Result<RequestStream>,
    mut chat: impl FnMut() -> anyhow::Result<RequestStream>,
) -> anyhow::Result<Vec<f64>> {
    (0..runs)
        .map(|_| {
            let long = background()?;
            std::thread::sleep(wait);
            let waited = ttft(&chat()?.events)?;
            ttft(&long.events)?;
            Ok(waited)
        })
        .collect()
}

/// Seconds from now (just after submitting) to the request's first token, then reads its
/// stream to the end. `Err` for a request that fails or ends without a token.
fn ttft(events: &Receiver<EngineEvent>) -> anyhow::Result<f64> {
    let submitted = Instant::now();
    let mut first = None;
    loop {
        match events.recv()? {
            EngineEvent::Token { .. } => {
                first.get_or_insert_with(|| submitted.elapsed().as_secs_f64());
            }
            EngineEvent::Finished {
                finish_reason: FinishReason::Error,
                error,
                ..
            } => anyhow::bail!(
                "a request failed: {}",
                error.map(|e| e.message).unwrap_or_default()
            ),
            EngineEvent::Finished { .. } => {
                return first.ok_or_else(|| anyhow::anyhow!("a request ended without a token"))
            }
            EngineEvent::Admitted { .. } => {}
        }
    }
}
