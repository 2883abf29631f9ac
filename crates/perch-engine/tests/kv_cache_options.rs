//! mlx_lm's KV cache options for one sequence, against mlx_lm 0.32.2's `generate_step` on a tiny
//! random Qwen3 (`tests/oracle/kv_cache_options.py`): `max_kv_size` (a rotating cache keeping
//! the first 4 positions) wrapping while decoding, within one prefill chunk, across chunks and
//! with chunks shorter than the kept positions; `kv_bits` with `quantized_kv_start` converting
//! while decoding, between prefill chunks and after the first chunk. Each run is greedy under a
//! repetition penalty, so the cache holds varied tokens: each step's log-probability must be
//! within 1e-4 of mlx_lm's and the ids mlx_lm's; and where mlx_lm's log-probabilities differ from
//! a plain cache's, Perch's must differ too (the option took effect). Every case runs again through
//! the batch engine, all at once, each beside a plain request of its prompt (bounded and quantized
//! rows of the slot caches among plain ones), and must give mlx_lm's log-probabilities and ids
//! there too, and differ from the plain request beside it where mlx_lm's differ from a plain
//! cache's. Needs the oracle.

mod common;

use std::collections::HashMap;
use std::ops::ControlFlow;

use perch_engine::sample::sampler::SamplingParams;
use perch_engine::testing::{BatchConfig, BatchEvent, BatchGenerator};
use perch_engine::{generate, models, GenerateRequest, KvQuantization, Tokenizer};

/// Inserts every request at once into a batch of `model` (a 64 MiB pool of 16-token blocks)
/// and steps it until all have finished; returns each one's ids and the log-probability of each
/// (when asked for), in order.
fn run_together(
    model: &dyn models::Model,
    tokenizer: &Tokenizer,
    requests: &[GenerateRequest],
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let batch = &mut BatchGenerator::new(
        model,
        tokenizer,
        BatchConfig::for_budget(model, 64 << 20, 16, None),
        "test",
    );
    let ids: Vec<u64> = requests
        .iter()
        .map(|r| batch.insert(r.clone()).expect("accepted"))
        .collect();
    let mut logprobs: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut done: HashMap<u64, Vec<u32>> = HashMap::new();
    for _ in 0..5000 {
        if done.len() == ids.len() {
            break;
        }
        for event in batch.step().expect("step") {
            match event {
                BatchEvent::Token { request, event } => logprobs
                    .entry(request)
                    .or_default()
                    .extend(event.logprobs.map(|l| l.logprob)),
                BatchEvent::Finished { request, output } => {
                    done.insert(request, output.token_ids);
                }
                BatchEvent::Refused { request, error } => panic!("{request} refused: {error}"),
                BatchEvent::Admitted { .. } => {}
            }
        }
    }
    ids.iter()
        .map(|id| {
            let tokens = done.remove(id).expect("finished");
            (tokens, logprobs.remove(id).unwrap_or_default())
        })
        .collect()
}

#[derive(serde::Deserialize)]
struct Case {
    name: String,
    prompt: Vec<u32>,
    options: Options,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    plain_logprobs: Vec<f32>,
}

#[derive(serde::Deserialize)]
struct Options {
    max_kv_size: Option<usize>,
    prefill_step_size: Option<usize>,
    kv_bits: Option<i32>,
    kv_group_size: Option<i32>,
    quantized_kv_start: Option<usize>,
}

/// The oracle's: greedy under it, a random model's ids vary.
const PENALTY: f32 = 3.0;

