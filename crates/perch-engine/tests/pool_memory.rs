//! After 30 mixed requests (shared prefixes, sampling settings, stop strings, cancels mid-prefill
//! and mid-decode) the block pool is all free and MLX's active memory is back at its baseline,
//! up to the prefix cache's own content, which `reset_prefix_cache` returns too.
//!
//! Its own test binary: MLX's memory counters are process-wide.

mod common;

use std::collections::HashMap;

use perch_engine::device::{clear_cache, memory_stats};
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{models, FinishReason, GenerateRequest, Tokenizer};

/// A small deterministic generator (64-bit LCG), so the mix is the same on every run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

#[test]
fn thirty_mixed_requests_leave_the_pool_free_and_memory_at_baseline() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let config = BatchConfig {
        max_running: 32,
        prefill_batch_size: 4,
        prefill_token_budget: 256,
        prefill_fits_budget: false,
        block_size: 16,
        num_blocks: 96,
        bounded_layer_bytes: 0,
        kv_quantization: None,
        slot_attention: Default::default(),
        compile_decode: false,
        prompt_lookup: None,
        lowered_for_memory: None,
        draft_kv_counted: false,
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");

    // Warm-up, then the baseline: the model's weights and nothing else.
    let mut warm_up = GenerateRequest::new(vec![1, 504, 2988]);
    warm_up.max_tokens = 2;
    common::drive(&mut batch, vec![(0, warm_up)]);
    batch.reset_prefix_cache();
    clear_cache();
    let baseline = memory_stats().active_bytes;

    let mut rng = Lcg(7);
    let prefixes: Vec<Vec<u32>> = (0..3)
        .map(|_| (0..40).map(|_| rng.below(49152) as u32).collect())
        .collect();
    let total = 30;
    let mut inserted = 0;
    // Request id -> the step at which it is cancelled.
    let mut cancel_at: HashMap<u64, usize> = HashMap::new();
    let mut finished = 0;
    let mut reasons: HashMap<FinishReason, usize> = HashMap::new();
    let mut step = 0;
    while finished < total {
        for _ in 0..rng.below(8) {
            if inserted == total {
                break;
            }
            let mut prompt = if rng.below(2) == 0 {
                prefixes[rng.below(3) as usize].clone()
            } else {
                Vec::new()
            };
            prompt.extend((0..1 + rng.below(32)).map(|_| rng.below(49152) as u32));
            let mut request = GenerateRequest::new(prompt);
            request.max_tokens = 1 + rng.below(8) as usize;
            request.prefill_step_size = 8 + rng.below(48) as usize;
            if rng.below(3) == 0 {
                request.sampling.temperature = 0.8;
                request.sampling.top_p = 0.9;
                request.sampling.repetition_penalty = 1.1;
                request.sampling.seed = Some(rng.below(1000));
            }
            if rng.below(5) == 0 {
                request.stop_strings = vec!["e".into()];
            }
            let id = batch.insert(request).unwrap();
            inserted += 1;
            if rng.below(4) == 0 {
                cancel_at.insert(id, step + rng.below(4) as usize);
            }
        }
        let due: Vec<u64> = cancel_at
            .iter()
            .filter(|(_, at)| **at <= step)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            cancel_at.remove(&id);
            if let Some(output) = batch.remove(id).unwrap() {
                *reasons.entry(output.finish_reason).or_default() += 1;
                finished += 1;
            }
        }
        for event in batch.step().unwrap() {
            if let perch_engine::testing::BatchEvent::Finished { request, output } = event {
                cancel_at.remove(&request);
                *reasons.entry(output.finish_reason).or_default() += 1;
                finished += 1;
            }
        }
        step += 1;
        assert!(step < 20_000, "the batch does not finish");
        if step % 10 == 0 {
            let kv = batch.kv_stats();
            assert_eq!(
                kv.blocks_used + kv.blocks_cached_free + kv.blocks_empty,
                kv.blocks_total,
                "{kv:?}"
            );
        }
    }
    assert!(batch.is_empty());
    // From the LCG alone: 9 requests get a cancel, 4 of them in the step they arrive in (still
    // waiting, so surely cancelled); 15 have neither a cancel nor a stop string, so end at
    // `max_tokens` unless the model emits an EOS first.
    assert!(
        reasons.get(&FinishReason::Cancelled).copied().unwrap_or(0) >= 4,
        "{reasons:?}"
    );
    assert!(
        reasons.get(&FinishReason::Length).copied().unwrap_or(0) >= 5,
        "{reasons:?}"
    );

    let kv = batch.kv_stats();
    assert_eq!(kv.blocks_used, 0, "{kv:?}");
    assert_eq!(
        kv.blocks_cached_free + kv.blocks_empty,
        kv.blocks_total,
        "{kv:?}"
    );
    assert!(
        kv.prefix_cache_hit_rate > 0.0,
        "shared prefixes were hit: {kv:?}"
    );
    const TOLERANCE: i64 = 1 << 20;
    let active = memory_stats().active_bytes as i64;
    let excess = active - baseline as i64 - kv.prefix_cache_bytes as i64;
    assert!(
        excess.abs() < TOLERANCE,
        "active {active} = baseline {baseline} + cache {} + {excess}",
        kv.prefix_cache_bytes
    );
    batch.reset_prefix_cache();
    assert_eq!(batch.kv_stats().prefix_cache_bytes, 0);
    let active = memory_stats().active_bytes as i64;
    assert!(
        (active - baseline as i64).abs() < TOLERANCE,
        "active {active} vs baseline {baseline} after reset_prefix_cache"
    );
}
