//! Continuous batching reproduces single-request generation exactly: the reference cases (the
//! long one too), submitted at once or inserted at different steps, yield mlx_lm's greedy ids
//! (all of them, or the first 16 where a test asks fewer) over the slot caches (prefill chunks
//! of several sequences in one forward pass, decode steps in another), read by MLX's fused
//! attention and by the explicit one CUDA's decode steps use, and with decode steps compiled by
//! MLX (over dense weights, as CUDA runs them).

mod common;

use perch_engine::testing::{loading_dense_weights, BatchConfig, BatchGenerator};
use perch_engine::{models, GenerateOutput, GenerateRequest, Tokenizer};
use perch_engine::{PromptLookup, SlotAttention, StepTimes};

/// Runs `cases` in one batch as set (case `i` inserted at step `insert_at[i]`, `max_tokens`
/// each), asserts each yields mlx_lm's ids, and returns where the steps went.
fn run_with(
    cases: Vec<common::ReferenceCase>,
    insert_at: &[usize],
    prefill_step_size: usize,
    max_tokens: usize,
    slot_attention: SlotAttention,
    compile_decode: bool,
    prompt_lookup: Option<PromptLookup>,
) -> StepTimes {
    let dir = common::model_dir();
    // Compiled decode steps run as on CUDA, over dense weights: a compiled step cannot call
    // Perch's CPU kernel, and MLX's CPU `quantized_matmul` would take about a second a step.
    let model = loading_dense_weights(compile_decode, || models::load(&dir)).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    assert_eq!(insert_at.len(), cases.len(), "one insertion step per case");
    let config = BatchConfig {
        slot_attention,
        compile_decode,
        prompt_lookup,
        // Several sequences prefill per step (one forward pass of padded chunks when batched).
        prefill_batch_size: 4,
        // The six short cases at once, and no more.
        max_running: common::room_for(6),
        ..BatchConfig::for_budget(model.as_ref(), 256 << 20, 32, None)
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    // Warm-up (what the engine runs at load on GPUs) leaves nothing behind: the ids below stay
    // exact and every block free. One decode step per row bucket up to 8: 1, 2, 4, 8.
    let shapes = batch.warm_up().unwrap();
    // With prompt lookup, a verify step of each of those row buckets too (verify steps run
    // in caches of up to twice the lookup's 8 rows).
    assert_eq!(shapes, if prompt_lookup.is_some() { 8 } else { 4 });
    let schedule = cases
        .iter()
        .zip(insert_at)
        .map(|(case, &at)| {
            let mut request = GenerateRequest::new(case.prompt_ids.clone());
            request.max_tokens = max_tokens;
            // The long prompt (370 tokens) in chunks of at least 256 when the others take 16:
            // its chunks still interleave with the other rows' steps.
            request.prefill_step_size = match case.prompt_ids.len() {
                n if n > 256 => prefill_step_size.max(256),
                _ => prefill_step_size,
            };
            (at, request)
        })
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    assert!(batch.is_empty());
    for (case, (output, streamed)) in cases.iter().zip(&outputs) {
        assert_eq!(
            output.token_ids,
            common::expected_prefix(case, max_tokens),
            "case {} ({slot_attention:?}, compiled decode {compile_decode})",
            case.id
        );
        assert_eq!(
            output.finish_reason,
            common::expected_finish(case, max_tokens),
            "case {}",
            case.id
        );
        assert_eq!(streamed, &output.text, "case {}", case.id);
    }
    if compile_decode && prompt_lookup.is_none() {
        // One step per warm-up shape, then every decode step of the run: at least one per token
        // after the first of the longest output.
        let longest = outputs
            .iter()
            .map(|(o, _)| o.token_ids.len())
            .max()
            .unwrap();
        assert!(
            batch.compiled_decode_steps() >= shapes + longest - 1,
            "{} decode steps ran compiled, fewer than {shapes} + {}",
            batch.compiled_decode_steps(),
            longest - 1
        );
    } else if !compile_decode {
        assert_eq!(batch.compiled_decode_steps(), 0);
    }
    let kv = batch.kv_stats();
    assert_eq!(
        kv.blocks_used, 0,
        "every block is free once all requests are done"
    );
    // The parts of the steps' time outside forward passes are counted, each within the steps'.
    let times = batch.step_times();
    assert!(times.schedule_seconds > 0.0, "{times:?}");
    assert!(times.publish_seconds > 0.0, "{times:?}");
    assert!(
        times.schedule_seconds + times.publish_seconds + times.prefill_seconds
            <= times.step_seconds,
        "{times:?}"
    );
    times
}

/// The long prompt (370 tokens, in budget-wide chunks) submitted at once with three short
/// ones, which decode beside its chunks: haiku, multi-turn (which stops at its EOS, 7 tokens
/// in) and code, 16 tokens each.
#[test]
fn reference_cases_with_the_long_prompt_at_once() {
    run_with(
        common::cases(&["haiku", "multi-turn", "code", "long"]),
        &[0; 4],
        2048,
        16,
        SlotAttention::Fused,
        false,
        None,
    );
}

/// Sequences join and leave the slot cache at different steps: slots are refilled, rows and
/// capacity change bucket (up to six requests at once), and every case still yields mlx_lm's
/// ids, 16 tokens each (the short cases: the long prompt's chunks beside decoding rows are the
/// test above's).
#[test]
fn staggered_inserts_with_chunked_prefill() {
    run_with(
        common::short_reference_cases(),
        &[0, 3, 5, 9, 12, 15],
        16,
        16,
        SlotAttention::Fused,
        false,
        None,
    );
}

/// The same with every step reading the slots by explicit operations (matmul, mask, softmax,
/// matmul: CUDA's choice for decode steps), prompt chunks included. The short cases only: the
/// long prompt's 30 s of CPU prefill adds nothing the runs above do not check.
#[test]
fn staggered_inserts_with_chunked_prefill_explicit_slot_attention() {
    run_with(
        common::short_reference_cases(),
        &[0, 3, 5, 9, 12, 15],
        16,
        16,
        SlotAttention::Explicit,
        false,
        None,
    );
}

/// The same with decode steps compiled by MLX (a GPU's default): traced once per shape and
/// replayed, buffers passed in and out, warm-up included (short cases, as above, each to its
/// end: all of mlx_lm's ids).
#[test]
fn staggered_inserts_with_chunked_prefill_compiled_decode() {
    run_with(
        common::short_reference_cases(),
        &[0, 3, 5, 9, 17, 30],
        16,
        common::reference().max_tokens,
        SlotAttention::Fused,
        true,
        None,
    );
}

/// Prompt lookup proposing for up to 8 rows (a GPU's setting, here on the CPU), verifying
/// whenever a row proposes (not where measured steps say it pays: tests do not depend on time).
const LOOKUP: PromptLookup = PromptLookup {
    num_draft_tokens: 4,
    min_ngram: 2,
    max_ngram: 8,
    max_rows: 8,
    adaptive: false,
};

/// Prompt lookup in the batch (verify steps of each row's last token and its proposals, the
/// rejected ones rewound) keeps every case's ids mlx_lm's greedy ids, with decode steps built
/// op by op and compiled, while rows join and leave; proposals are made and some accepted.
#[test]
fn prompt_lookup_keeps_mlx_lms_ids() {
    let short = common::short_reference_cases();
    for compile_decode in [false, true] {
        // Compiled, every short case; op by op, the last three (unicode, raw-text, code):
        // unicode's output repeats its own n-grams, so proposals are accepted there, and most
        // of the others' are rejected.
        let (cases, insert_at) = if compile_decode {
            (short.clone(), &[0, 3, 5, 9, 17, 30][..])
        } else {
            (short[3..].to_vec(), &[0, 3, 5][..])
        };
        let times = run_with(
            cases,
            insert_at,
            16,
            common::reference().max_tokens,
            SlotAttention::Fused,
            compile_decode,
            Some(LOOKUP),
        );
        assert!(times.verify_steps > 0, "{times:?}");
        assert!(times.accepted_draft_tokens > 0, "{times:?}");
        assert!(
            times.accepted_draft_tokens < times.draft_tokens,
            "{times:?}"
        );
    }
}

/// Output that repeats its prompt (a text copied again) is mostly accepted proposals: the same
/// ids as without prompt lookup in fewer decode steps, each request's stats counting them; a
/// row that samples joins the verify steps without proposing, with the tokens it gets alone.
#[test]
fn prompt_lookup_pays_on_repeated_text() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    // What the model copies token for token (checked: greedy, 41 tokens, then its end).
    let ask = "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\n\
               def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b";
    let prompt = tokenizer
        .encode_chat(&[perch_engine::ChatMessage::new("user", ask)])
        .unwrap();
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = 48;
    let run = |lookup: Option<PromptLookup>, requests: Vec<GenerateRequest>| {
        let config = BatchConfig {
            prompt_lookup: lookup,
            ..BatchConfig::for_budget(model.as_ref(), 256 << 20, 32, None)
        };
        let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
        let outputs = common::drive(&mut batch, requests.into_iter().map(|r| (0, r)).collect());
        assert_eq!(batch.kv_stats().blocks_used, 0);
        (outputs, batch.step_times())
    };
    // Without prompt lookup, one request: its steps are those of two at once.
    let (plain, plain_times) = run(None, vec![request.clone()]);
    let plain = &plain[0].0;
    let (looked_up, times) = run(Some(LOOKUP), vec![request.clone(), request.clone()]);
    for (b, streamed) in &looked_up {
        assert_eq!(plain.token_ids, b.token_ids);
        assert_eq!(&b.text, streamed);
        assert!(b.token_ids.len() > 30, "{:?}", b.text);
        assert!(
            b.stats.accepted_draft_tokens * 2 > b.token_ids.len(),
            "{:?}",
            b.stats
        );
        assert!(b.stats.accepted_draft_tokens <= b.stats.draft_tokens);
    }
    assert_eq!(plain_times.verify_steps, 0);
    assert!(
        times.decode_steps * 2 < plain_times.decode_steps,
        "{} decode steps with prompt lookup, {} without",
        times.decode_steps,
        plain_times.decode_steps
    );
    // A sampled row in the batch joins the verify steps feeding its last token alone (prompt
    // lookup proposes for greedy rows only): it draws as in plain steps, so its tokens are those
    // it gets alone, and the greedy row still proposes beside it.
    let mut sampled = request.clone();
    sampled.sampling.temperature = 0.8;
    sampled.sampling.seed = Some(3);
    // It outlives the greedy request, so no step has the greedy row alone: it takes 32 steps (a
    // token each), the greedy row fewer than 24 (as in the run above: under half the plain
    // run's steps, which are at most its 48 tokens).
    sampled.max_tokens = 32;
    sampled.ignore_eos = true;
    let alone = common::generate_alone(model.as_ref(), &tokenizer, &sampled).unwrap();
    let (outputs, mixed) = run(Some(LOOKUP), vec![request, sampled]);
    assert!(mixed.verify_steps > 0, "{mixed:?}");
    assert!(outputs[0].0.stats.accepted_draft_tokens > 0);
    assert_eq!(outputs[1].0.token_ids, alone.token_ids);
    assert_eq!(outputs[1].0.stats.draft_tokens, 0);
}

