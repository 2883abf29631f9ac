//! The batch over its block pool: prefix-cache hits give exactly the cold tokens (also across
//! the turns of a chat), cancels free every block, a tiny pool preempts and still completes
//! every request exactly, a prompt larger than the pool is rejected and a
//! `max_tokens` past the pool is clamped, a pinned prefix outlives eviction and misses say why.

mod common;

use perch_engine::models;
use perch_engine::models::Model;
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{ChatMessage, EngineError, FinishReason, GenerateRequest, Tokenizer};

fn load() -> (Box<dyn Model>, Tokenizer) {
    let dir = common::model_dir();
    (models::load(&dir).unwrap(), Tokenizer::load(&dir).unwrap())
}

fn config(num_blocks: usize, block_size: usize) -> BatchConfig {
    BatchConfig {
        max_running: 32,
        // Several sequences prefill per step: the path's multi-row forward.
        prefill_batch_size: 4,
        prefill_token_budget: 256,
        // Every free prefill slot taken (the GPU's policy), whatever the prompts' lengths.
        prefill_fits_budget: false,
        block_size,
        num_blocks,
        bounded_layer_bytes: 0,
        kv_quantization: None,
        slot_attention: Default::default(),
        compile_decode: false,
        prompt_lookup: None,
        lowered_for_memory: None,
        draft_kv_counted: false,
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = max_tokens;
    request
}

/// `bytes` of memory left, bounded by a cgroup (what a test's headroom reads).
fn cgroup_room(bytes: usize) -> Option<perch_engine::memory::Available> {
    Some(perch_engine::memory::Available {
        bytes: bytes as u64,
        bound: perch_engine::memory::MemoryBound::Cgroup,
    })
}

/// How many of `batch`'s waiting requests one step admits with `headroom`.
fn admitted_in_one_step(
    batch: &mut BatchGenerator,
    headroom: Option<perch_engine::memory::Available>,
) -> usize {
    batch.set_memory_headroom(headroom);
    batch.step().unwrap();
    batch.num_running()
}

/// [`admitted_in_one_step`]; then, memory back, the batch runs to its end.
fn admitted_then_drained(
    batch: &mut BatchGenerator,
    headroom: Option<perch_engine::memory::Available>,
) -> usize {
    let admitted = admitted_in_one_step(batch, headroom);
    batch.set_memory_headroom(None);
    while !batch.is_empty() {
        batch.step().unwrap();
    }
    admitted
}

/// Case `i` of `cases` at step `i * stagger`, `max_tokens` each.
fn reference_schedule(
    cases: &[common::ReferenceCase],
    stagger: usize,
    max_tokens: usize,
) -> Vec<(usize, GenerateRequest)> {
    cases
        .iter()
        .enumerate()
        .map(|(i, case)| (i * stagger, request(case.prompt_ids.clone(), max_tokens)))
        .collect()
}

/// Each output is mlx_lm's first `max_tokens` ids for its case, ended as mlx_lm's.
fn assert_reference(
    cases: &[common::ReferenceCase],
    outputs: &[(perch_engine::GenerateOutput, String)],
    max_tokens: usize,
) {
    assert_eq!(cases.len(), outputs.len());
    for (case, (output, _)) in cases.iter().zip(outputs) {
        assert_eq!(
            output.token_ids,
            common::expected_prefix(case, max_tokens),
            "case {}",
            case.id
        );
        assert_eq!(
            output.finish_reason,
            common::expected_finish(case, max_tokens),
            "case {}",
            case.id
        );
    }
}

/// Blocks are published from their slots, and a leaving sequence's slot is refilled by another.
#[test]
fn prefix_cache_hits_give_the_cold_tokens() {
    let (model, tokenizer) = load();
    // The short prompts (the long one's cold prefill costs half a minute of CPU), in prefill
    // chunks of 16 tokens: hits span chunks. 8 tokens each: what is cached of a prompt does
    // not depend on how much follows it.
    let cases = common::short_reference_cases();
    let max_tokens = 8;
    let block_size = 8;
    let mut batch = BatchGenerator::new(
        model.as_ref(),
        &tokenizer,
        BatchConfig {
            prefill_token_budget: 16,
            ..config(512, block_size)
        },
        "smollm",
    );
    let cold = common::drive(&mut batch, reference_schedule(&cases, 0, max_tokens));
    assert_reference(&cases, &cold, max_tokens);
    assert!(cold.iter().all(|(o, _)| o.stats.cached_prompt_tokens == 0));

    // Same prompts again: every full block but the one holding the last prompt token is a hit.
    let warm = common::drive(&mut batch, reference_schedule(&cases, 2, max_tokens));
    assert_reference(&cases, &warm, max_tokens);
    for (case, (output, _)) in cases.iter().zip(&warm) {
        let expected = (case.prompt_ids.len() - 1) / block_size * block_size;
        assert_eq!(
            output.stats.cached_prompt_tokens, expected,
            "case {}",
            case.id
        );
    }
    let kv = batch.kv_stats();
    assert!(kv.prefix_cache_hit_rate > 0.4, "{kv:?}");
    assert_eq!(kv.blocks_used, 0);
    assert!(
        kv.blocks_cached_free > 0 && kv.prefix_cache_bytes > 0,
        "{kv:?}"
    );
}

#[test]
fn every_turn_of_a_chat_hits_the_previous_one() {
    let (model, tokenizer) = load();
    let block_size = 16;
    let mut batch = BatchGenerator::new(
        model.as_ref(),
        &tokenizer,
        config(512, block_size),
        "smollm",
    );
    let mut messages = vec![
        ChatMessage::new("system", "You are a concise assistant."),
        ChatMessage::new("user", "Name a color."),
    ];
    let mut previous_len = 0;
    for (turn, next) in [
        "Name another one.",
        "And one more?",
        "Which of them is warmest?",
    ]
    .into_iter()
    .enumerate()
    {
        let prompt = tokenizer.encode_chat(&messages).unwrap();
        let (output, _) =
            common::drive(&mut batch, vec![(0, request(prompt.clone(), 24))]).remove(0);
        if turn > 0 {
            // The previous turn's prompt and answer are in the cache, up to whole blocks.
            assert!(
                output.stats.cached_prompt_tokens >= previous_len / block_size * block_size,
                "turn {turn}: {} cached of a {previous_len}-token previous conversation",
                output.stats.cached_prompt_tokens
            );
            // Cold, in a fresh batch, the same prompt gives the same tokens.
            let mut fresh = BatchGenerator::new(
                model.as_ref(),
                &tokenizer,
                config(512, block_size),
                "smollm",
            );
            let (cold, _) =
                common::drive(&mut fresh, vec![(0, request(prompt.clone(), 24))]).remove(0);
            assert_eq!(cold.stats.cached_prompt_tokens, 0);
            assert_eq!(output.token_ids, cold.token_ids, "turn {turn}");
        }
        previous_len = prompt.len() + output.token_ids.len();
        messages.push(ChatMessage::new("assistant", &output.text));
        messages.push(ChatMessage::new("user", next));
    }
}

/// Blocks are published from their slots, and a leaving sequence's slot is refilled by another.
#[test]
fn cancel_mid_prefill_and_mid_decode_frees_every_block() {
    let (model, tokenizer) = load();
    let cases = common::short_reference_cases();
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(64, 8), "smollm");
    let long: Vec<u32> = cases[1..]
        .iter()
        .flat_map(|c| c.prompt_ids.iter().copied())
        .collect();
    // Prefill goes oldest first: the short request prefills in step 1, the long one from step 2.
    let decoding = batch
        .insert(request(cases[0].prompt_ids.clone(), 100))
        .unwrap();
    let mut prefilling = request(long.clone(), 8);
    prefilling.prefill_step_size = 32;
    let prefilling = batch.insert(prefilling).unwrap();
    let mut tokens = 0;
    for _ in 0..3 {
        tokens += batch.step().unwrap().len();
    }
    assert!(tokens > 0, "the short request is decoding");
    assert!(
        batch.kv_stats().blocks_used > long.len() / 8 / 2,
        "the long prompt holds blocks"
    );
    let out = batch.remove(prefilling).unwrap().unwrap();
    assert_eq!(
        (out.finish_reason, out.token_ids.len()),
        (FinishReason::Cancelled, 0)
    );
    let out = batch.remove(decoding).unwrap().unwrap();
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(!out.token_ids.is_empty());
    assert!(batch.is_empty());
    let kv = batch.kv_stats();
    assert_eq!(
        (kv.blocks_used, kv.blocks_cached_free + kv.blocks_empty),
        (0, kv.blocks_total),
        "{kv:?}"
    );
    // The computed full blocks of both stay cached: the long prompt's first 2 chunks (64 tokens)
    // and the short prompt's 4 full blocks.
    assert!(kv.blocks_cached_free >= 64 / 8 + 4, "{kv:?}");
    assert!(
        batch.remove(prefilling).unwrap().is_none(),
        "a removed request is gone"
    );
}

