//! Continuous batching reproduces single-request generation exactly: every reference case,
//! submitted at once or inserted at different steps, yields mlx_lm's greedy ids.

mod common;

use std::collections::HashMap;

use perch_engine::batch::{BatchEvent, BatchGenerator};
use perch_engine::{models, FinishReason, GenerateRequest, Tokenizer};

fn expected_ids(case: &common::ReferenceCase, reason: FinishReason) -> &[u32] {
    match reason {
        FinishReason::Stop => &case.greedy_ids[..case.greedy_ids.len() - 1],
        _ => &case.greedy_ids[..],
    }
}

/// Inserts case `i` at step `insert_at[i]` and runs the batch to completion.
fn run(insert_at: &[usize], prefill_step_size: usize) {
    let dir = common::smollm_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let cases = common::reference_cases();
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer);
    let mut ids_of = HashMap::new();
    let mut streamed: HashMap<u64, String> = HashMap::new();
    let mut outputs = HashMap::new();
    let mut step = 0;
    while outputs.len() < cases.len() {
        for (i, case) in cases.iter().enumerate() {
            if insert_at[i] == step {
                let mut request = GenerateRequest::new(case.prompt_ids.clone());
                request.max_tokens = 32;
                request.prefill_step_size = prefill_step_size;
                ids_of.insert(batch.insert(request).unwrap(), i);
            }
        }
        for event in batch.step().unwrap() {
            match event {
                BatchEvent::Token { request, event } => streamed.entry(request).or_default().push_str(&event.text),
                BatchEvent::Finished { request, output } => {
                    outputs.insert(request, output);
                }
            }
        }
        step += 1;
        assert!(step < 1000, "the batch does not finish");
    }
    assert!(batch.is_empty());
    for (request, output) in &outputs {
        let case = &cases[ids_of[request]];
        assert_eq!(output.token_ids, expected_ids(case, output.finish_reason), "case {}", case.id);
        assert_eq!(streamed.get(request).cloned().unwrap_or_default(), output.text, "case {}", case.id);
    }
}

#[test]
fn all_reference_cases_at_once() {
    run(&[0, 0, 0, 0, 0, 0], 2048);
}

#[test]
fn staggered_inserts_with_chunked_prefill() {
    run(&[0, 3, 5, 9, 17, 30], 16);
}