#[test]
fn max_kv_size_and_quantized_kv_start_match_mlx_lm() {
    let out = tempfile::tempdir().unwrap();
    let json = common::run_oracle(
        "kv_cache_options.py",
        &[
            out.path().to_str().unwrap(),
            common::model_dir().to_str().unwrap(),
        ],
    );
    let cases: Vec<Case> = serde_json::from_str(&json).unwrap();
    assert_eq!(cases.len(), 7);
    let dir = out.path().join("qwen3");
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let mut all = Vec::new();
    for case in &cases {
        let name = &case.name;
        let mut request = GenerateRequest::new(case.prompt.clone());
        request.max_tokens = case.ids.len();
        request.ignore_eos = true;
        request.logprobs = Some(0);
        request.sampling = SamplingParams {
            repetition_penalty: PENALTY,
            repetition_context_size: 20,
            ..SamplingParams::default()
        };
        let o = &case.options;
        request.max_kv_size = o.max_kv_size;
        if let Some(step) = o.prefill_step_size {
            request.prefill_step_size = step;
        }
        request.kv_quantization = o.kv_bits.map(|bits| KvQuantization {
            bits,
            group_size: o.kv_group_size.unwrap(),
        });
        if let Some(start) = o.quantized_kv_start {
            request.quantized_kv_start = start;
        }
        let mut logprobs = Vec::new();
        let output = generate(model.as_ref(), &tokenizer, &request, |event| {
            logprobs.extend(event.logprobs.as_ref().map(|l| l.logprob));
            ControlFlow::Continue(())
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(logprobs.len(), case.logprobs.len(), "{name}");
        let mut changed = 0;
        for (step, ((perch, mlx), plain)) in logprobs
            .iter()
            .zip(&case.logprobs)
            .zip(&case.plain_logprobs)
            .enumerate()
        {
            assert!(
                (perch - mlx).abs() < 1e-4,
                "{name}, step {step}: log-probability {perch} against mlx_lm's {mlx}"
            );
            if (mlx - plain).abs() > 1e-3 {
                assert!((perch - plain).abs() > 1e-3, "{name}, step {step}");
                changed += 1;
            }
        }
        assert!(changed > 0, "{name}: the option changed nothing");
        assert_eq!(output.token_ids, case.ids, "{name}: ids");
        all.push((case, request));
    }

    // Every case in one batch, each beside a plain request of the same prompt: bounded and
    // quantized rows of the slot caches, each with its own chunks, give what mlx_lm's rotating
    // and quantized caches give.
    let mut requests = Vec::new();
    for (_, request) in &all {
        requests.push(request.clone());
        requests.push(GenerateRequest {
            max_kv_size: None,
            kv_quantization: None,
            ..request.clone()
        });
    }
    let answers = run_together(model.as_ref(), &tokenizer, &requests);
    for ((case, _), answer) in all.iter().zip(answers.chunks(2)) {
        let (name, (ids, logprobs)) = (&case.name, &answer[0]);
        let plain = &answer[1].1;
        assert_eq!(logprobs.len(), case.logprobs.len(), "{name} in the batch");
        let mut changed = 0;
        for (step, (perch, mlx)) in logprobs.iter().zip(&case.logprobs).enumerate() {
            assert!(
                (perch - mlx).abs() < 1e-4,
                "{name} in the batch, step {step}: log-probability {perch} against mlx_lm's {mlx}"
            );
            // The plain request beside it runs as mlx_lm's plain cache ran.
            if (mlx - case.plain_logprobs[step]).abs() > 2e-3 {
                assert!(
                    (perch - plain[step]).abs() > 1e-3,
                    "{name} in the batch, step {step}: the plain row beside it gives the same"
                );
                changed += 1;
            }
        }
        assert!(
            changed > 0,
            "{name} in the batch: the option changed nothing"
        );
        assert_eq!(ids, &case.ids, "{name} in the batch: ids");
    }

    // A model with sliding layers (Gemma 3, its window widened to 300 so that the decode cache's
    // rings outgrow a bounded row's entries): a bounded row's global layers keep their kept
    // positions and ring while its sliding layers keep their own rings, over a prompt longer
    // than both; the batch gives what one sequence gives with the same chunks.
    let dir = out.path().join("gemma3_text");
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["sliding_window"] = 300.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let gemma = models::load(&dir).unwrap();
    let prompt: Vec<u32> = (0..400)
        .map(|i| ((7919 * i + 13) % 4000 + 2) as u32)
        .collect();
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = 24;
    request.ignore_eos = true;
    request.logprobs = Some(0);
    request.max_kv_size = Some(24);
    request.prefill_step_size = 256;
    request.sampling = SamplingParams {
        repetition_penalty: PENALTY,
        repetition_context_size: 20,
        ..SamplingParams::default()
    };
    let plain = GenerateRequest {
        max_kv_size: None,
        ..request.clone()
    };
    let answers = run_together(
        gemma.as_ref(),
        &tokenizer,
        &[request.clone(), plain.clone()],
    );
    for (request, (ids, logprobs)) in [request, plain].iter().zip(&answers) {
        let mut alone_logprobs = Vec::new();
        let alone = generate(gemma.as_ref(), &tokenizer, request, |event| {
            alone_logprobs.extend(event.logprobs.as_ref().map(|l| l.logprob));
            ControlFlow::Continue(())
        })
        .unwrap();
        let what = format!("gemma3_text, max_kv_size {:?}", request.max_kv_size);
        assert_eq!(logprobs.len(), alone_logprobs.len(), "{what}");
        for (step, (batch, one)) in logprobs.iter().zip(&alone_logprobs).enumerate() {
            assert!(
                (batch - one).abs() < 1e-4,
                "{what}, step {step}: {batch} against {one}"
            );
        }
        assert_eq!(ids, &alone.token_ids, "{what}: ids in the batch and alone");
    }
    assert_ne!(
        answers[0].0, answers[1].0,
        "gemma3_text: the bound changed nothing"
    );
}

#[derive(serde::Deserialize)]
struct BoundedFixture {
    cases: Vec<BoundedCase>,
}

#[derive(serde::Deserialize)]
struct BoundedCase {
    prompt: Vec<u32>,
    max_kv_size: usize,
    ids: Vec<u32>,
    plain_ids: Vec<u32>,
}

/// `max_kv_size` on the test model (a Llama) with prompts longer than the bound, greedy: the ids
/// of mlx_lm's `RotatingKVCache(max_size, keep=4)` layers (`tests/fixtures/smollm2-bounded.json`,
/// made by `scripts/make_references.py bounded`, which builds them: mlx_lm's own
/// `make_prompt_cache` ignores the bound for Llama, whose model makes plain caches), and not the
/// plain cache's (the bound took effect).
#[test]
fn max_kv_size_on_llama_matches_mlx_lm_rotating_caches() {
    let dir = common::model_dir();
    // (Made on the test model: perch-test-support's standalone test checks its SHA-256.)
    let fixture: BoundedFixture = perch_test_support::fixture_json("smollm2-bounded.json");
    let cases = fixture.cases;
    assert_eq!(cases.len(), 2);
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    for case in &cases {
        let n = case.prompt.len();
        assert!(n > case.max_kv_size, "a prompt longer than the bound");
        let mut request = GenerateRequest::new(case.prompt.clone());
        request.max_tokens = case.ids.len();
        request.ignore_eos = true;
        request.max_kv_size = Some(case.max_kv_size);
        let output = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
        assert_eq!(output.token_ids, case.ids, "{n}-token prompt");
        assert_ne!(
            case.ids, case.plain_ids,
            "{n}-token prompt: the bound changed nothing"
        );
    }
    // In the batch, the two bounded requests beside plain ones of the same prompts: each gets
    // what it gets alone.
    let mut requests = Vec::new();
    for case in &cases {
        let mut request = GenerateRequest::new(case.prompt.clone());
        request.max_tokens = case.ids.len();
        request.ignore_eos = true;
        request.max_kv_size = Some(case.max_kv_size);
        requests.push(request.clone());
        request.max_kv_size = None;
        requests.push(request);
    }
    let answers = run_together(model.as_ref(), &tokenizer, &requests);
    for (case, answer) in cases.iter().zip(answers.chunks(2)) {
        let n = case.prompt.len();
        assert_eq!(answer[0].0, case.ids, "{n}-token prompt in the batch");
        assert_eq!(
            answer[1].0, case.plain_ids,
            "{n}-token prompt, unbounded, in the batch"
        );
    }
}

#[test]
fn kv_cache_options_are_checked() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let prompt = tokenizer.encode("Hello", true).unwrap();
    let run = |edit: &dyn Fn(&mut GenerateRequest)| {
        let mut request = GenerateRequest::new(prompt.clone());
        request.max_tokens = 2;
        edit(&mut request);
        common::generate_alone(model.as_ref(), &tokenizer, &request)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let error = run(&|r| r.max_kv_size = Some(4)).unwrap_err();
    assert!(error.contains("max_kv_size 4"), "{error}");
    let error = run(&|r| {
        r.max_kv_size = Some(64);
        r.kv_quantization = Some(KvQuantization {
            bits: 8,
            group_size: 64,
        });
    })
    .unwrap_err();
    assert!(error.contains("cannot be combined"), "{error}");
    let error = run(&|r| {
        r.kv_quantization = Some(KvQuantization {
            bits: 8,
            group_size: 48,
        })
    })
    .unwrap_err();
    assert!(error.contains("group size 48"), "{error}");
    let error = run(&|r| {
        r.kv_quantization = Some(KvQuantization {
            bits: 7,
            group_size: 64,
        })
    })
    .unwrap_err();
    assert!(error.contains("7 bits"), "{error}");
    run(&|r| r.max_kv_size = Some(5)).unwrap();

    // The batch runs bounded and quantized requests, checked as `generate` checks them; a
    // quantized pool holds neither.
    let mut batch = BatchGenerator::new(
        model.as_ref(),
        &tokenizer,
        BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None),
        "test",
    );
    let mut request = GenerateRequest::new(prompt.clone());
    request.max_kv_size = Some(4);
    let error = batch.insert(request.clone()).unwrap_err().to_string();
    assert!(error.contains("max_kv_size 4"), "{error}");
    request.max_kv_size = Some(64);
    batch.insert(request.clone()).unwrap();
    let q8 = KvQuantization {
        bits: 8,
        group_size: 64,
    };
    let mut quantized_pool = BatchGenerator::new(
        model.as_ref(),
        &tokenizer,
        BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, Some(q8)),
        "test",
    );
    let error = quantized_pool
        .insert(request.clone())
        .unwrap_err()
        .to_string();
    assert!(error.contains("cannot be combined"), "{error}");
    request.max_kv_size = None;
    request.kv_quantization = Some(q8);
    request.quantized_kv_start = 0;
    batch.insert(request.clone()).unwrap();
    let error = quantized_pool.insert(request).unwrap_err().to_string();
    assert!(error.contains("engine's quantized KV cache"), "{error}");
}