/// Preempted sequences leave their slots and come back through the prefix cache.
#[test]
fn a_tiny_pool_preempts_and_still_completes_every_request_exactly() {
    let (model, tokenizer) = load();
    let cases = common::short_reference_cases();
    // 12 blocks of 8 tokens (96) hold the largest request (unicode: 57 + 16 tokens) but not all
    // six at once, nor even the first two admitted: sky's and haiku's prompts take 5 and 4
    // blocks (multi-turn's 8 then wait), and their 16 tokens grow them to 7 and 6 (51 and 42
    // positions).
    let max_tokens = 16;
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(12, 8), "smollm");
    let outputs = common::drive(&mut batch, reference_schedule(&cases, 0, max_tokens));
    assert_reference(&cases, &outputs, max_tokens);
    for (output, streamed) in &outputs {
        assert_eq!(
            streamed, &output.text,
            "preemption never repeats or drops streamed text"
        );
    }
    let kv = batch.kv_stats();
    assert!(
        kv.preemptions > 0,
        "the pool was too small to run everything at once: {kv:?}"
    );
    assert_eq!(kv.blocks_used, 0);
}

#[test]
fn a_prompt_larger_than_the_pool_is_rejected_and_max_tokens_is_clamped_to_the_pool() {
    let (model, tokenizer) = load();
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(4, 8), "smollm");
    // 32 tokens of pool: a 32-token prompt leaves no room for a generated token.
    let err = batch.insert(request(vec![1; 32], 4)).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::KvCacheTooSmall {
                prompt_tokens: 32,
                capacity_tokens: 32,
                lowered: None,
                shared_with_draft: false,
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("shorten the prompt or raise the KV cache budget"),
        "{err}"
    );
    assert!(!err.to_string().contains("draft"), "{err}");
    assert!(batch.is_empty());
    // 20 + 16 tokens do not fit: the request runs with max_tokens lowered to the 12 that do and
    // ends with reason `length` after exactly 12 tokens.
    let mut long = request(vec![1; 20], 16);
    long.ignore_eos = true;
    let outputs = common::drive(&mut batch, vec![(0, long)]);
    let (output, _) = &outputs[0];
    assert_eq!(output.finish_reason, FinishReason::Length);
    assert_eq!(output.token_ids.len(), 12, "{output:?}");
    assert!(output.stats.cut_for_memory, "{output:?}");
    assert_eq!(batch.kv_stats().blocks_used, 0);
}

