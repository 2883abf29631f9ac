//! Speculative decoding (`generate_speculative`) on the test model. Greedy: with a draft that
//! agrees (the model itself) and one that mostly does not (a tiny random Llama with the same
//! tokenizer, written by mlx_lm), every reference case's ids are mlx_lm's greedy ids without a
//! draft. Sampled: with the same seed, the ids and `from_draft` flags are mlx_lm's
//! `speculative_generate_step`'s (`tests/oracle/speculative.py`), proposals rejected and rewound
//! included; since every emitted token is the model's own sample there, the output is distributed
//! as the model's. Also: the stats count what was proposed and accepted, and bad drafts are
//! refused. Needs the oracle.

mod common;

use std::ops::ControlFlow;

use perch_engine::sampler::SamplingParams;
use perch_engine::{
    generate_speculative, models, Draft, FinishReason, GenerateOutput, GenerateRequest, Tokenizer,
};

struct Run {
    ids: Vec<u32>,
    from_draft: Vec<bool>,
    output: GenerateOutput,
}

fn speculate(
    model: &dyn models::Model,
    draft: &dyn models::Model,
    tokenizer: &Tokenizer,
    num_draft_tokens: usize,
    request: &GenerateRequest,
) -> Run {
    let mut ids = Vec::new();
    let mut from_draft = Vec::new();
    let output = generate_speculative(
        model,
        &Draft {
            model: draft,
            tokenizer,
            num_draft_tokens,
        },
        tokenizer,
        request,
        |event| {
            if let Some(id) = event.id {
                ids.push(id);
                from_draft.push(event.from_draft);
            }
            ControlFlow::Continue(())
        },
    )
    .unwrap();
    Run {
        ids,
        from_draft,
        output,
    }
}

#[test]
fn speculative_decoding_is_mlx_lms() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let cases = common::reference_cases();
    let short = common::short_reference_cases();

    // Sampled runs for mlx_lm to repeat: two prompts, drafts of 2 and 4 tokens, the model as
    // its own draft (its proposals, drawn with other keys, are often rejected at temperature 1).
    let sampled: Vec<(usize, usize, u64)> = vec![(0, 2, 5), (1, 4, 6), (2, 3, 7)];
    let runs: Vec<serde_json::Value> = sampled
        .iter()
        .map(|&(case, k, seed)| {
            serde_json::json!({"prompt": short[case].prompt_ids, "draft": "self", "temp": 1.0,
                               "seed": seed, "num_draft_tokens": k, "max_tokens": 16})
        })
        .collect();
    let out = tempfile::tempdir().unwrap();
    let json = common::run_oracle(
        "speculative.py",
        &[
            out.path().to_str().unwrap(),
            dir.to_str().unwrap(),
            &serde_json::to_string(&runs).unwrap(),
        ],
    );
    let expected: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    let tiny = models::load(&out.path().join("llama3-rope")).unwrap();

    // Greedy: mlx_lm's ids without a draft, with either draft.
    let reference = common::reference();
    // (Every case with the tiny draft, which rejects most proposals; two with the model, whose
    // proposals are accepted.)
    for (name, draft, cases) in [
        ("the model itself", model.as_ref(), &short[..2]),
        ("a random tiny model", tiny.as_ref(), &cases[..]),
    ] {
        let mut proposed = 0;
        let mut accepted = 0;
        for case in cases {
            let mut request = GenerateRequest::new(case.prompt_ids.clone());
            request.max_tokens = reference.max_tokens;
            request.prefill_step_size = reference.prefill_step_size;
            let run = speculate(model.as_ref(), draft, &tokenizer, 3, &request);
            let stopped = run.output.finish_reason == FinishReason::Stop;
            assert_eq!(
                run.ids,
                common::expected_ids(case, run.output.finish_reason),
                "case {} drafted by {name}",
                case.id
            );
            assert_eq!(
                run.output.stats.generation_tokens,
                run.ids.len() + stopped as usize
            );
            // (An accepted end-of-sequence token is counted but not streamed.)
            let stats = &run.output.stats;
            let flagged = run.from_draft.iter().filter(|&&d| d).count();
            assert!(
                (flagged..=flagged + stopped as usize).contains(&stats.accepted_draft_tokens),
                "{} accepted, {flagged} streamed from the draft",
                stats.accepted_draft_tokens
            );
            proposed += stats.draft_tokens;
            accepted += stats.accepted_draft_tokens;
        }
        assert!(proposed > 0);
        if std::ptr::eq(draft, model.as_ref()) {
            // The model agrees with itself: only the step's last token comes from the model.
            assert!(accepted * 10 >= proposed * 9, "{accepted} of {proposed}");
        } else {
            assert!(
                accepted * 2 < proposed,
                "a random draft: {accepted} of {proposed}"
            );
        }
    }

    // Sampled, seeded: mlx_lm's tokens and flags.
    for ((case, k, seed), expected) in sampled.iter().zip(&expected) {
        let mut request = GenerateRequest::new(short[*case].prompt_ids.clone());
        request.max_tokens = 16;
        request.ignore_eos = true;
        request.prefill_step_size = 2048;
        request.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(*seed),
            ..SamplingParams::default()
        };
        let run = speculate(model.as_ref(), model.as_ref(), &tokenizer, *k, &request);
        let ids: Vec<u32> = serde_json::from_value(expected["ids"].clone()).unwrap();
        let flags: Vec<bool> = serde_json::from_value(expected["from_draft"].clone()).unwrap();
        assert_eq!(run.ids, ids, "seed {seed}, {k} draft tokens");
        assert_eq!(run.from_draft, flags, "seed {seed}, {k} draft tokens");
        assert!(
            flags.iter().any(|&f| !f) && flags.iter().any(|&f| f),
            "seed {seed}: accepted and rejected proposals both"
        );
    }
}

#[test]
fn bad_drafts_are_refused() {
    let dir = common::model_dir();
    let model = models::load(&dir).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let request = GenerateRequest::new(tokenizer.encode("Hello", true).unwrap());
    let refused = |draft: Draft<'_>, request: &GenerateRequest| {
        generate_speculative(model.as_ref(), &draft, &tokenizer, request, |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err()
        .to_string()
    };
    let draft = |num_draft_tokens| Draft {
        model: model.as_ref(),
        tokenizer: &tokenizer,
        num_draft_tokens,
    };
    assert!(refused(draft(0), &request).contains("num_draft_tokens"));
    assert!(refused(draft(65), &request).contains("num_draft_tokens"));
    let mut bounded = request.clone();
    bounded.max_kv_size = Some(64);
    assert!(refused(draft(3), &bounded).contains("max_kv_size"));

    // Another vocabulary: the test tokenizer with two tokens' ids swapped.
    let other = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, other.path().join(path.file_name().unwrap())).unwrap();
    }
    let file = other.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&file).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let hello = vocab["hello"].clone();
    let world = vocab["world"].clone();
    vocab.insert("hello".into(), world);
    vocab.insert("world".into(), hello);
    std::fs::write(&file, serde_json::to_string(&json).unwrap()).unwrap();
    let other_tokenizer = Tokenizer::load(other.path()).unwrap();
    let error = refused(
        Draft {
            model: model.as_ref(),
            tokenizer: &other_tokenizer,
            num_draft_tokens: 3,
        },
        &request,
    );
    assert!(error.contains("tokenizer does not match"), "{error}");
}
