//! The engine thread through its handle: concurrent submissions produce the same tokens as
//! direct generation, cancel works for running and waiting requests, bad requests end with an
//! `Error` event, and stats report the queue.

mod common;

use std::time::Duration;

use perch_engine::api::ErrorKind;
use perch_engine::{
    EngineConfig, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenerateRequest,
    KeepAlive, Prompt, RequestStream, Residency,
};

fn engine() -> EngineHandle {
    engine_with(EngineConfig::default())
}

fn engine_with(config: EngineConfig) -> EngineHandle {
    EngineHandle::load(&common::model_dir(), config).unwrap()
}

fn request(prompt: Prompt, max_tokens: usize) -> EngineRequest {
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = max_tokens;
    EngineRequest { prompt, params }
}

/// Collects a stream: token ids and the final event.
fn collect(stream: RequestStream) -> (Vec<u32>, FinishReason, Option<String>) {
    let mut ids = Vec::new();
    loop {
        match stream
            .events
            .recv_timeout(Duration::from_secs(300))
            .expect("engine answered")
        {
            EngineEvent::Token { id, .. } => ids.extend(id),
            EngineEvent::Admitted { .. } => {}
            EngineEvent::Finished {
                finish_reason,
                error,
                ..
            } => return (ids, finish_reason, error.map(|e| e.message)),
        }
    }
}

/// Whether the stream's next event (within two minutes) is a token.
/// Whether the stream's next event past its admission is a token.
fn next_is_token(stream: &RequestStream) -> bool {
    loop {
        match stream
            .events
            .recv_timeout(Duration::from_secs(120))
            .expect("engine answered")
        {
            EngineEvent::Admitted { .. } => continue,
            event => return matches!(event, EngineEvent::Token { .. }),
        }
    }
}

#[test]
fn concurrent_submissions_match_the_reference() {
    let engine = engine();
    let cases: Vec<_> = common::reference_cases()
        .into_iter()
        .filter(|c| ["multi-turn", "raw-text", "haiku"].contains(&c.id.as_str()))
        .collect();
    // Submit from several threads at once: the handle is Clone + Send.
    let streams: Vec<_> = cases
        .iter()
        .map(|case| {
            let (engine, case) = (engine.clone(), case.clone());
            std::thread::spawn(move || {
                let prompt = match common::chat_messages(&case) {
                    Some(messages) => Prompt::Chat(messages),
                    None => Prompt::Tokens(case.prompt_ids.clone()),
                };
                engine
                    .submit(request(prompt, common::reference().max_tokens))
                    .unwrap()
            })
        })
        .map(|t| t.join().unwrap())
        .collect();
    for (case, stream) in cases.iter().zip(streams) {
        let (ids, reason, error) = collect(stream);
        assert_eq!(error, None);
        assert_eq!(ids, common::expected_ids(case, reason), "case {}", case.id);
    }
    let stats = engine.stats().unwrap();
    assert_eq!(
        (stats.running, stats.waiting, stats.finished_requests),
        (0, 0, 3)
    );
    engine.shutdown();
}