/// Runs a request of 12 tokens (its EOS ignored) for each of `cases`, set by `set(i, request)`
/// and inserted at step `insert_at[i]`, in one batch of the default model, and asserts each gets
/// the ids it gets alone through `generate`; returns the outputs alone.
fn batch_matches_alone(
    cases: &[common::ReferenceCase],
    insert_at: &[usize],
    set: impl Fn(usize, &mut GenerateRequest),
) -> Vec<GenerateOutput> {
    let requests: Vec<GenerateRequest> = cases
        .iter()
        .enumerate()
        .map(|(i, case)| {
            let mut request = GenerateRequest::new(case.prompt_ids.clone());
            request.max_tokens = 12;
            request.ignore_eos = true;
            set(i, &mut request);
            request
        })
        .collect();
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let alone: Vec<_> = requests
        .iter()
        .map(|r| common::generate_alone(model.as_ref(), &tokenizer, r).unwrap())
        .collect();
    let config = BatchConfig {
        prefill_batch_size: 4,
        ..BatchConfig::for_budget(model.as_ref(), 256 << 20, 32, None)
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    let schedule = requests
        .into_iter()
        .zip(insert_at.iter().copied())
        .map(|(r, at)| (at, r))
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    for (i, ((batched, _), alone)) in outputs.iter().zip(&alone).enumerate() {
        assert_eq!(batched.token_ids, alone.token_ids, "request {i}");
        assert_eq!(batched.token_ids.len(), 12);
    }
    alone
}

/// Sampled rows that share one batched draw a step (temperature with top-p or min-p, no
/// processors) give each request the tokens it gets alone: four that fill the decode slots from
/// the first step (each next step feeds the draws in place, `InFlight::in_place`) and a fifth
/// joining later (the slots grow past the rows: its steps gather the draws), with a greedy row
/// among the late ones.
#[test]
fn batched_draws_match_generate_alone() {
    let cases = common::cases(&["sky", "haiku", "raw-text", "code", "multi-turn", "sky"]);
    let alone = batch_matches_alone(&cases, &[0, 0, 0, 0, 6, 8], |i, request| {
        if i != 5 {
            request.sampling.temperature = 0.8 + 0.1 * i as f32;
            match i % 2 {
                0 => request.sampling.top_p = 0.9,
                _ => request.sampling.min_p = 0.05,
            }
            request.sampling.seed = Some(11 + i as u64);
        }
    });
    // Sampling happened: request 0 leaves mlx_lm's greedy ids for its prompt.
    assert_ne!(
        alone[0].token_ids,
        common::expected_prefix(&cases[0], 12),
        "request 0 sampled"
    );
}

/// Seeded sampling with XTC, repetition, presence and frequency penalties, and
/// log-probabilities, run in the batch (whose decode steps are pipelined: each row's next input,
/// sampler key and penalty window come from the device before the host reads the token) give
/// each request the tokens and log-probabilities it gets alone through `generate` (request 2
/// also asks for log-probabilities, which ride along); the greedy row beside them gets mlx_lm's
/// greedy ids.
#[test]
fn seeded_sampling_matches_generate_alone() {
    // Roles by position (below); any prompts would do (every request ignores its EOS), so
    // short ones for requests 2 and 3 (raw-text's 5 tokens, code's 40).
    let cases = common::cases(&["sky", "haiku", "raw-text", "code"]);
    let alone = batch_matches_alone(&cases, &[0, 0, 2, 5], |i, request| {
        if i != 1 {
            // Request 1 stays greedy: plain greedy and sampled rows share the steps.
            request.sampling.temperature = 0.9;
            request.sampling.top_p = 0.95;
            request.sampling.repetition_penalty = 1.3;
            request.sampling.seed = Some(7 + i as u64);
        }
        if i == 0 {
            // XTC (its uniform draw and the categorical share the request's key stream).
            request.sampling.xtc_probability = 0.5;
            request.sampling.xtc_threshold = 0.05;
        }
        if i == 2 {
            request.logprobs = Some(3);
        }
        if i == 3 {
            // OpenAI's penalties, each over its own window of recent tokens.
            request.sampling.presence_penalty = 0.4;
            request.sampling.frequency_penalty = 0.6;
            request.sampling.frequency_context_size = 8;
        }
    });
    assert_eq!(
        alone[1].token_ids,
        common::expected_prefix(&cases[1], 12),
        "the greedy request"
    );
    // Sampling happened: the seeded requests leave the greedy path (request 0's ids differ
    // from mlx_lm's greedy ids for its prompt, which reach no EOS in 12 tokens).
    assert_ne!(
        alone[0].token_ids,
        common::expected_prefix(&cases[0], 12),
        "request 0 sampled"
    );
}