/// A pool whose budget was lowered to fit memory says so, and asks for memory, not a budget.
#[test]
fn a_budget_lowered_for_memory_says_so_when_a_prompt_does_not_fit() {
    let (model, tokenizer) = load();
    let lowered = perch_engine::memory::LoweredBudget {
        configured_bytes: 2 << 30,
        available_bytes: 140_000_000,
    };
    let config = BatchConfig {
        lowered_for_memory: Some(lowered),
        ..config(4, 8)
    };
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    let err = batch
        .insert(request(vec![1; 32], 4))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("the budget was lowered from 2.1 GB to fit the 140 MB of memory left")
            && err.contains("close other apps")
            && !err.contains("raise the KV cache budget"),
        "{err}"
    );
}

/// Under memory pressure (`hold_admissions`), a waiting request starts only once nothing runs;
/// released, admission is as before. Every request still gets its tokens.
#[test]
fn held_admissions_wait_while_a_request_runs() {
    let (model, tokenizer) = load();
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(64, 8), "smollm");
    let mut first = request(vec![1, 504, 2988], 6);
    first.ignore_eos = true;
    batch.insert(first.clone()).unwrap();
    batch.step().unwrap();
    assert_eq!(batch.num_running(), 1);
    batch.hold_admissions(true);
    batch.insert(first.clone()).unwrap();
    let mut waited = 0;
    while batch.num_running() == 1 && batch.num_waiting() == 1 {
        batch.step().unwrap();
        waited += 1;
        assert!(waited < 20, "the first request never finished");
    }
    assert!(
        waited >= 4,
        "the second waited for the first: {waited} steps"
    );
    assert_eq!((batch.num_running(), batch.num_waiting()), (0, 1));
    // Nothing runs: it starts at the next step, held or not.
    batch.step().unwrap();
    assert_eq!(
        (batch.num_running(), batch.num_waiting()),
        (1, 0),
        "then it ran alone"
    );
    // Released: two more start together.
    batch.hold_admissions(false);
    batch.insert(first.clone()).unwrap();
    batch.insert(first).unwrap();
    batch.step().unwrap();
    assert_eq!(batch.num_waiting(), 0);
    while !batch.is_empty() {
        batch.step().unwrap();
    }
}