#[test]
fn cancel_running_and_waiting_requests() {
    // MLX holds at least every weight of the model (its file less the JSON header) while a
    // request runs; other tests' models in this process can only add to the count. Read before
    // the requests start: the cancel below must follow the stats at once.
    let weights = std::fs::read(common::model_dir().join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let tensor_bytes = weights.len() - 8 - header;
    drop(weights);
    // One request at a time, so the second one waits.
    let engine = engine_with(EngineConfig {
        max_running: 1,
        ..EngineConfig::default()
    });
    let long = |n| request(Prompt::Tokens(vec![1, 504, 2988, 288]), n);
    let running = engine.submit(long(500)).unwrap();
    let waiting = engine.submit(long(500)).unwrap();
    // Wait for the first request to produce two tokens, then look at the queue.
    for _ in 0..2 {
        assert!(next_is_token(&running));
    }
    let stats = engine.stats().unwrap();
    assert_eq!((stats.running, stats.waiting), (1, 1));
    assert!(
        stats.memory.active_bytes >= tensor_bytes,
        "MLX active memory {} < the model's {tensor_bytes} bytes of weights",
        stats.memory.active_bytes
    );

    engine.cancel(waiting.id);
    engine.cancel(running.id);
    let (rest, reason, _) = collect(running);
    assert_eq!(reason, FinishReason::Cancelled);
    assert!(
        rest.len() <= 2,
        "stopped within a token or two, got {} more",
        rest.len()
    );
    let (ids, reason, _) = collect(waiting);
    assert_eq!((ids.len(), reason), (0, FinishReason::Cancelled));
    engine.shutdown();
}

#[test]
fn dropping_the_last_handle_stops_the_engine_thread_first() {
    // A process that returns from `main` without `shutdown` (after an error, say) must not exit
    // with the engine thread mid-step (on CUDA the driver's teardown then aborts it).
    let engine = engine();
    let stream = engine
        .submit(request(Prompt::Tokens(vec![1, 504, 2988, 288]), 500))
        .unwrap();
    // Admitted first, with what its prompt read from the prefix cache (less than a block: no
    // miss to explain).
    match stream
        .events
        .recv_timeout(Duration::from_secs(120))
        .unwrap()
    {
        EngineEvent::Admitted { prompt_cache } => {
            assert_eq!(prompt_cache.prompt_tokens, 4);
            assert_eq!((prompt_cache.cached_tokens, prompt_cache.miss), (0, None));
        }
        event => panic!("{event:?}"),
    }
    assert!(next_is_token(&stream));
    let clone = engine.clone();
    drop(engine);
    // Another handle is left: the engine goes on.
    assert!(next_is_token(&stream));
    drop(clone);
    // The thread has ended by now: what it sent is there, ending with the request cancelled,
    // and nothing more can come (no wait: the channel is closed).
    let mut finished = None;
    loop {
        match stream.events.try_recv() {
            Ok(EngineEvent::Token { .. } | EngineEvent::Admitted { .. }) => {}
            Ok(EngineEvent::Finished { finish_reason, .. }) => finished = Some(finish_reason),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            Err(std::sync::mpsc::TryRecvError::Empty) => {
                panic!("the engine thread still runs after its last handle was dropped")
            }
        }
    }
    assert_eq!(finished, Some(FinishReason::Cancelled));
}

#[test]
fn idle_warm_up_changes_no_output_and_no_cache() {
    // The GPU path (slot caches) with the idle warm-up forced on: a request submitted at once
    // runs while passes are still queued, and one after they all ran reads the same tokens.
    let config = EngineConfig {
        idle_warm_up: true,
        prefill_token_budget: 64,
        prefill_batch_size: 2,
        max_running: 4,
        kv_cache_bytes: 256 << 20,
        ..EngineConfig::default()
    };
    // Positions within a quarter of the pool: 256 MiB of float32 SmolLM2 KV is 182 blocks of 32
    // tokens, so 1,456 positions (prefill passes up to 4 x 64, decode steps at 512 to 1,280).
    let shapes = perch_engine::testing::prefill_warm_up_shapes(64, 2, 1456).len()
        + perch_engine::testing::decode_warm_up_positions(1456).len();
    let engine = engine_with(config);
    let case = common::reference_cases()
        .into_iter()
        .find(|c| c.id == "multi-turn")
        .unwrap();
    let messages = || Prompt::Chat(common::chat_messages(&case).unwrap());
    let max_tokens = common::reference().max_tokens;
    let (ids, reason, error) = collect(engine.submit(request(messages(), max_tokens)).unwrap());
    assert_eq!(error, None);
    assert_eq!(ids, common::expected_ids(&case, reason));
    let blocks = engine.stats().unwrap().kv_cache.blocks_cached_free;
    // The rest of the queue runs while idle (each pass is a few milliseconds on CPU).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let stats = loop {
        let stats = engine.stats().unwrap();
        if stats.warm_ups_left == 0 {
            break stats;
        }
        assert!(std::time::Instant::now() < deadline, "warm-up never ended");
        std::thread::sleep(Duration::from_millis(10));
    };
    // Every queued pass, then the load's decode shapes again (at least one).
    assert!(
        stats.step_times.warm_up_shapes > shapes as u64,
        "{} shapes warmed, {shapes} prefill passes queued",
        stats.step_times.warm_up_shapes
    );
    assert!(stats.step_times.warm_up_seconds > 0.0);
    // Warm-up passes ran on scratch caches: the prefix cache holds the request's blocks only.
    assert_eq!(stats.kv_cache.blocks_cached_free, blocks);
    let (again, reason, _) = collect(engine.submit(request(messages(), max_tokens)).unwrap());
    assert_eq!(again, common::expected_ids(&case, reason));
    assert_eq!(again, ids);
    engine.shutdown();
}

