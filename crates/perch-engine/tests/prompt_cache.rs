//! Prompt caches on disk: Perch's round trip through the engine's prefix cache, interop with
//! files written and read by Python mlx_lm 0.32.2 on the test model (`tests/oracle/prompt_cache.py`),
//! and clear errors for damaged files and other models' caches.
//!
//! Needs the oracle (see `architecture_parity.rs`).

mod common;

use std::path::Path;

use perch_engine::models;
use perch_engine::prompt_cache::{load_prompt_cache, save_prompt_cache};
use perch_engine::{
    EngineConfig, EngineError, EngineHandle, EngineRequest, FinishReason, GenerateRequest,
    GenerationStats, Prompt,
};

fn oracle(args: &[&str]) -> String {
    common::served_oracle("prompt_cache.py", args)
}

fn run(engine: &EngineHandle, prompt: Prompt) -> (Vec<u32>, FinishReason, GenerationStats) {
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = 32;
    let done = common::finish(&engine.submit(EngineRequest { prompt, params }).unwrap());
    assert_eq!(done.error, None);
    (done.ids, done.reason, done.stats)
}

/// The reference case used throughout: a chat prompt of 61 tokens.
fn case() -> common::ReferenceCase {
    common::reference_cases()
        .into_iter()
        .find(|c| c.id == "multi-turn")
        .unwrap()
}

#[test]
fn a_saved_prompt_cache_fills_another_engines_prefix_cache() {
    let case = case();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prefix.safetensors");
    let prefix = &case.prompt_ids[..48];
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    assert_eq!(
        engine
            .save_prompt_cache(Prompt::Tokens(prefix.to_vec()), &file)
            .unwrap(),
        48
    );
    engine.shutdown();

    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    assert_eq!(
        engine.load_prompt_cache(&file).unwrap(),
        32,
        "whole blocks of 32 tokens"
    );
    let (ids, reason, stats) = run(&engine, Prompt::Tokens(case.prompt_ids.clone()));
    assert_eq!(stats.cached_prompt_tokens, 32);
    assert_eq!(ids, common::expected_ids(&case, reason));
    // The same file as a continuation: the request gives only the tokens after the prefix.
    let (ids, reason, stats) = run(
        &engine,
        Prompt::AfterCache {
            cache_file: file.clone(),
            tokens: case.prompt_ids[48..].to_vec(),
        },
    );
    assert!(stats.cached_prompt_tokens >= 32);
    assert_eq!(ids, common::expected_ids(&case, reason));
    engine.shutdown();
}

