//! `EngineHandle::next_token_logprobs` (genlm's `next_token_logprobs`): the distribution after a
//! prompt equals Python mlx_lm's `log_softmax` of the model's last logits within 1e-4 in float32
//! on every reference prompt (and `generate`'s own); concurrent calls share forward passes; a
//! sequence scored a token at a time computes one token per call (the prefix cache and its kept
//! partial blocks hold the rest); `clear_cache` empties both; bad prompts are errors.

mod common;

use std::sync::OnceLock;

use perch_engine::{EngineConfig, EngineError, EngineHandle, GenerateRequest};

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// mlx_lm's distributions for `prompts`, from the oracle.
fn oracle(prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let prompts_file = dir.path().join("prompts.json");
    std::fs::write(&prompts_file, serde_json::to_string(prompts).unwrap()).unwrap();
    let out = dir.path().join("logprobs.safetensors");
    let model = common::model_dir();
    common::run_oracle(
        "next_token_logprobs.py",
        &[
            model.to_str().unwrap(),
            prompts_file.to_str().unwrap(),
            out.to_str().unwrap(),
        ],
    );
    let arrays = mlx_rs::Array::load_safetensors(&out).unwrap();
    (0..prompts.len())
        .map(|i| arrays[&format!("logprobs.{i}")].as_slice::<f32>().to_vec())
        .collect()
}

/// The short reference prompts (`next_token_logprobs_match_mlx_lm_and_share_steps`).
fn short_prompts() -> Vec<Vec<u32>> {
    common::short_reference_cases()
        .into_iter()
        .map(|c| c.prompt_ids)
        .collect()
}

/// A sequence growing a token at a time (`a_growing_sequence_costs_one_token_per_call`): the
/// longest reference prompt's first 40, 41, ..., 71 tokens, across the block boundary at 64
/// (32 tokens a block).
fn growing_prompts() -> Vec<Vec<u32>> {
    let case = common::reference_cases()
        .into_iter()
        .max_by_key(|c| c.prompt_ids.len())
        .unwrap();
    (40..72).map(|n| case.prompt_ids[..n].to_vec()).collect()
}

/// How many of the growing prompts (the first ones) are checked against mlx_lm.
const GROWING_CHECKED: usize = 3;

/// mlx_lm's distributions for every short prompt and the first [`GROWING_CHECKED`] growing
/// prompts, from one oracle run that both tests share.
fn oracle_answers() -> &'static (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    #[allow(clippy::type_complexity)]
    static EXPECTED: OnceLock<(Vec<Vec<f32>>, Vec<Vec<f32>>)> = OnceLock::new();
    EXPECTED.get_or_init(|| {
        let mut prompts = short_prompts();
        let short = prompts.len();
        prompts.extend(growing_prompts().into_iter().take(GROWING_CHECKED));
        let mut short_expected = oracle(&prompts);
        let growing_expected = short_expected.split_off(short);
        (short_expected, growing_expected)
    })
}

