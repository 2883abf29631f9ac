//! KV cache quantization (MLX affine, 8 and 4 bits): the batch engine reproduces mlx_lm's greedy
//! ids with `QuantizedKVCache`, stores quantized blocks in the prefix cache (and serves hits from
//! them exactly), and sizes its pool by the quantized bytes. Needs `PERCH_TEST_PYTHON`.

mod common;

use perch_engine::batch::{kv_bytes_per_token, BatchConfig, BatchGenerator};
use perch_engine::models::{self, Model};
use perch_engine::{
    EngineConfig, EngineError, EngineHandle, FinishReason, GenerateRequest, KvQuantization,
    Tokenizer,
};

const GENERATED: usize = 16;

fn load() -> (Box<dyn Model>, Tokenizer) {
    let dir = common::smollm_dir();
    (models::load(&dir).unwrap(), Tokenizer::load(&dir).unwrap())
}

fn quantization(model: &dyn Model, bits: i32) -> KvQuantization {
    KvQuantization::new(bits, 64, model.info().head_dim as i32).unwrap()
}

fn request(prompt: Vec<u32>) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = GENERATED;
    request.ignore_eos = true;
    request
}

#[test]
fn quantized_kv_cache_reproduces_mlx_lm_greedy_ids() {
    let (model, tokenizer) = load();
    let prompts: Vec<Vec<u32>> = common::reference_cases()
        .into_iter()
        .take(3)
        .map(|case| case.prompt_ids)
        .collect();
    let prompts_json = serde_json::to_string(&prompts).unwrap();
    for bits in [8, 4] {
        let q = quantization(model.as_ref(), bits);
        let expected: Vec<Vec<u32>> = serde_json::from_str(&common::run_oracle(
            "kv_quantization.py",
            &[
                common::smollm_dir().to_str().unwrap(),
                &bits.to_string(),
                "64",
                &GENERATED.to_string(),
                &prompts_json,
            ],
        ))
        .unwrap();
        let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 32, Some(q));
        let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
        // All at once, so decode steps are batched across sequences.
        let schedule = prompts.iter().map(|p| (0, request(p.clone()))).collect();
        for ((output, _), want) in common::drive(&mut batch, schedule).iter().zip(&expected) {
            assert_eq!(output.finish_reason, FinishReason::Length);
            assert_eq!(&output.token_ids, want, "{bits}-bit KV cache");
        }
    }
}

#[test]
fn quantized_blocks_are_smaller_and_prefix_hits_match_cold() {
    let (model, tokenizer) = load();
    let prompt = common::reference_cases()[0].prompt_ids.clone();
    let mut cached_bytes = Vec::new();
    for kv_quantization in [None, Some(quantization(model.as_ref(), 8))] {
        let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 8, kv_quantization);
        let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
        let cold = common::drive(&mut batch, vec![(0, request(prompt.clone()))]);
        cached_bytes.push(batch.kv_stats().prefix_cache_bytes as f64);
        let warm = common::drive(&mut batch, vec![(0, request(prompt.clone()))]);
        assert!(
            warm[0].0.stats.cached_prompt_tokens >= 8,
            "the second run hits"
        );
        assert_eq!(warm[0].0.token_ids, cold[0].0.token_ids);
    }
    // 8-bit: 64 bytes of values + a float32 scale and bias per 64-element head vector.
    let ratio = cached_bytes[1] / cached_bytes[0];
    assert!(
        (ratio - 72.0 / 256.0).abs() < 1e-9,
        "quantized blocks take {ratio} of the float bytes"
    );
}

#[test]
fn the_pool_holds_more_tokens_for_the_same_budget() {
    let (model, _) = load();
    let float = kv_bytes_per_token(model.as_ref(), None);
    assert_eq!(float, 2 * 30 * 3 * 64 * 4);
    assert_eq!(
        kv_bytes_per_token(model.as_ref(), Some(quantization(model.as_ref(), 8))),
        2 * 30 * 3 * 72
    );
    assert_eq!(
        kv_bytes_per_token(model.as_ref(), Some(quantization(model.as_ref(), 4))),
        2 * 30 * 3 * 40
    );
}

#[test]
fn invalid_settings_are_clear_errors() {
    for (bits, group_size, needle) in [
        (7, 64, "7 bits"),
        (8, 48, "group size 48"),
        (8, 128, "head dimension 64"),
    ] {
        let err = KvQuantization::new(bits, group_size, 64).unwrap_err();
        assert!(matches!(err, EngineError::InvalidKvQuantization(_)));
        assert!(err.to_string().contains(needle), "{err}");
    }
    // The engine checks a quantization built field by field against the model it loads.
    let config = EngineConfig {
        kv_quantization: Some(KvQuantization {
            bits: 8,
            group_size: 128,
        }),
        ..EngineConfig::default()
    };
    match EngineHandle::load(&common::smollm_dir(), config) {
        Err(EngineError::InvalidKvQuantization(message)) => {
            assert!(message.contains("head dimension 64"), "{message}")
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("an engine with group size 128 for head dimension 64 loaded"),
    }
}
