//! Continuous batching reproduces single-request generation exactly: every reference case (the
//! long one too), submitted at once or inserted at different steps, yields mlx_lm's greedy ids,
//! with attention per sequence (the CPU's default) and batched over slot caches (a GPU's: prefill
//! chunks of several sequences in one forward pass, decode steps in another).

mod common;

use perch_engine::batch::{BatchAttention, BatchConfig, BatchGenerator};
use perch_engine::{models, GenerateRequest, Tokenizer};

/// Inserts case `i` at step `insert_at[i]` and runs the batch to completion.
fn run(insert_at: &[usize], prefill_step_size: usize, attention: BatchAttention) {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let cases = common::reference_cases();
    assert_eq!(insert_at.len(), cases.len(), "one insertion step per case");
    let config = BatchConfig {
        attention,
        // Several sequences prefill per step (one forward pass of padded chunks when batched).
        prefill_batch_size: 4,
        ..BatchConfig::for_budget(model.as_ref(), 256 << 20, 32, None)
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    let schedule = cases
        .iter()
        .zip(insert_at)
        .map(|(case, &at)| {
            let mut request = GenerateRequest::new(case.prompt_ids.clone());
            request.max_tokens = common::reference().max_tokens;
            request.prefill_step_size = prefill_step_size;
            (at, request)
        })
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    assert!(batch.is_empty());
    for (case, (output, streamed)) in cases.iter().zip(&outputs) {
        assert_eq!(
            output.token_ids,
            common::expected_ids(case, output.finish_reason),
            "case {} ({attention:?})",
            case.id
        );
        assert_eq!(streamed, &output.text, "case {}", case.id);
    }
    let kv = batch.kv_stats();
    assert_eq!(
        kv.blocks_used, 0,
        "every block is free once all requests are done"
    );
}

#[test]
fn all_reference_cases_at_once() {
    run(&[0; 7], 2048, BatchAttention::PerSequence);
}

#[test]
fn all_reference_cases_at_once_batched_attention() {
    run(&[0; 7], 2048, BatchAttention::Batched);
}

#[test]
fn staggered_inserts_with_chunked_prefill() {
    run(&[0, 3, 5, 9, 17, 30, 31], 16, BatchAttention::PerSequence);
}

/// Sequences join and leave the slot cache at different steps: slots are refilled, rows and
/// capacity change bucket, and every case still yields mlx_lm's ids.
#[test]
fn staggered_inserts_with_chunked_prefill_batched_attention() {
    run(&[0, 3, 5, 9, 17, 30, 31], 16, BatchAttention::Batched);
}
