//! Perch reproduces Python mlx_lm 0.32.2 exactly on the test model (the default SmolLM2,
//! imported): chat-templated prompt ids and greedy continuations
//! (`tests/fixtures/smollm2-greedy.json`), including a prompt longer than one prefill chunk.

mod common;

use std::ops::ControlFlow;

use perch_engine::{generate, models, FinishReason, GenerateRequest, Tokenizer};

#[test]
fn prompts_and_greedy_ids_match_mlx_lm() {
    let dir = common::model_dir();
    let model = models::load(&dir).expect("load model");
    let tokenizer = Tokenizer::load(&dir).expect("load tokenizer");
    let cases = common::reference_cases();
    assert!(cases.len() >= 7);
    assert!(cases.iter().any(|c| c.ends_with_eos), "a case stops on EOS");
    assert!(
        cases
            .iter()
            .any(|c| c.prompt_ids.len() > common::reference().prefill_step_size),
        "a prompt is longer than one prefill chunk"
    );
    for case in cases {
        let prompt = match (common::chat_messages(&case), &case.text) {
            (Some(messages), _) => tokenizer.encode_chat(&messages).unwrap(),
            (None, Some(text)) => tokenizer.encode(text, true).unwrap(),
            _ => panic!("case {} has neither messages nor text", case.id),
        };
        assert_eq!(prompt, case.prompt_ids, "prompt ids of case {}", case.id);

        let mut request = GenerateRequest::new(prompt);
        request.max_tokens = common::reference().max_tokens;
        request.prefill_step_size = common::reference().prefill_step_size;
        let mut streamed = String::new();
        let out = generate(model.as_ref(), &tokenizer, &request, |event| {
            assert!(
                !event.text.contains('\u{FFFD}'),
                "case {}: broken character streamed",
                case.id
            );
            streamed.push_str(&event.text);
            ControlFlow::Continue(())
        })
        .unwrap();
        // mlx_lm's list includes the EOS token that ended generation; ours reports it as `stop`.
        let mut ids = out.token_ids.clone();
        if out.finish_reason == FinishReason::Stop {
            ids.push(*case.greedy_ids.last().unwrap());
            assert!(tokenizer
                .eos_token_ids()
                .contains(case.greedy_ids.last().unwrap()));
        } else {
            assert_eq!(out.finish_reason, FinishReason::Length);
        }
        assert_eq!(ids, case.greedy_ids, "greedy ids of case {}", case.id);
        assert_eq!(
            out.text,
            case.greedy_text.trim_end_matches('\u{FFFD}'),
            "text of case {}",
            case.id
        );
        assert_eq!(
            streamed, out.text,
            "case {}: streamed text equals the final text",
            case.id
        );
        let full = tokenizer.decode(&out.token_ids).unwrap();
        assert_eq!(
            out.text,
            full.trim_end_matches('\u{FFFD}'),
            "case {}: no text lost",
            case.id
        );
        assert_eq!(out.stats.generation_tokens, case.greedy_ids.len());
        assert!(out.stats.peak_memory_bytes > 0);
    }
}

#[test]
fn streaming_never_splits_a_character() {
    let dir = common::model_dir();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let case = common::reference().case("unicode");
    // The reference answers with emoji of several tokens each: cut its ids inside the last one,
    // so that decoding them all ends in U+FFFD.
    let ids = (1..case.greedy_ids.len())
        .rev()
        .map(|n| &case.greedy_ids[..n])
        .find(|ids| tokenizer.decode(ids).unwrap().ends_with('\u{FFFD}'))
        .expect("the unicode reference holds a character of several tokens");
    let full = tokenizer.decode(ids).unwrap();
    let mut detok = perch_engine::text::tokenizer::StreamingDetokenizer::new();
    let mut text = String::new();
    let mut empty_steps = 0;
    for id in ids {
        let delta = detok.push(&tokenizer, *id).unwrap();
        assert!(!delta.contains('\u{FFFD}'));
        empty_steps += delta.is_empty() as usize;
        text.push_str(&delta);
    }
    assert!(
        empty_steps > 0,
        "multi-token characters must be held back at least once"
    );
    text.push_str(&detok.finish(&tokenizer).unwrap());
    assert_eq!(text, full.trim_end_matches('\u{FFFD}'));
    assert!(text.contains("🌅"), "{text:?}");
}

#[test]
fn chunked_prefill_gives_the_same_tokens() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let case = common::reference().case("multi-turn");
    let mut request = GenerateRequest::new(case.prompt_ids.clone());
    request.max_tokens = common::reference().max_tokens;
    request.prefill_step_size = 16; // 60 prefill tokens in 4 chunks, the last one partial
    let out = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.token_ids[..], *case.expected_ids(true));
}

#[test]
fn stop_strings_cut_the_text_and_cancel_stops_at_once() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let case = common::reference().case("raw-text");
    // A word the reference continuation holds after its first tokens.
    let stop = "answer";
    let at = case
        .greedy_text
        .find(stop)
        .expect("the raw-text reference continuation contains the stop word");
    let mut request = GenerateRequest::new(case.prompt_ids.clone());
    request.max_tokens = common::reference().max_tokens;
    request.stop_strings = vec![stop.into()];
    let out = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.text, case.greedy_text[..at]);

    let mut seen = 0;
    request.stop_strings.clear();
    let out = generate(model.as_ref(), &tokenizer, &request, |_| {
        seen += 1;
        if seen == 3 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .unwrap();
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert_eq!(out.token_ids, case.greedy_ids[..3]);
}
