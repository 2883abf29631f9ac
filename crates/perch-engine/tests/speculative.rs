//! Speculative decoding (`generate_speculative`) on the test model. Greedy: with a draft that
//! agrees (the model itself) and one that mostly does not (a tiny random Llama with the same
//! tokenizer, written by mlx_lm), reference cases' ids are mlx_lm's greedy ids without a draft
//! (alone: haiku, and multi-turn with the tiny draft; in the batch: every short case with the
//! model as its draft, four with the tiny one). Sampled: with the same seed, the ids and `from_draft` flags are mlx_lm's
//! `speculative_generate_step`'s, proposals rejected and rewound
//! included, alone and in the batch (beside other rows, the draft proposing in verify steps);
//! since every emitted token is the model's own sample there, the output is distributed as the
//! model's. Also: the stats count what was proposed and accepted, and bad drafts are refused.
//! mlx_lm's sampled runs are `tests/fixtures/smollm2-speculative.json` (`scripts/make_references.py
//! speculative`); the oracle writes the tiny draft.

mod common;

use std::ops::ControlFlow;

use perch_engine::sample::sampler::SamplingParams;
use perch_engine::{
    generate_speculative, models, Draft, FinishReason, GenerateOutput, GenerateRequest, Tokenizer,
};

struct Run {
    ids: Vec<u32>,
    from_draft: Vec<bool>,
    output: GenerateOutput,
}

fn speculate(
    model: &dyn models::Model,
    draft: &dyn models::Model,
    tokenizer: &Tokenizer,
    num_draft_tokens: usize,
    request: &GenerateRequest,
) -> Run {
    let mut ids = Vec::new();
    let mut from_draft = Vec::new();
    let output = generate_speculative(
        model,
        &Draft {
            model: draft,
            tokenizer,
            num_draft_tokens,
        },
        tokenizer,
        request,
        |event| {
            if let Some(id) = event.id {
                ids.push(id);
                from_draft.push(event.from_draft);
            }
            ControlFlow::Continue(())
        },
    )
    .unwrap();
    Run {
        ids,
        from_draft,
        output,
    }
}

/// `tests/fixtures/smollm2-speculative.json` (made on the test model: perch-test-support's
/// standalone test checks its SHA-256).
#[derive(serde::Deserialize)]
struct SpeculativeFixture {
    runs: Vec<SampledRun>,
}

/// One of mlx_lm's seeded `speculative_generate_step` runs, the model drafting for itself.
#[derive(serde::Deserialize)]
struct SampledRun {
    /// A short reference case's id.
    case: String,
    num_draft_tokens: usize,
    seed: u64,
    temp: f32,
    max_tokens: usize,
    ids: Vec<u32>,
    from_draft: Vec<bool>,
}

impl SampledRun {
    /// The run's request: its case's prompt, seed and temperature, `max_tokens` past EOS.
    fn request(&self, short: &[common::ReferenceCase]) -> GenerateRequest {
        let case = short
            .iter()
            .find(|c| c.id == self.case)
            .expect("a short case");
        let mut request = GenerateRequest::new(case.prompt_ids.clone());
        request.max_tokens = self.max_tokens;
        request.ignore_eos = true;
        request.sampling = SamplingParams {
            temperature: self.temp,
            seed: Some(self.seed),
            ..SamplingParams::default()
        };
        request
    }
}