#[test]
fn next_token_logprobs_match_mlx_lm_and_share_steps() {
    let prompts = short_prompts();
    let expected = &oracle_answers().0;
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();

    // All at once (batched), then each alone: both equal mlx_lm's.
    let batched = engine.batch_next_token_logprobs(prompts.clone()).unwrap();
    for (i, (got, want)) in batched.iter().zip(expected).enumerate() {
        let diff = max_diff(got, want);
        assert!(diff < 1e-4, "prompt {i}: max |diff| {diff}");
        let sum: f64 = got.iter().map(|l| (*l as f64).exp()).sum();
        assert!(
            (sum - 1.0).abs() < 1e-3,
            "prompt {i}: probabilities sum to {sum}"
        );
    }
    engine.clear_cache().unwrap();
    for (i, prompt) in prompts.iter().enumerate() {
        let alone = engine.next_token_logprobs(prompt.clone()).unwrap();
        assert!(max_diff(&alone, &expected[i]) < 1e-4, "prompt {i} alone");
    }
    // `generate` answers the same request the same way.
    let model = perch_engine::models::load(&common::model_dir()).unwrap();
    let tokenizer = perch_engine::Tokenizer::load(&common::model_dir()).unwrap();
    let mut request = GenerateRequest::new(prompts[0].clone());
    request.next_token_logprobs = true;
    let out = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
    assert!(max_diff(out.next_token_logprobs.as_ref().unwrap(), &expected[0]) < 1e-4);
    assert_eq!(out.stats.generation_tokens, 0);

    // 16 concurrent calls gathered into one batch: fewer forward passes than calls, each answer
    // what the same calls give submitted together as one batch (on the shortest prompt, to keep
    // the prefill small).
    let shortest = prompts.iter().min_by_key(|p| p.len()).unwrap();
    let calls: Vec<Vec<u32>> = (0..16)
        .map(|k| {
            let mut ids = shortest.clone();
            ids.push(k as u32 + 100);
            ids
        })
        .collect();
    let direct = engine.batch_next_token_logprobs(calls.clone()).unwrap();
    engine.shutdown();
    let batched_engine = EngineHandle::load(
        &common::model_dir(),
        EngineConfig {
            prefill_batch_size: 8,
            max_running: 16,
            logprobs_batch_size: 16,
            logprobs_batch_timeout: std::time::Duration::from_millis(500),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let before = batched_engine.stats().unwrap().step_times;
    let answers: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let threads: Vec<_> = calls
            .iter()
            .map(|ids| {
                let engine = batched_engine.clone();
                scope.spawn(move || engine.next_token_logprobs(ids.clone()).unwrap())
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let after = batched_engine.stats().unwrap().step_times;
    let passes =
        (after.prefill_passes - before.prefill_passes) + (after.decode_steps - before.decode_steps);
    eprintln!("16 concurrent calls: {passes} forward passes");
    assert!(passes < 16, "{passes} forward passes for 16 calls");
    for (k, (got, want)) in answers.iter().zip(&direct).enumerate() {
        assert!(max_diff(got, want) < 1e-4, "call {k}");
    }
    batched_engine.shutdown();
}

#[test]
fn a_growing_sequence_costs_one_token_per_call() {
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    // 40 to 71 tokens: across the block boundary at 64 (32 tokens a block).
    let prompts = growing_prompts();
    let expected = &oracle_answers().1;
    let prefilled = || engine.stats().unwrap().step_times.prefill_tokens;
    let first = engine.next_token_logprobs(prompts[0].clone()).unwrap();
    assert!(max_diff(&first, &expected[0]) < 1e-4);
    for (n, prompt) in prompts.iter().enumerate().skip(1) {
        let before = prefilled();
        let got = engine.next_token_logprobs(prompt.clone()).unwrap();
        // The new token runs in the decode step; nothing before it is computed again.
        assert_eq!(prefilled() - before, 0, "call {n} recomputed its prefix");
        if n < expected.len() {
            assert!(max_diff(&got, &expected[n]) < 1e-4, "call {n}");
        }
    }
    // Branching: a sibling of the last prompt (another last token) reuses the same prefix.
    let mut sibling = prompts[prompts.len() - 2].clone();
    sibling.push(17);
    let before = prefilled();
    engine.next_token_logprobs(sibling.clone()).unwrap();
    assert_eq!(
        prefilled() - before,
        0,
        "a sibling recomputed the shared prefix"
    );
    // After clear_cache the prefix is computed again.
    engine.clear_cache().unwrap();
    let before = prefilled();
    engine.next_token_logprobs(sibling).unwrap();
    assert_eq!(
        prefilled() - before,
        71 - 1,
        "everything but the decoded token"
    );

    for bad in [vec![], vec![u32::MAX]] {
        match engine.next_token_logprobs(bad.clone()) {
            Err(EngineError::Request(message)) => assert!(!message.is_empty()),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    engine.shutdown();
}