/// With a memory headroom (`set_memory_headroom`), waiting requests are admitted only while
/// the slot caches' buffers they make grow fit it (a growing cache's new buffers in whole); the
/// headroom is spent by what was admitted until the next reading; without one, all are admitted
/// together. When nothing runs and the first does not fit, it waits for the next reading (the
/// prefix cache dropped meanwhile) and is then refused with the memory it needs, the others
/// judged in turn.
#[test]
fn admissions_fit_the_memory_headroom() {
    let (model, tokenizer) = load();
    let row = perch_engine::testing::kv_bytes_per_token(model.as_ref(), None) * 256;
    let mut first = request(vec![1, 504, 2988], 4);
    first.ignore_eos = true;
    let new_batch = |requests: usize| {
        let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(64, 8), "smollm");
        for _ in 0..requests {
            batch.insert(first.clone()).unwrap();
        }
        batch
    };
    // (Nothing is asserted after the admission: the batch is dropped with its requests.)
    let run = |headroom: Option<perch_engine::memory::Available>, requests: usize| {
        admitted_in_one_step(&mut new_batch(requests), headroom)
    };
    // The activations of the step that admits `rows` of these prompts (3 tokens each, over 4
    // positions at most).
    let step = |rows: usize| {
        perch_engine::testing::step_activation_bytes(model.as_ref(), (3 * rows, rows, 4))
    };
    // Two requests: two rows of 256 positions in each of the prefill and decode caches, and
    // the step's activations.
    assert_eq!(run(cgroup_room(4 * row + step(2)), 4), 2);
    assert_eq!(run(cgroup_room(4 * row + step(2) - 1), 4), 1);
    // Three or four make each cache four rows (the row buckets are 1, 2, 4, 8, ...); five,
    // eight.
    assert_eq!(run(cgroup_room(8 * row - 1), 4), 2);
    assert_eq!(run(cgroup_room(8 * row + step(4)), 6), 4);
    assert_eq!(run(None, 4), 4);

    // Nothing runs and one request does not fit: it waits for a fresh reading, then (the
    // prefix cache dropped) for another, then is refused.
    let mut batch = new_batch(2);
    batch.set_memory_headroom(cgroup_room(2 * row - 1));
    // As much as the engine had at load: more would never come, so the refusal is the
    // prompt's (a client error).
    batch.set_memory_capacity(Some(2 * row as u64 - 1));
    for _ in 0..2 {
        assert!(batch.step().unwrap().is_empty());
        assert!(batch.awaits_memory_reading());
        assert_eq!((batch.num_running(), batch.num_waiting()), (0, 2));
        batch.set_memory_headroom(cgroup_room(2 * row - 1));
    }
    let events = batch.step().unwrap();
    let refused: Vec<String> = events
        .iter()
        .filter_map(|event| match event {
            perch_engine::testing::BatchEvent::Refused { error, .. } => {
                assert_eq!(
                    error.kind(),
                    perch_engine::api::ErrorKind::ContextLengthExceeded
                );
                Some(error.to_string())
            }
            _ => None,
        })
        .collect();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].starts_with("a prompt of 3 tokens needs ")
            && refused[0].contains("(the memory limit of the cgroup Perch runs in)"),
        "{}",
        refused[0]
    );
    // The second is judged anew (it waits for a reading), and runs once memory is back.
    assert_eq!((batch.num_running(), batch.num_waiting()), (0, 1));
    batch.set_memory_headroom(cgroup_room(2 * row + step(1)));
    batch.step().unwrap();
    assert_eq!(batch.num_running(), 1);

    // A reading too low for the next request alone, as one taken while others still ran, drops
    // nothing: the request waits for a fresh reading and runs at it, the prefix cache kept.
    let mut batch = new_batch(0);
    batch.insert(request((100..120).collect(), 4)).unwrap();
    while !batch.is_empty() {
        batch.step().unwrap();
    }
    let cached = batch.kv_stats().blocks_cached_free;
    assert!(cached > 0, "the first request's blocks stay cached");
    batch.insert(request(vec![1, 700, 701], 4)).unwrap();
    batch.set_memory_headroom(cgroup_room(2 * row - 1));
    assert!(batch.step().unwrap().is_empty());
    assert!(batch.awaits_memory_reading());
    batch.set_memory_headroom(cgroup_room(2 * row + step(1)));
    batch.step().unwrap();
    assert_eq!(batch.num_running(), 1);
    assert_eq!(batch.kv_stats().blocks_cached_free, cached);
}

/// Admission counts the copies a prompt's full blocks add to the prefix cache's store only
/// for blocks that become new entries: not a prefix already cached, nor one the request
/// admitted just before shares.
#[test]
fn admission_counts_only_new_prefix_cache_blocks() {
    let (model, tokenizer) = load();
    let position = perch_engine::testing::kv_bytes_per_token(model.as_ref(), None);
    let row = position * 256;
    // 40 tokens: five full blocks of 8.
    let prompt: Vec<u32> = (200..240).collect();
    let admitted = |batch: &mut BatchGenerator, bytes: usize| {
        for _ in 0..2 {
            batch.insert(request(prompt.clone(), 2)).unwrap();
        }
        admitted_then_drained(batch, cgroup_room(bytes))
    };
    // Two rows of 256 positions in each of the prefill and decode caches (4 rows), the step's
    // activations (80 tokens over 41 positions), and the prompt's five blocks published once
    // (40 positions): its twin shares them.
    let step = perch_engine::testing::step_activation_bytes(model.as_ref(), (80, 2, 41));
    let fresh = || BatchGenerator::new(model.as_ref(), &tokenizer, config(64, 8), "smollm");
    assert_eq!(admitted(&mut fresh(), 4 * row + step + 40 * position), 2);
    assert_eq!(
        admitted(&mut fresh(), 4 * row + step + 40 * position - 1),
        1
    );
    // Once those blocks are cached, nothing is published: the rows alone.
    let mut batch = fresh();
    batch.insert(request(prompt.clone(), 2)).unwrap();
    while !batch.is_empty() {
        batch.step().unwrap();
    }
    assert!(batch.kv_stats().blocks_cached_free >= 5);
    assert_eq!(admitted(&mut batch, 4 * row + step), 2);
    assert_eq!(admitted(&mut batch, 4 * row + step - 1), 1);
}