#[test]
fn speculative_decoding_is_mlx_lms() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let short = common::short_reference_cases();

    // Sampled runs mlx_lm made (tests/fixtures/smollm2-speculative.json: three prompts, drafts of
    // 2 to 4 tokens, the model as its own draft, whose proposals, drawn with other keys, are
    // often rejected at temperature 1); the oracle writes the tiny random draft.
    let sampled =
        perch_test_support::fixture_json::<SpeculativeFixture>("smollm2-speculative.json").runs;
    let out = tempfile::tempdir().unwrap();
    common::run_oracle(
        "speculative.py",
        &[out.path().to_str().unwrap(), dir.to_str().unwrap()],
    );
    let tiny = models::load(&out.path().join("llama3-rope")).unwrap();

    // Greedy: mlx_lm's ids without a draft, with either draft.
    let reference = common::reference();
    // (Haiku and multi-turn, which both end at their EOS, with the tiny draft, which rejects
    // most proposals; haiku with the model, whose proposals are accepted. The long prompt's
    // prefill is `generate`'s, checked in reference_parity.rs.)
    for (name, draft, cases) in [
        ("the model itself", model.as_ref(), &short[1..2]),
        ("a random tiny model", tiny.as_ref(), &short[1..3]),
    ] {
        let mut proposed = 0;
        let mut accepted = 0;
        for case in cases {
            let mut request = GenerateRequest::new(case.prompt_ids.clone());
            request.max_tokens = reference.max_tokens;
            request.prefill_step_size = reference.prefill_step_size;
            let run = speculate(model.as_ref(), draft, &tokenizer, 3, &request);
            let stopped = run.output.finish_reason == FinishReason::Stop;
            assert_eq!(
                run.ids,
                common::expected_ids(case, run.output.finish_reason),
                "case {} drafted by {name}",
                case.id
            );
            assert_eq!(
                run.output.stats.generation_tokens,
                run.ids.len() + stopped as usize
            );
            // (An accepted end-of-sequence token is counted but not streamed.)
            let stats = &run.output.stats;
            let flagged = run.from_draft.iter().filter(|&&d| d).count();
            assert!(
                (flagged..=flagged + stopped as usize).contains(&stats.accepted_draft_tokens),
                "{} accepted, {flagged} streamed from the draft",
                stats.accepted_draft_tokens
            );
            proposed += stats.draft_tokens;
            accepted += stats.accepted_draft_tokens;
        }
        assert!(proposed > 0);
        if std::ptr::eq(draft, model.as_ref()) {
            // The model agrees with itself: only the step's last token comes from the model.
            assert!(accepted * 10 >= proposed * 9, "{accepted} of {proposed}");
        } else {
            assert!(
                accepted * 2 < proposed,
                "a random draft: {accepted} of {proposed}"
            );
        }
    }

    // Sampled, seeded: mlx_lm's tokens and flags.
    for expected in &sampled {
        let (k, seed, flags) = (
            expected.num_draft_tokens,
            expected.seed,
            &expected.from_draft,
        );
        let mut request = expected.request(&short);
        request.prefill_step_size = 2048;
        let run = speculate(model.as_ref(), model.as_ref(), &tokenizer, k, &request);
        assert_eq!(run.ids, expected.ids, "seed {seed}, {k} draft tokens");
        assert_eq!(&run.from_draft, flags, "seed {seed}, {k} draft tokens");
        assert!(
            flags.iter().any(|&f| !f) && flags.iter().any(|&f| f),
            "seed {seed}: accepted and rejected proposals both"
        );
    }

    // The same sampled requests in the batch, all at once beside a greedy one, the model
    // proposing for itself in the batch's verify steps: each draws its keys in mlx_lm's order
    // (its draft's draws, then one for the verify pass's positions), so each gets mlx_lm's
    // tokens and flags, whatever the other rows do. (A sampled request without a draft in such
    // a batch is a_draft_model_in_the_batch_keeps_mlx_lms_ids's.)
    use perch_engine::testing::{BatchConfig, BatchEvent, BatchGenerator};
    let config = BatchConfig {
        max_running: common::room_for(sampled.len() + 1),
        ..BatchConfig::for_budget(model.as_ref(), 256 << 20, 32, None)
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm")
        .with_draft(model.as_ref(), 3);
    let mut ids_of: Vec<(u64, Vec<u32>, Vec<bool>)> = Vec::new();
    for run in &sampled {
        let mut request = run.request(&short);
        request.num_draft_tokens = Some(run.num_draft_tokens);
        ids_of.push((batch.insert(request).unwrap(), Vec::new(), Vec::new()));
    }
    let mut greedy = GenerateRequest::new(short[3].prompt_ids.clone());
    greedy.max_tokens = reference.max_tokens;
    greedy.num_draft_tokens = Some(2);
    let greedy_id = batch.insert(greedy).unwrap();
    let (mut finished, mut greedy_ids) = (0, Vec::new());
    while finished < sampled.len() + 1 {
        for event in batch.step().unwrap() {
            match event {
                BatchEvent::Token { request, event } => {
                    let Some(id) = event.id else { continue };
                    match ids_of.iter_mut().find(|(r, _, _)| *r == request) {
                        Some((_, ids, flags)) => {
                            ids.push(id);
                            flags.push(event.from_draft);
                        }
                        None if request == greedy_id => greedy_ids.push(id),
                        None => {}
                    }
                }
                BatchEvent::Finished { request, output } => {
                    finished += 1;
                    if request == greedy_id {
                        assert_eq!(
                            output.token_ids,
                            common::expected_ids(&short[3], output.finish_reason)
                        );
                    }
                }
                BatchEvent::Refused { error, .. } => panic!("{error}"),
                BatchEvent::Admitted { .. } => {}
            }
        }
    }
    assert!(!greedy_ids.is_empty());
    assert!(batch.step_times().verify_steps > 0);
    for ((_, ids, flags), expected) in ids_of.iter().zip(&sampled) {
        let (k, seed) = (expected.num_draft_tokens, expected.seed);
        assert_eq!(
            ids, &expected.ids,
            "in the batch: seed {seed}, {k} draft tokens"
        );
        assert_eq!(
            flags, &expected.from_draft,
            "in the batch: seed {seed}, {k} draft tokens"
        );
    }
}