#[test]
fn bad_requests_end_with_an_error_event() {
    let engine = engine();
    let (ids, reason, error) = collect(engine.submit(request(Prompt::Tokens(vec![]), 8)).unwrap());
    assert_eq!((ids.len(), reason), (0, FinishReason::Error));
    assert_eq!(error.as_deref(), Some("the prompt is empty"));
    let (_, reason, error) = collect(
        engine
            .submit(request(Prompt::Tokens(vec![1; 9000]), 8))
            .unwrap(),
    );
    assert_eq!(reason, FinishReason::Error);
    assert!(error.unwrap().contains("9000 tokens"));
    // Both were refused before running, with the kind of the request's fault (an API answers
    // 400 and OpenAI's `context_length_exceeded` for the second), which a normal end has none of.
    let kind = |prompt: Prompt| {
        let stream = engine.submit(request(prompt, 3)).unwrap();
        loop {
            match stream
                .events
                .recv_timeout(Duration::from_secs(300))
                .unwrap()
            {
                EngineEvent::Finished { error, .. } => return error.map(|e| e.kind),
                EngineEvent::Token { .. } | EngineEvent::Admitted { .. } => {}
            }
        }
    };
    assert_eq!(
        kind(Prompt::Tokens(vec![])),
        Some(ErrorKind::InvalidRequest)
    );
    assert_eq!(
        kind(Prompt::Tokens(vec![1; 9000])),
        Some(ErrorKind::ContextLengthExceeded)
    );
    assert_eq!(kind(Prompt::Tokens(vec![1, 504])), None);
    // The engine keeps serving after errors.
    let (ids, reason, _) = collect(
        engine
            .submit(request(Prompt::Tokens(vec![1, 504]), 3))
            .unwrap(),
    );
    assert_eq!((ids.len(), reason), (3, FinishReason::Length));
    engine.shutdown();
    assert!(
        engine.submit(request(Prompt::Tokens(vec![1]), 1)).is_err(),
        "a stopped engine refuses work"
    );
}

#[test]
fn a_model_that_fails_to_load_is_an_error_not_a_thread() {
    let err = EngineHandle::load(
        std::path::Path::new("/nonexistent"),
        EngineConfig::default(),
    )
    .err()
    .expect("load fails");
    assert!(
        err.to_string().contains("/nonexistent/config.json"),
        "{err}"
    );
}

#[test]
fn requests_run_together_and_leave_when_done() {
    let engine = engine();
    let short = engine
        .submit(request(Prompt::Tokens(vec![1, 504, 2988]), 3))
        .unwrap();
    let long = engine
        .submit(request(Prompt::Tokens(vec![1, 788, 260]), 40))
        .unwrap();
    assert!(next_is_token(&long));
    let (ids, reason, _) = collect(short);
    assert_eq!((ids.len(), reason), (3, FinishReason::Length));
    // The short request has left; the long one is still generating, nothing waits.
    let stats = engine.stats().unwrap();
    assert_eq!((stats.running, stats.waiting), (1, 0));
    // Windowed rates: 6 prompt tokens and at least 4 generated in the last seconds.
    assert!(
        stats.prompt_tps > 0.0 && stats.generation_tps > 0.0,
        "{stats:?}"
    );
    engine.cancel(long.id);
    assert_eq!(collect(long).1, FinishReason::Cancelled);
    engine.shutdown();
}