/// A sequence preempted after streaming tokens that then cannot come back for memory ends
/// with what it has (`length`), not with an error that would leave its client without it.
#[test]
fn a_preempted_sequence_that_no_longer_fits_finishes_with_its_tokens() {
    use perch_engine::testing::BatchEvent;
    let (model, tokenizer) = load();
    // 6 blocks of 8: two sequences of 3 + 30 tokens cannot both stay.
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(6, 8), "smollm");
    let mut ids = Vec::new();
    for prompt in [vec![1, 504, 2988], vec![1, 504, 3000]] {
        let mut r = request(prompt, 30);
        r.ignore_eos = true;
        ids.push(batch.insert(r).unwrap());
    }
    let mut events = Vec::new();
    while batch.kv_stats().preemptions == 0 {
        events.extend(batch.step().unwrap());
        assert!(!batch.is_empty(), "finished without a preemption");
    }
    assert_eq!((batch.num_running(), batch.num_waiting()), (1, 1));
    // From now on no memory is left for a request alone: the one running ends first; the
    // preempted one is then judged, waits for a reading, and leaves the queue.
    let none = perch_engine::memory::Available {
        bytes: 0,
        bound: perch_engine::memory::MemoryBound::Cgroup,
    };
    for _ in 0..200 {
        if batch.is_empty() {
            break;
        }
        batch.set_memory_headroom(Some(none));
        events.extend(batch.step().unwrap());
    }
    assert!(batch.is_empty(), "the preempted sequence stays queued");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, BatchEvent::Refused { .. })),
        "nothing is refused"
    );
    let finished: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            BatchEvent::Finished { request, output } => Some((*request, output)),
            _ => None,
        })
        .collect();
    assert_eq!(finished.len(), 2);
    let generated: Vec<usize> = finished.iter().map(|(_, o)| o.token_ids.len()).collect();
    // One ran to its 30 tokens; the preempted one ended with fewer, but some.
    assert!(generated.contains(&30), "{generated:?}");
    assert!(
        generated.iter().any(|&n| (1..30).contains(&n)),
        "{generated:?}"
    );
    for (request, output) in &finished {
        assert_eq!(output.finish_reason, FinishReason::Length);
        // The one cut short says so; the one that reached its max_tokens does not.
        assert_eq!(
            output.stats.cut_for_memory,
            output.token_ids.len() < 30,
            "{output:?}"
        );
        // What was streamed is the output's text: nothing repeated or dropped.
        let streamed: String = events
            .iter()
            .filter_map(|e| match e {
                BatchEvent::Token { request: r, event } if r == request => {
                    Some(event.text.as_str())
                }
                _ => None,
            })
            .collect();
        assert_eq!(streamed, output.text);
    }
}

#[test]
fn importing_a_cached_prefix_again_evicts_nothing() {
    let (model, tokenizer) = load();
    // 6 blocks of 8: another prefix (1 block), then the 36-token prompt (4 blocks); one is empty.
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(6, 8), "smollm");
    let cases = common::reference_cases();
    let other: Vec<u32> = (100..109).collect();
    batch.compute_prefix(&other, 2048).unwrap();
    let prompt = cases[0].prompt_ids.clone();
    let cache = batch.compute_prefix(&prompt, 2048).unwrap();
    assert_eq!(batch.kv_stats().blocks_cached_free, 5);
    // Re-importing must reuse the 4 cached blocks, not take free ones and evict the other prefix.
    assert_eq!(batch.import_prefix(&prompt, &cache).unwrap(), 32);
    let kv = batch.kv_stats();
    assert_eq!(
        (kv.blocks_cached_free, kv.blocks_empty, kv.blocks_used),
        (5, 1, 0),
        "{kv:?}"
    );
}