#[test]
fn bad_drafts_are_refused() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let request = GenerateRequest::new(tokenizer.encode("Hello", true).unwrap());
    let refused = |draft: Draft<'_>, request: &GenerateRequest| {
        generate_speculative(model.as_ref(), &draft, &tokenizer, request, |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err()
        .to_string()
    };
    let draft = |num_draft_tokens| Draft {
        model: model.as_ref(),
        tokenizer: &tokenizer,
        num_draft_tokens,
    };
    assert!(refused(draft(0), &request).contains("num_draft_tokens"));
    assert!(refused(draft(65), &request).contains("num_draft_tokens"));
    let mut bounded = request.clone();
    bounded.max_kv_size = Some(64);
    assert!(refused(draft(3), &bounded).contains("max_kv_size"));

    // Another vocabulary: the test tokenizer with two tokens' ids swapped.
    let other = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.path().join(path.file_name().unwrap())).unwrap();
    }
    let file = other.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let hello = vocab["hello"].clone();
    let world = vocab["world"].clone();
    vocab.insert("hello".into(), world);
    vocab.insert("world".into(), hello);
    std::fs::write(&file, serde_json::to_string(&json).unwrap()).unwrap();
    let other_tokenizer = Tokenizer::load(other.path()).unwrap();
    let error = refused(
        Draft {
            model: model.as_ref(),
            tokenizer: &other_tokenizer,
            num_draft_tokens: 3,
        },
        &request,
    );
    assert!(error.contains("tokenizer does not match"), "{error}");
}