/// Through the engine: a bounded request and a late-quantized one in the batch, with a
/// plain request, answer what `generate` answers with the same options.
#[test]
fn the_engine_runs_kv_cache_options() {
    use perch_engine::{EngineConfig, EngineHandle, EngineRequest, Prompt};
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let engine = EngineHandle::load(&dir, EngineConfig::default()).unwrap();
    let prompt = tokenizer
        .encode(
            "The capital of France is Paris. The capital of Germany is",
            true,
        )
        .unwrap();
    let options: [fn(&mut GenerateRequest); 3] = [
        |r| r.max_kv_size = Some(8),
        |r| {
            r.kv_quantization = Some(KvQuantization {
                bits: 4,
                group_size: 32,
            });
            r.quantized_kv_start = 4;
        },
        |_| {},
    ];
    let requests: Vec<GenerateRequest> = options
        .iter()
        .map(|edit| {
            let mut request = GenerateRequest::new(prompt.clone());
            request.max_tokens = 16;
            request.ignore_eos = true;
            edit(&mut request);
            request
        })
        .collect();
    let streams: Vec<_> = requests
        .iter()
        .map(|request| {
            engine
                .submit(EngineRequest {
                    prompt: Prompt::Tokens(prompt.clone()),
                    params: request.clone(),
                })
                .unwrap()
        })
        .collect();
    let mut answers = Vec::new();
    for (request, stream) in requests.iter().zip(&streams) {
        let done = common::finish(stream);
        assert_eq!(done.error, None);
        let alone = common::generate_alone(model.as_ref(), &tokenizer, request).unwrap();
        assert_eq!(done.ids, alone.token_ids);
        answers.push(done.ids);
    }
    assert_ne!(answers[0], answers[2], "max_kv_size 8 changed nothing");
    assert_ne!(
        answers[1], answers[2],
        "4-bit KV from position 4 changed nothing"
    );
}