#[test]
fn a_long_prompt_is_prefilled_in_budget_slices_while_others_decode() {
    use perch_engine::testing::BatchEvent;
    let (model, tokenizer) = load();
    let mut config = config(64, 16);
    config.prefill_token_budget = 64;
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    let cases = common::reference_cases();
    let mut short = request(cases[0].prompt_ids.clone(), 24);
    short.ignore_eos = true;
    let first = batch.insert(short).unwrap();
    // The short request decodes from its first step on; decode steps are pipelined, so a step's
    // tokens are read (and streamed) during the next step.
    let produced = |events: &[BatchEvent], id| {
        events
            .iter()
            .any(|e| matches!(e, BatchEvent::Token { request, .. } if *request == id))
    };
    assert!(
        !produced(&batch.step().unwrap(), first),
        "read one step later"
    );

    // 200 prompt tokens sharing no prefix with the first: 199 to prefill before the last one is
    // decoded, in slices of 64 (steps 1 to 4); its first decode step, in step 4, is read in 5.
    let long_prompt: Vec<u32> = (1000..1200).collect();
    let second = batch.insert(request(long_prompt, 4)).unwrap();
    for step in 1..=5 {
        let events = batch.step().unwrap();
        assert!(
            produced(&events, first),
            "the running stream waits at step {step}"
        );
        assert_eq!(
            produced(&events, second),
            step == 5,
            "first token of the long prompt at step {step}"
        );
    }
}

/// What a chat request (lane `chat_lane`) meets when it arrives one step into a long background
/// prompt's prefill (lane `background_lane`), on the CPU's policy (slots fitted to the budget),
/// nothing having run in a higher lane before:
/// the steps after its insertion at which each request's first token is read, and both outputs;
/// the prompt tokens computed by the first step after its insertion and by the step that handed
/// out the chat's first token, and the prefill slots yielded.
fn chat_behind_background(
    chat_lane: perch_engine::Priority,
    background_lane: perch_engine::Priority,
) -> ([(usize, perch_engine::GenerateOutput); 2], [u64; 2], u64) {
    use perch_engine::testing::BatchEvent;
    let (model, tokenizer) = load();
    let mut config = config(256, 16);
    config.prefill_token_budget = 64;
    config.prefill_fits_budget = true;
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    // 320 prompt tokens: five budget-wide chunks (the last of 63: the last token is fed by the
    // first decode step).
    let mut background = request((1000..1320).collect(), 4);
    background.ignore_eos = true;
    background.priority = background_lane;
    let background = batch.insert(background).unwrap();
    batch.step().unwrap();
    let case = &common::short_reference_cases()[0];
    let mut chat = request(case.prompt_ids.clone(), CHAT_TOKENS);
    chat.priority = chat_lane;
    let chat = batch.insert(chat).unwrap();
    let ids = [chat, background];
    let mut first = [None, None];
    let mut outputs = [None, None];
    // Prompt tokens computed by the first step, and by the step that handed out the chat's
    // first token.
    let mut tokens = [0, u64::MAX];
    for step in 1..400 {
        let before = batch.step_times().prefill_tokens;
        let events = batch.step().unwrap();
        let computed = batch.step_times().prefill_tokens - before;
        if step == 1 {
            tokens[0] = computed;
        }
        for event in events {
            match event {
                BatchEvent::Token { request, .. } => {
                    let k = ids.iter().position(|&id| id == request).unwrap();
                    if k == 0 && first[0].is_none() {
                        tokens[1] = computed;
                    }
                    first[k].get_or_insert(step);
                }
                BatchEvent::Finished { request, output } => {
                    let k = ids.iter().position(|&id| id == request).unwrap();
                    outputs[k] = Some(*output);
                }
                BatchEvent::Refused { error, .. } => panic!("refused: {error}"),
                BatchEvent::Admitted { .. } => {}
            }
        }
        if batch.is_empty() {
            break;
        }
    }
    let mut take = |k: usize| {
        (
            first[k].expect("a first token"),
            outputs[k].take().expect("finished"),
        )
    };
    let preemptions = batch.kv_stats().prefill_yields;
    ([take(0), take(1)], tokens, preemptions)
}

/// The chat's `max_tokens` in [`chat_behind_background`].
const CHAT_TOKENS: usize = 8;