/// The draft model in the batch (`BatchGenerator::with_draft`): greedy speculative requests
/// inserted at different steps into one batch, drafted by the model itself (its proposals
/// accepted; every short case) and by a tiny random model (most rejected, and rewound in both
/// slot caches; the first four), with decode steps op by op and compiled (over dense weights,
/// as CUDA runs them), each yield mlx_lm's greedy ids; a plain request decodes beside them
/// (with prompt lookup on, it proposes from its own tokens in the same verify steps); a sampled
/// one without a draft joins the verify steps, and one with log-probabilities holds every step
/// plain for a while (the draft's rows catch up after: the model's own proposals are still
/// accepted), each with the ids it gets alone; every block is free at the end. The pool's
/// blocks count the draft's KV (`BatchConfig::counting_draft`). A speculative request with a
/// logits processor is not the batch's (the engine runs it beside the batch).
#[test]
fn a_draft_model_in_the_batch_keeps_mlx_lms_ids() {
    use perch_engine::testing::{
        kv_bytes_per_token, loading_dense_weights, BatchConfig, BatchGenerator,
    };
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let out = tempfile::tempdir().unwrap();
    common::run_oracle(
        "speculative.py",
        &[out.path().to_str().unwrap(), dir.to_str().unwrap()],
    );
    let tiny = models::load(&out.path().join("llama3-rope")).unwrap();
    let reference = common::reference();
    let cases = common::short_reference_cases();
    let raw_text = &cases[4];
    assert_eq!(raw_text.id, "raw-text");
    let every_step = perch_engine::PromptLookup {
        adaptive: false,
        ..perch_engine::PromptLookup::default()
    };
    // Compiled decode steps run as on CUDA, over dense weights: a compiled step cannot call
    // Perch's CPU kernel, and MLX's CPU `quantized_matmul` would take about a second a step.
    let dense = loading_dense_weights(true, || models::load(&dir)).unwrap();
    // Every short case with the model itself; the first four (multi-turn, which stops at its
    // EOS, among them) with the tiny draft, whose steps are compiled.
    for (name, target, draft, compile_decode, lookup, cases) in [
        (
            "the model itself",
            model.as_ref(),
            model.as_ref(),
            false,
            None,
            &cases[..],
        ),
        (
            "a random tiny model",
            dense.as_ref(),
            tiny.as_ref(),
            true,
            Some(every_step),
            &cases[..4],
        ),
    ] {
        // The pool's blocks pay for the draft's KV too: a pooled token costs both models' KV.
        let budget = BatchConfig::for_budget(target, 256 << 20, 32, None);
        let counted = budget.clone().counting_draft(target, Some(draft));
        let (m, d) = (
            kv_bytes_per_token(target, None),
            kv_bytes_per_token(draft, None),
        );
        assert!(d > 0 && counted.num_blocks < budget.num_blocks, "{name}");
        assert_eq!(
            counted.num_blocks,
            budget.num_blocks * m / (m + d),
            "{name}"
        );
        let without = budget.clone().counting_draft(target, None);
        assert_eq!(without.num_blocks, budget.num_blocks);
        let config = BatchConfig {
            compile_decode,
            prompt_lookup: lookup,
            max_running: common::room_for(8),
            ..counted
        };
        let blocks = config.num_blocks;
        let mut batch =
            BatchGenerator::new(target, &tokenizer, config, "smollm").with_draft(draft, 3);
        assert!(batch.drafts());
        assert_eq!(batch.kv_stats().blocks_total, blocks);
        batch.warm_up().unwrap();
        let mut schedule: Vec<(usize, GenerateRequest)> = cases
            .iter()
            .zip([0, 3, 5, 9, 17, 30])
            .enumerate()
            .map(|(i, (case, at))| {
                let mut request = GenerateRequest::new(case.prompt_ids.clone());
                request.max_tokens = reference.max_tokens;
                request.prefill_step_size = 16;
                request.num_draft_tokens = (i != 1).then_some(3 + i % 2);
                (at, request)
            })
            .collect();
        // A sampled request without a draft from step 6 on joins the verify steps feeding its
        // last token alone (prompt lookup proposes for greedy rows only): its ids are those it
        // gets alone. A sampled request with log-probabilities cannot verify: while it
        // decodes every step is plain, so the draft's rows fall behind and catch up after.
        // (Both on raw-text's prompt, 5 tokens: any would do.)
        let mut sampled = GenerateRequest::new(raw_text.prompt_ids.clone());
        sampled.sampling.temperature = 0.7;
        sampled.sampling.seed = Some(4);
        sampled.max_tokens = 12;
        sampled.ignore_eos = true;
        let alone = |request: &GenerateRequest| {
            common::generate_alone(target, &tokenizer, request)
                .unwrap()
                .token_ids
        };
        let sampled_alone = alone(&sampled);
        let mut scored = sampled.clone();
        scored.max_tokens = 6;
        scored.logprobs = Some(2);
        let scored_alone = alone(&scored);
        schedule.push((6, sampled));
        schedule.push((20, scored));
        let mut outputs = common::drive(&mut batch, schedule);
        for (output, expected) in [
            (outputs.pop().unwrap().0, scored_alone),
            (outputs.pop().unwrap().0, sampled_alone),
        ] {
            assert_eq!(output.token_ids, expected, "{name}: a sampled request");
            assert_eq!(output.stats.draft_tokens, 0);
        }
        assert_eq!(outputs.len(), cases.len());
        let (mut proposed, mut accepted) = (0, 0);
        for (i, (case, (output, streamed))) in cases.iter().zip(&outputs).enumerate() {
            assert_eq!(
                output.token_ids,
                common::expected_ids(case, output.finish_reason),
                "case {} drafted by {name}",
                case.id
            );
            assert_eq!(streamed, &output.text, "case {}", case.id);
            let stats = &output.stats;
            assert!(stats.accepted_draft_tokens <= stats.draft_tokens);
            if i == 1 && lookup.is_none() {
                assert_eq!(stats.draft_tokens, 0, "a plain request proposes nothing");
            } else if i != 1 {
                proposed += stats.draft_tokens;
                accepted += stats.accepted_draft_tokens;
            }
        }
        let times = batch.step_times();
        assert!(times.verify_steps > 0, "{name}: {times:?}");
        assert!(proposed > 0, "{name}");
        if std::ptr::eq(draft, target) {
            // (A row that caught up wrongly after the sampled request's plain steps proposes
            // from a cache that lacks tokens: 75 of 83 were accepted so.)
            assert!(accepted * 20 >= proposed * 19, "{accepted} of {proposed}");
        } else {
            assert!(
                accepted * 2 < proposed,
                "a random draft: {accepted} of {proposed}"
            );
        }
        assert_eq!(batch.kv_stats().blocks_used, 0, "{name}");

        // A speculative request with a logits processor is not the batch's.
        let mut penalized = GenerateRequest::new(cases[0].prompt_ids.clone());
        penalized.num_draft_tokens = Some(3);
        penalized.sampling.temperature = 0.7;
        penalized.sampling.repetition_penalty = 1.2;
        let refused = batch.insert(penalized).unwrap_err().to_string();
        assert!(refused.contains("beside the batch"), "{refused}");
        // A prompt the pool cannot hold: the refusal says the draft's KV shares it.
        let capacity = blocks * 32;
        let too_long = GenerateRequest::new(vec![1; capacity]);
        let refused = batch.insert(too_long).unwrap_err().to_string();
        assert!(
            refused.contains(&format!("budget holds {capacity}"))
                && refused.contains("the draft model's KV shares it"),
            "{refused}"
        );
        // A pool that does not count the draft's KV does not say it shares it.
        let uncounted = BatchConfig {
            max_running: common::room_for(7),
            ..budget
        };
        let capacity = uncounted.num_blocks * 32;
        let mut batch =
            BatchGenerator::new(target, &tokenizer, uncounted, "smollm").with_draft(draft, 3);
        let refused = batch
            .insert(GenerateRequest::new(vec![1; capacity]))
            .unwrap_err()
            .to_string();
        assert!(
            refused.contains(&format!("budget holds {capacity}"))
                && !refused.contains("the draft model's KV"),
            "{refused}"
        );
    }
}