#[test]
fn tokens_carry_the_log_probabilities_asked_for() {
    let engine = engine();
    let case = &common::reference_cases()[0];
    let mut asked = request(Prompt::Tokens(case.prompt_ids.clone()), 6);
    asked.params.logprobs = Some(3);
    let stream = engine.submit(asked.clone()).unwrap();
    let mut streamed = Vec::new();
    loop {
        match stream
            .events
            .recv_timeout(Duration::from_secs(300))
            .unwrap()
        {
            EngineEvent::Token {
                id: Some(id),
                logprobs,
                ..
            } => streamed.push((id, logprobs.expect("asked for logprobs"))),
            EngineEvent::Token { id: None, .. } | EngineEvent::Admitted { .. } => {}
            EngineEvent::Finished { .. } => break,
        }
    }
    assert!(!streamed.is_empty());
    for (id, lp) in &streamed {
        // Greedy: the sampled token is the most likely one.
        assert_eq!(lp.top.len(), 3);
        assert_eq!((lp.top[0].0, lp.top[0].1), (*id, lp.logprob));
        assert!(
            lp.top.windows(2).all(|w| w[0].1 >= w[1].1),
            "sorted: {:?}",
            lp.top
        );
        let mass: f32 = lp.top.iter().map(|(_, v)| v.exp()).sum();
        assert!(lp.logprob <= 0.0 && mass <= 1.0 + 1e-5, "{lp:?}");
    }

    // The single-stream path reports the same numbers.
    let (model, tokenizer) = (
        perch_engine::models::load(&common::model_dir()).unwrap(),
        perch_engine::Tokenizer::load(&common::model_dir()).unwrap(),
    );
    let mut direct = Vec::new();
    let mut params = asked.params.clone();
    params.prompt = case.prompt_ids.clone();
    perch_engine::generate(model.as_ref(), &tokenizer, &params, |event| {
        if let (Some(id), Some(lp)) = (event.id, event.logprobs.clone()) {
            direct.push((id, lp));
        }
        std::ops::ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(direct.len(), streamed.len());
    for ((a_id, a), (b_id, b)) in direct.iter().zip(&streamed) {
        assert_eq!(a_id, b_id);
        assert!((a.logprob - b.logprob).abs() < 1e-4, "{a:?} vs {b:?}");
    }

    // Not asked: none.
    let mut plain = request(Prompt::Tokens(case.prompt_ids.clone()), 2);
    plain.params.logprobs = None;
    let stream = engine.submit(plain).unwrap();
    while let EngineEvent::Token { logprobs, .. } = stream
        .events
        .recv_timeout(Duration::from_secs(300))
        .unwrap()
    {
        assert!(logprobs.is_none());
    }
}

#[test]
fn load_reports_progress_over_the_weight_files() {
    let reports = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = std::sync::Arc::clone(&reports);
    let engine =
        EngineHandle::load_with_progress(&common::model_dir(), EngineConfig::default(), move |p| {
            sink.lock().unwrap().push(p)
        })
        .unwrap();
    let total: u64 = std::fs::read_dir(common::model_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| p.metadata().unwrap().len())
        .sum();
    let reports = reports.lock().unwrap();
    assert!(
        reports.len() > 10,
        "one report per tensor: {}",
        reports.len()
    );
    assert_eq!((reports[0].bytes_read, reports[0].bytes_total), (0, total));
    assert_eq!(reports.last().unwrap().bytes_read, total);
    assert!(reports
        .windows(2)
        .all(|w| w[0].bytes_read <= w[1].bytes_read
            && w[1].bytes_read <= w[1].bytes_total
            && w[1].bytes_total == total));
    // Most of the file is tensor data: the reports move through it, not only at the end.
    let halfway = reports.iter().filter(|p| p.bytes_read * 2 >= total).count();
    assert!(halfway < reports.len() - 1, "progress jumped to the end");
    engine.shutdown();
}

#[test]
fn a_burst_reaching_an_idle_engine_is_prefilled_in_one_pass() {
    // Four requests submitted 2 ms apart, as a client's fan-out arrives: with an arrival window
    // longer than the gaps they share one prefill pass; the window's cap (4x) is 80 ms here.
    let engine = engine_with(EngineConfig {
        prefill_batch_size: 8,
        arrival_window: Duration::from_millis(20),
        ..EngineConfig::default()
    });
    let before = engine.stats().unwrap().step_times;
    let streams: Vec<_> = (0..4u32)
        .map(|k| {
            std::thread::sleep(Duration::from_millis(2));
            let mut request = request(Prompt::Tokens(vec![1, 2, 3, 40 + k, 5, 6]), 2);
            request.params.ignore_eos = true;
            engine.submit(request).unwrap()
        })
        .collect();
    for stream in streams {
        let (ids, reason, error) = collect(stream);
        assert_eq!((ids.len(), reason, error), (2, FinishReason::Length, None));
    }
    let after = engine.stats().unwrap().step_times;
    assert_eq!(
        after.prefill_passes - before.prefill_passes,
        1,
        "the burst's prompts in one prefill pass"
    );
    engine.shutdown();
}

#[test]
fn stats_and_cancel_do_not_wait_for_a_slow_step() {
    let step = Duration::from_millis(1500);
    let engine = engine_with(EngineConfig {
        fault_injection: perch_engine::FaultInjection {
            step_delay: step,
            panic_at_step: None,
        },
        ..EngineConfig::default()
    });
    let stream = engine
        .submit(request(Prompt::Tokens(vec![1, 504, 2988]), 50))
        .unwrap();
    // The engine is inside its first (1.5 s) step now.
    std::thread::sleep(Duration::from_millis(200));
    let started = std::time::Instant::now();
    let stats = engine.stats().unwrap();
    engine.cancel(stream.id);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(500),
        "stats and cancel took {waited:?} during a {step:?} step"
    );
    assert_eq!(stats.finished_requests, 0);
    let (ids, reason, _) = collect(stream);
    assert_eq!(reason, FinishReason::Cancelled);
    assert!(ids.len() <= 1, "{ids:?}");
    assert_eq!(engine.stats().unwrap().finished_requests, 1);
    engine.shutdown();
    assert!(engine.stats().is_err(), "a stopped engine has no stats");
}

#[test]
fn a_panic_mid_stream_ends_every_request_with_an_error_and_the_engine_goes_on() {
    let ask = || {
        let mut r = request(Prompt::Tokens(vec![1, 504, 2988, 288]), 12);
        r.params.ignore_eos = true;
        r
    };
    let healthy = engine();
    let (expected, reason, _) = collect(healthy.submit(ask()).unwrap());
    assert_eq!(reason, FinishReason::Length);
    healthy.shutdown();

    let engine = engine_with(EngineConfig {
        fault_injection: perch_engine::FaultInjection {
            step_delay: Duration::ZERO,
            panic_at_step: Some(4),
        },
        ..EngineConfig::default()
    });
    let streams = [engine.submit(ask()).unwrap(), engine.submit(ask()).unwrap()];
    for stream in streams {
        let (ids, reason, error) = collect(stream);
        assert_eq!(reason, FinishReason::Error, "{ids:?}");
        assert!(!ids.is_empty() && ids.len() < 12, "{ids:?}");
        let error = error.expect("an error message");
        assert!(
            error.contains("the engine failed") && error.contains("fault injected at step 4"),
            "{error}"
        );
    }
    let stats = engine.stats().unwrap();
    assert_eq!((stats.running, stats.waiting), (0, 0));
    assert_eq!(stats.kv_cache.blocks_used, 0);
    // The same request afterwards: served, and exactly as a healthy engine serves it.
    let (ids, reason, error) = collect(engine.submit(ask()).unwrap());
    assert_eq!((reason, error), (FinishReason::Length, None));
    assert_eq!(ids, expected);
    engine.shutdown();
}

#[test]
fn a_full_queue_answers_busy_at_once() {
    let engine = engine_with(EngineConfig {
        max_running: 1,
        max_queued_requests: 1,
        ..EngineConfig::default()
    });
    let long = || request(Prompt::Tokens(vec![1, 504, 2988, 288]), 500);
    let running = engine.submit(long()).unwrap();
    let waiting = engine.submit(long()).unwrap();
    match engine.submit(long()) {
        Err(perch_engine::EngineError::Busy { limit: 2 }) => {}
        other => panic!("expected Busy, got {:?}", other.map(|s| s.id)),
    }
    engine.cancel(running.id);
    engine.cancel(waiting.id);
    assert_eq!(collect(running).1, FinishReason::Cancelled);
    assert_eq!(collect(waiting).1, FinishReason::Cancelled);
    // Room again once they have ended.
    let (ids, reason, _) = collect(
        engine
            .submit(request(Prompt::Tokens(vec![1, 504]), 2))
            .unwrap(),
    );
    assert_eq!((ids.len(), reason), (2, FinishReason::Length));
    engine.shutdown();
}

/// Waits up to a minute for the engine's published residency to be `want`.
fn reaches(engine: &EngineHandle, want: Residency) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if engine.stats().unwrap().residency == want {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn with_keep_alive(prompt: Prompt, max_tokens: usize, keep_alive: KeepAlive) -> EngineRequest {
    let mut request = request(prompt, max_tokens);
    request.params.keep_alive = Some(keep_alive);
    request
}

#[test]
fn an_idle_engine_unloads_its_model_and_loads_it_again_for_the_next_request() {
    let engine = engine_with(EngineConfig {
        keep_alive: KeepAlive::Idle(Duration::from_secs(1)),
        ..EngineConfig::default()
    });
    let prompt = Prompt::Tokens(vec![1, 504, 2988]);
    let (first, reason, error) = collect(engine.submit(request(prompt.clone(), 8)).unwrap());
    assert_eq!((reason, error), (FinishReason::Length, None));
    assert!(
        reaches(&engine, Residency::Unloaded),
        "unloaded after an idle second"
    );
    // The handle still serves: the next request loads the model again and gets the same ids.
    let (again, reason, error) = collect(engine.submit(request(prompt, 8)).unwrap());
    assert_eq!((reason, error), (FinishReason::Length, None));
    assert_eq!(again, first);
    assert!(reaches(&engine, Residency::Unloaded), "and unloads again");
    engine.shutdown();
}

#[test]
fn a_request_keep_alive_of_zero_unloads_at_once_and_a_negative_one_keeps_the_model() {
    let engine = engine();
    let prompt = Prompt::Tokens(vec![1, 504, 2988]);
    let unload_now = KeepAlive::parse("0").unwrap();
    let (first, _, error) = collect(
        engine
            .submit(with_keep_alive(prompt.clone(), 4, unload_now))
            .unwrap(),
    );
    assert_eq!(error, None);
    assert!(reaches(&engine, Residency::Unloaded));
    let forever = KeepAlive::parse("-1").unwrap();
    let (again, _, error) = collect(engine.submit(with_keep_alive(prompt, 4, forever)).unwrap());
    assert_eq!((again, error), (first, None));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(engine.stats().unwrap().residency, Residency::Loaded);
    engine.shutdown();
}

#[test]
fn a_reload_that_fails_ends_the_waiting_request_with_its_reason_and_the_next_one_loads() {
    // A copy of the model whose weights go missing while it is unloaded.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(common::model_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let engine = EngineHandle::load(dir.path(), EngineConfig::default()).unwrap();
    let prompt = Prompt::Tokens(vec![1, 504, 2988]);
    let unload_now = KeepAlive::Idle(Duration::ZERO);
    let (first, _, _) = collect(
        engine
            .submit(with_keep_alive(prompt.clone(), 4, unload_now))
            .unwrap(),
    );
    assert!(reaches(&engine, Residency::Unloaded));
    let weights = dir.path().join("model.safetensors");
    let aside = dir.path().join("aside");
    std::fs::rename(&weights, &aside).unwrap();
    // Two requests meet the failed load; each ends with its reason (one load, not one each).
    let streams = [
        engine.submit(request(prompt.clone(), 4)).unwrap(),
        engine.submit(request(prompt.clone(), 4)).unwrap(),
    ];
    for stream in streams {
        let (ids, reason, error) = collect(stream);
        assert_eq!((ids.len(), reason), (0, FinishReason::Error));
        let error = error.unwrap();
        assert!(
            error.contains("could not be loaded again") && error.contains("safetensors"),
            "{error}"
        );
    }
    assert_eq!(engine.stats().unwrap().residency, Residency::Unloaded);
    std::fs::rename(&aside, &weights).unwrap();
    let (again, reason, error) = collect(engine.submit(request(prompt, 4)).unwrap());
    assert_eq!((again, reason, error), (first, FinishReason::Length, None));
    engine.shutdown();
}

#[test]
fn keep_alive_reads_ollamas_forms() {
    let minutes = |m: u64| KeepAlive::Idle(Duration::from_secs(m * 60));
    assert_eq!(KeepAlive::parse("5m"), Ok(minutes(5)));
    assert_eq!(KeepAlive::parse("1h30m"), Ok(minutes(90)));
    assert_eq!(KeepAlive::parse("300"), Ok(minutes(5)));
    assert_eq!(KeepAlive::parse("0"), Ok(KeepAlive::Idle(Duration::ZERO)));
    assert_eq!(KeepAlive::parse("-1"), Ok(KeepAlive::Forever));
    assert_eq!(KeepAlive::parse("-5m"), Ok(KeepAlive::Forever));
    assert_eq!(KeepAlive::from_seconds(-1.0), Ok(KeepAlive::Forever));
    let error = KeepAlive::parse("soon").unwrap_err();
    assert!(
        error.contains("\"soon\"") && error.contains("-1"),
        "{error}"
    );
    assert!(KeepAlive::parse("-soon").is_err());
    assert!(KeepAlive::from_seconds(f64::NAN).is_err());
    // Past a century (or what a clock holds) is never.
    assert_eq!(KeepAlive::from_seconds(1e19), Ok(KeepAlive::Forever));
    assert_eq!(
        KeepAlive::from_seconds(f64::INFINITY),
        Ok(KeepAlive::Forever)
    );
    assert_eq!(KeepAlive::parse("300000000000y"), Ok(KeepAlive::Forever));
}

/// A keep-alive past what a clock holds is never, not a panic that stops the engine.
#[test]
fn an_enormous_keep_alive_keeps_the_model_and_the_engine_serving() {
    let engine = engine_with(EngineConfig {
        keep_alive: KeepAlive::Idle(Duration::MAX),
        ..EngineConfig::default()
    });
    let prompt = Prompt::Tokens(vec![1, 504, 2988]);
    for _ in 0..2 {
        let (_, reason, error) = collect(engine.submit(request(prompt.clone(), 3)).unwrap());
        assert_eq!((reason, error), (FinishReason::Length, None));
    }
    assert_eq!(engine.stats().unwrap().residency, Residency::Loaded);
    engine.shutdown();
}