#[test]
fn a_chat_in_the_high_lane_prefills_between_the_chunks_of_a_background_prompt() {
    use perch_engine::Priority;
    let case = &common::short_reference_cases()[0];
    let chat_steps = (case.prompt_ids.len() - 1).div_ceil(64);
    let ([(chat, chat_ids), (background, background_ids)], tokens, preempted) =
        chat_behind_background(Priority::High, Priority::Low);
    // The step after it arrives computes the chat's prompt alone (no background chunk beside).
    assert_eq!(tokens[0] as usize, (case.prompt_ids.len() - 1).min(64));
    // The step that hands out its first token runs no background pass before it (it only reads
    // the token: `first_token_waits_for_lower_lane`).
    assert_eq!(tokens[1], 0, "a pass ran before the chat's first token");
    // Its prompt in its own chunks at once (the background's pausing), its first token read
    // one step after the one that completes it; the background prompt's first token after.
    assert!(
        chat <= chat_steps + 1,
        "the chat's first token at step {chat}, {chat_steps} chunks"
    );
    assert!(background > chat, "background {background}, chat {chat}");
    // It left the batch while the chat's prompt was computed (its blocks kept in the prefix
    // cache) and came back.
    assert_eq!(preempted, 1);
    assert_eq!(
        chat_ids.token_ids,
        common::expected_prefix(case, CHAT_TOKENS)
    );
    assert_eq!(
        chat_ids.finish_reason,
        common::expected_finish(case, CHAT_TOKENS)
    );
    // In one lane the chat waits for the background prompt, which then computes the same ids
    // (pausing it changed nothing of what it computes).
    let (
        [(chat_fcfs, chat_fcfs_ids), (background_fcfs, background_fcfs_ids)],
        tokens,
        preempted_fcfs,
    ) = chat_behind_background(Priority::Normal, Priority::Normal);
    assert_eq!(tokens[0], 64, "a background chunk");
    // The background's last four chunks take steps 1 to 4, so the chat's prompt is computed
    // in step 4 at the earliest and its first token read in step 5 at the earliest (in fact
    // in 6: 63 + 35 tokens do not fit one step's 64).
    assert!(
        chat_fcfs > background_fcfs && chat_fcfs >= 5,
        "first come, first served: chat {chat_fcfs}, background {background_fcfs}"
    );
    assert_eq!(chat_fcfs_ids.token_ids, chat_ids.token_ids);
    assert_eq!(preempted_fcfs, 0);
    assert_eq!(background_fcfs_ids.token_ids, background_ids.token_ids);
}

#[test]
fn a_high_lane_request_takes_the_place_of_a_low_one_in_a_full_batch() {
    use perch_engine::Priority;
    let (model, tokenizer) = load();
    let mut config = config(256, 16);
    config.max_running = 2;
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "smollm");
    let cases = common::short_reference_cases();
    let max_tokens = common::reference().max_tokens;
    let lane = |case: &common::ReferenceCase, priority| {
        let mut r = request(case.prompt_ids.clone(), max_tokens);
        r.priority = priority;
        r
    };
    let low: Vec<_> = (1..3)
        .map(|k| batch.insert(lane(&cases[k], Priority::Low)).unwrap())
        .collect();
    for _ in 0..3 {
        batch.step().unwrap();
    }
    assert_eq!((batch.num_running(), batch.num_waiting()), (2, 0));
    let high = batch.insert(lane(&cases[0], Priority::High)).unwrap();
    batch.step().unwrap();
    // The newest low request left the batch for it (and waits to go on from the start).
    assert_eq!((batch.num_running(), batch.num_waiting()), (2, 1));
    let mut outputs = std::collections::HashMap::new();
    while !batch.is_empty() {
        for event in batch.step().unwrap() {
            if let perch_engine::testing::BatchEvent::Finished { request, output } = event {
                outputs.insert(request, output);
            }
        }
    }
    for (id, case) in [(high, &cases[0]), (low[0], &cases[1]), (low[1], &cases[2])] {
        let output = &outputs[&id];
        assert_eq!(
            output.token_ids,
            common::expected_ids(case, output.finish_reason),
            "case {}",
            case.id
        );
    }
}