/// Through the engine: greedy speculative requests (the engine's draft, here the model itself)
/// run in the batch beside a plain one, and a sampled one with a repetition penalty beside the
/// batch; the greedy ones
/// answer mlx_lm's greedy ids, their stats count the proposals, the engine counts them running,
/// a cancel ends one, and an engine without a draft refuses them.
#[test]
fn the_engine_runs_speculative_requests() {
    use perch_engine::{EngineConfig, EngineHandle, EngineRequest, Prompt};
    let dir = common::model_dir();
    let engine = EngineHandle::load(
        &dir,
        EngineConfig {
            draft_model: Some(dir.clone()),
            // Prompts in several chunks, one per engine step.
            prefill_token_budget: 16,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let reference = common::reference();
    let cases = common::short_reference_cases();
    let submit = |case: &common::ReferenceCase, draft: Option<usize>| {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = reference.max_tokens;
        params.num_draft_tokens = draft;
        engine
            .submit(EngineRequest {
                prompt: Prompt::Tokens(case.prompt_ids.clone()),
                params,
            })
            .unwrap()
    };
    // Sky and haiku speculative, multi-turn (7 tokens, the last its EOS) plain.
    let streams: Vec<_> = cases
        .iter()
        .take(3)
        .enumerate()
        .map(|(i, case)| (case, submit(case, (i != 2).then_some(3))))
        .collect();
    // A sampled speculative request with a logits processor, which runs beside the batch.
    let mut sampled = GenerateRequest::new(Vec::new());
    sampled.max_tokens = 6;
    sampled.ignore_eos = true;
    sampled.num_draft_tokens = Some(3);
    sampled.sampling = SamplingParams {
        temperature: 0.8,
        seed: Some(9),
        repetition_penalty: 1.1,
        ..SamplingParams::default()
    };
    let sampled = engine
        .submit(EngineRequest {
            prompt: Prompt::Tokens(cases[1].prompt_ids.clone()),
            params: sampled,
        })
        .unwrap();
    // A long speculative request, cancelled while it runs.
    let mut long = GenerateRequest::new(Vec::new());
    long.max_tokens = 500;
    long.ignore_eos = true;
    long.num_draft_tokens = Some(2);
    let cancelled = engine
        .submit(EngineRequest {
            prompt: Prompt::Tokens(cases[0].prompt_ids.clone()),
            params: long,
        })
        .unwrap();
    // Its first token (after the batch's admission report).
    loop {
        match cancelled
            .events
            .recv_timeout(std::time::Duration::from_secs(300))
            .unwrap()
        {
            perch_engine::EngineEvent::Token { .. } => break,
            perch_engine::EngineEvent::Admitted { .. } => continue,
            other => panic!("{other:?}"),
        }
    }
    assert!(engine.stats().unwrap().running >= 1);
    engine.cancel(cancelled.id);
    let ended = common::finish(&cancelled);
    assert_eq!(ended.reason, FinishReason::Cancelled);
    assert!(ended.ids.len() < 499);

    for (i, (case, stream)) in streams.iter().enumerate() {
        let done = common::finish(stream);
        assert_eq!(done.error, None, "case {}", case.id);
        assert_eq!(
            done.ids,
            common::expected_ids(case, done.reason),
            "case {} ({})",
            case.id,
            if i == 2 { "plain" } else { "speculative" }
        );
        if i == 2 {
            assert_eq!(done.stats.draft_tokens, 0);
        } else {
            assert!(done.stats.draft_tokens > 0 && done.stats.accepted_draft_tokens > 0);
        }
    }

    let sampled = common::finish(&sampled);
    assert_eq!(sampled.error, None);
    assert_eq!(sampled.ids.len(), 6);
    assert!(sampled.stats.draft_tokens > 0);

    let plain = EngineHandle::load(&dir, EngineConfig::default()).unwrap();
    // The published limits count the draft's KV as the pool does: the model drafting for
    // itself, a byte of the budget holds half the tokens (budgets may differ: each engine's
    // is lowered to the memory left at its load).
    let per_byte =
        |l: perch_engine::EngineLimits| l.kv_cache_tokens as f64 / l.kv_cache_bytes as f64;
    let (drafting, alone) = (per_byte(engine.limits()), per_byte(plain.limits()));
    assert!(
        drafting > 0.45 * alone && drafting < 0.55 * alone,
        "{drafting} tokens a byte with the draft, {alone} without"
    );
    let mut params = GenerateRequest::new(Vec::new());
    params.num_draft_tokens = Some(3);
    let refused = common::finish(
        &plain
            .submit(EngineRequest {
                prompt: Prompt::Tokens(cases[0].prompt_ids.clone()),
                params,
            })
            .unwrap(),
    );
    assert!(
        refused.error.as_deref().unwrap().contains("no draft model"),
        "{:?}",
        refused.error
    );
}