#[test]
fn files_move_between_perch_and_mlx_lm() {
    let case = case();
    let dir = tempfile::tempdir().unwrap();
    let model_dir = common::model_dir();
    let (prefix, rest) = case.prompt_ids.split_at(40);
    let json = |ids: &[u32]| serde_json::to_string(ids).unwrap();

    // mlx_lm writes, Perch continues from it.
    let theirs = dir.path().join("mlx_lm.safetensors");
    oracle(&[
        "save",
        model_dir.to_str().unwrap(),
        &json(prefix),
        theirs.to_str().unwrap(),
    ]);
    let engine = EngineHandle::load(&model_dir, EngineConfig::default()).unwrap();
    let (ids, reason, stats) = run(
        &engine,
        Prompt::AfterCache {
            cache_file: theirs.clone(),
            tokens: rest.to_vec(),
        },
    );
    assert_eq!(stats.cached_prompt_tokens, 40);
    assert_eq!(
        ids,
        common::expected_ids(&case, reason),
        "Perch continuing mlx_lm's cache"
    );
    let err = engine.load_prompt_cache(&theirs).unwrap_err();
    assert!(
        err.to_string().contains("does not record its token ids"),
        "{err}"
    );

    // With a draft model: the draft cannot read a prefix without token ids. A greedy
    // speculative request continues without proposals (its ids the same); a sampled one would
    // draw other keys than mlx_lm's speculative generation, and is refused.
    let drafting = EngineHandle::load(
        &model_dir,
        EngineConfig {
            draft_model: Some(model_dir.clone()),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let after_theirs = || Prompt::AfterCache {
        cache_file: theirs.clone(),
        tokens: rest.to_vec(),
    };
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = 32;
    params.num_draft_tokens = Some(3);
    let done = common::finish(
        &drafting
            .submit(EngineRequest {
                prompt: after_theirs(),
                params: params.clone(),
            })
            .unwrap(),
    );
    assert_eq!(done.error, None);
    assert_eq!(done.ids, common::expected_ids(&case, done.reason));
    assert_eq!(done.stats.draft_tokens, 0);
    params.sampling.temperature = 0.7;
    params.sampling.seed = Some(1);
    let done = common::finish(
        &drafting
            .submit(EngineRequest {
                prompt: after_theirs(),
                params,
            })
            .unwrap(),
    );
    let error = done.error.expect("refused");
    assert!(
        error.contains("cannot start from this prompt cache"),
        "{error}"
    );
    drafting.shutdown();

    // Perch writes, mlx_lm continues from it.
    let ours = dir.path().join("perch.safetensors");
    engine
        .save_prompt_cache(Prompt::Tokens(prefix.to_vec()), &ours)
        .unwrap();
    engine.shutdown();
    let out = oracle(&[
        "continue",
        model_dir.to_str().unwrap(),
        ours.to_str().unwrap(),
        &json(rest),
        "32",
    ]);
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    // mlx_lm's generate_step does not stop at EOS: compare up to the reference's stop token.
    assert_eq!(
        ids[..case.greedy_ids.len()],
        case.greedy_ids[..],
        "mlx_lm continuing Perch's cache"
    );
}

/// mlx_lm's `max_kv_size` makes `RotatingKVCache`s for every layer: a file that dropped nothing
/// continues in Perch; one that dropped positions a global layer attends to (keeping its first
/// 4 apart) is refused with the reason.
#[test]
fn mlx_lm_rotating_caches_of_a_model_without_sliding_layers() {
    let case = case();
    let dir = tempfile::tempdir().unwrap();
    let model_dir = common::model_dir();
    let (prefix, rest) = case.prompt_ids.split_at(40);
    let ids = serde_json::to_string(prefix).unwrap();
    let engine = EngineHandle::load(&model_dir, EngineConfig::default()).unwrap();
    for (max_kv_size, fits) in [("64", true), ("16", false)] {
        let file = dir.path().join(format!("max_kv_{max_kv_size}.safetensors"));
        let path = file.to_str().unwrap();
        oracle(&[
            "save",
            model_dir.to_str().unwrap(),
            &ids,
            path,
            "3",
            max_kv_size,
        ]);
        let prompt = Prompt::AfterCache {
            cache_file: file.clone(),
            tokens: rest.to_vec(),
        };
        if fits {
            let (ids, reason, stats) = run(&engine, prompt);
            assert_eq!(stats.cached_prompt_tokens, 40);
            assert_eq!(ids, common::expected_ids(&case, reason));
            continue;
        }
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = 4;
        let done = common::finish(&engine.submit(EngineRequest { prompt, params }).unwrap());
        let error = done.error.expect("max_kv_size 16 refused");
        assert!(
            error.contains("keeps its first 4 positions") && error.contains("max_kv_size"),
            "{error}"
        );
        assert!(done.ids.is_empty(), "refused but generated {:?}", done.ids);
    }
    engine.shutdown();
}

#[test]
fn damaged_files_and_other_models_caches_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = common::model_dir();
    let model = models::load(&model_dir).unwrap();
    let mut cache = model.make_cache(None);
    model
        .forward_sequence(
            &mlx_rs::Array::from_slice(&[1u32, 504, 2988, 288], &[1, 4]),
            &mut cache,
        )
        .unwrap();
    let good = dir.path().join("good.safetensors");
    save_prompt_cache(&good, &cache, &[1, 504, 2988, 288], "model-a", 32, None).unwrap();
    let loaded = load_prompt_cache(&good, model.as_ref(), "model-a").unwrap();
    assert_eq!(
        (loaded.offset, loaded.tokens.as_deref()),
        (4, Some(&[1u32, 504, 2988, 288][..]))
    );

    let message = |path: &Path, id: &str| match load_prompt_cache(path, model.as_ref(), id) {
        Err(err @ EngineError::PromptCache { .. }) => err.to_string(),
        Err(other) => panic!("expected a prompt-cache error, got {other}"),
        Ok(_) => panic!("{} loaded", path.display()),
    };
    assert!(message(&good, "model-b").contains("made with model model-a"));

    let bytes = std::fs::read(&good).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(
        message(&truncated, "model-a").contains("damaged"),
        "{}",
        message(&truncated, "model-a")
    );
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    assert!(message(&garbage, "model-a").contains("damaged"));

    // A cache with another model's shapes: half the layers.
    let other = dir.path().join("other.safetensors");
    save_prompt_cache(
        &other,
        &cache[..15],
        &[1, 504, 2988, 288],
        "model-a",
        32,
        None,
    )
    .unwrap();
    assert!(
        message(&other, "model-a").contains("15 layers"),
        "{}",
        message(&other, "model-a")
    );

    // mlx_lm's rotating layout with an offset past the model's context (read before any
    // arithmetic on it).
    let (mut arrays, mut metadata) = mlx_rs::Array::load_safetensors_with_metadata(&good).unwrap();
    metadata.insert("1.0".into(), "RotatingKVCache".into());
    for (part, value) in [(2, i32::MAX), (3, 0), (4, 8), (5, 4)] {
        arrays.insert(format!("0.{part}"), mlx_rs::Array::from_int(value));
    }
    let rotating = dir.path().join("rotating.safetensors");
    mlx_rs::Array::save_safetensors(
        arrays.iter().map(|(k, v)| (k.as_str(), v)),
        &metadata,
        &rotating,
    )
    .unwrap();
    assert!(
        message(&rotating, "model-a").contains("the model's context is"),
        "{}",
        message(&rotating, "model-a")
    );

    // Saving never leaves a half-written file: a bad name fails before anything is written.
    assert!(save_prompt_cache(
        &dir.path().join("x.bin"),
        &cache,
        &[1, 504, 2988, 288],
        "model-a",
        32,
        None
    )
    .is_err());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 5, "{names:?}");
}