/// A prefix pinned for a client (`cache_control`) stays cached while other prompts evict an
/// unpinned one, gives the cold tokens, and each miss says why.
#[test]
fn a_pinned_prefix_outlives_eviction_and_misses_are_explained() {
    use perch_engine::CacheMiss;
    use perch_sched::block_pool::EvictionCause;
    let (model, tokenizer) = load();
    // Blocks of 8 tokens, prompts of whole blocks and halves: the system prompt 5 blocks, a
    // question 2.5, another client's prompt 7.5, a filler 6.25.
    let block_size = 8;
    // 24 blocks: pins hold 6 at most.
    let mut batch =
        BatchGenerator::new(model.as_ref(), &tokenizer, config(24, block_size), "smollm");
    let ids = |from: u32, n: u32| -> Vec<u32> { (from..from + n).collect() };
    let system = ids(1000, 40);
    let prompt = |question: u32| [system.clone(), ids(question, 20)].concat();
    let client = |request: &mut GenerateRequest, name: &str| {
        request.client = Some(name.to_owned());
    };
    let run = |batch: &mut BatchGenerator, request: GenerateRequest| {
        common::drive(batch, vec![(0, request)]).remove(0).0
    };
    // The agent's first request pins its system prompt: 40 tokens, computed now.
    let mut first = request(prompt(3000), 2);
    client(&mut first, "agent");
    first.cache_pins = system_pin();
    let first = run(&mut batch, first);
    assert_eq!(first.stats.pinned_prompt_tokens, 40);
    assert_eq!(first.stats.cache_creation_tokens(), 40);
    assert_eq!(
        first.stats.cache_miss,
        Some(CacheMiss::NotSeen { at_token: 0 })
    );
    assert_eq!(batch.kv_stats().pinned_tokens, 40);
    // Another client's prompt, unpinned; then three others take every free block.
    let other = [ids(5000, 40), ids(6000, 20)].concat();
    let mut unpinned = request(other.clone(), 2);
    client(&mut unpinned, "other");
    run(&mut batch, unpinned);
    for k in 0..3 {
        run(&mut batch, request(ids(10_000 + 1000 * k, 50), 2));
    }
    let mut again = request(other, 2);
    client(&mut again, "other");
    let again = run(&mut batch, again);
    assert_eq!(again.stats.cached_prompt_tokens, 0);
    match again.stats.cache_miss {
        Some(CacheMiss::Evicted {
            at_token: 0,
            cause: EvictionCause::Reused,
            ..
        }) => {}
        miss => panic!("{miss:?}"),
    }
    // The agent's next request reads the pinned prefix, diverging from its previous request
    // right after it, and gives the tokens a cold batch gives.
    let mut next = request(prompt(4000), 6);
    client(&mut next, "agent");
    let next_prompt = next.prompt.clone();
    let next = run(&mut batch, next);
    assert_eq!(next.stats.cached_prompt_tokens, 40);
    match next.stats.cache_miss {
        Some(CacheMiss::Diverged { at_token: 40, .. }) => {}
        miss => panic!("{miss:?}"),
    }
    let mut fresh =
        BatchGenerator::new(model.as_ref(), &tokenizer, config(24, block_size), "smollm");
    let cold = run(&mut fresh, request(next_prompt, 6));
    assert_eq!(next.token_ids, cold.token_ids);
    // Pinned again by a request that read it: nothing is created.
    let mut repin = request(prompt(7000), 2);
    repin.cache_pins = system_pin();
    let repin = run(&mut batch, repin);
    assert_eq!(repin.stats.pinned_prompt_tokens, 40);
    assert_eq!(repin.stats.cache_creation_tokens(), 0);
    // A bounded request keeps nothing, and says so (its bound below its 60 + 2 tokens, or it
    // would run unbounded).
    let mut bounded = request(prompt(8000), 2);
    bounded.max_kv_size = Some(32);
    bounded.cache_pins = system_pin();
    let bounded = run(&mut batch, bounded);
    assert_eq!(bounded.stats.pinned_prompt_tokens, 0);
    assert!(bounded.stats.pin_refused.is_some());
    assert_eq!(bounded.stats.cache_miss, Some(CacheMiss::OwnCache));
}

/// A pin of the test's 40-token system prompt for five minutes.
fn system_pin() -> Vec<perch_engine::CachePin> {
    vec![perch_engine::CachePin {
        tokens: 40,
        ttl: perch_engine::CachePin::DEFAULT_TTL,
        key: None,
    }]
}

/// A client's first request to a model after requests to another (the app's engines, one after
/// another, sharing what each client last used) has its miss explained as such; a client that
/// used no other model, and an engine that shares nothing, say the prompt was not seen.
#[test]
fn a_client_that_switched_models_is_told_so() {
    use perch_engine::{CacheMiss, ClientModels};
    let (model, tokenizer) = load();
    let models = std::sync::Arc::new(ClientModels::default());
    let batch = |id: &str, shared: bool| {
        let batch = BatchGenerator::new(model.as_ref(), &tokenizer, config(24, 8), id);
        match shared {
            true => batch.with_client_models(id, models.clone()),
            false => batch,
        }
    };
    let (mut first, mut second, mut alone) = (
        batch("model-a", true),
        batch("model-b", true),
        batch("model-b", false),
    );
    // Each client's prompt of its own.
    let miss = |batch: &mut BatchGenerator, client: &str| {
        let from = 1000 * (1 + client.len() as u32);
        let mut request = request((from..from + 40).collect(), 2);
        request.client = Some(client.to_owned());
        common::drive(batch, vec![(0, request)])
            .remove(0)
            .0
            .stats
            .cache_miss
    };
    let not_seen = Some(CacheMiss::NotSeen { at_token: 0 });
    assert_eq!(miss(&mut first, "agent"), not_seen);
    assert_eq!(
        miss(&mut second, "agent"),
        Some(CacheMiss::AnotherModel {
            at_token: 0,
            model: "model-a".into()
        })
    );
    // Its next request there reads what the first left: no miss.
    assert_eq!(miss(&mut second, "agent"), None);
    assert_eq!(miss(&mut second, "app"), not_seen, "a client new to both");
    assert_eq!(
        miss(&mut alone, "agent"),
        not_seen,
        "an engine sharing nothing"
    );
}
