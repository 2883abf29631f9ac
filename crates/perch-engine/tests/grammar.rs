//! Constrained output (`GenerateRequest::grammar`, OpenAI's `response_format`) through the engine
//! on the test model: what the model writes unconstrained is not JSON, constrained it is, a
//! schema's keys, types and bounds hold, constrained and free requests share steps without
//! changing the free ones' tokens, and a schema that cannot compile is refused with a reason.

mod common;

use std::time::Duration;

use perch_engine::{
    ChatMessage, EngineConfig, EngineEvent, EngineHandle, EngineRequest, FinishReason,
    GenerateRequest, Grammar, Prompt, RequestStream,
};
use serde_json::{json, Value};

fn request(question: &str, grammar: Option<Grammar>, max_tokens: usize) -> EngineRequest {
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = max_tokens;
    // A free-form object lets the 135M model repeat itself inside a string until max_tokens
    // when greedy; the penalty keeps it moving so that the object closes.
    if grammar == Some(Grammar::JsonObject) {
        params.sampling.repetition_penalty = 1.3;
        params.sampling.repetition_context_size = 64;
    }
    params.grammar = grammar;
    EngineRequest {
        prompt: Prompt::Chat(vec![ChatMessage::new("user", question)]),
        params,
    }
}

/// The text, the token ids and how it ended (`Err` with the message when refused or failed).
fn collect(stream: RequestStream) -> Result<(String, Vec<u32>, FinishReason), String> {
    let (mut text, mut ids) = (String::new(), Vec::new());
    loop {
        match stream
            .events
            .recv_timeout(Duration::from_secs(300))
            .expect("the engine answers")
        {
            EngineEvent::Token { text: t, id, .. } => {
                text.push_str(&t);
                ids.extend(id);
            }
            EngineEvent::Admitted { .. } => {}
            EngineEvent::Finished {
                finish_reason,
                error,
                ..
            } => {
                return match error {
                    Some(error) => Err(error.message),
                    None => Ok((text, ids, finish_reason)),
                }
            }
        }
    }
}

const QUESTION: &str = "Describe a cat called Tom who is 3 years old.";

fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "indoor": {"type": "boolean"}
        },
        "required": ["name", "age", "indoor"],
        "additionalProperties": false
    })
}

#[test]
fn constrained_output_is_json_and_follows_the_schema() {
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    let free = collect(engine.submit(request(QUESTION, None, 60)).unwrap()).unwrap();
    assert!(
        serde_json::from_str::<Value>(free.0.trim()).is_err(),
        "the test needs a model that does not answer in JSON unasked: {:?}",
        free.0
    );

    let (text, _, reason) = collect(
        engine
            .submit(request(QUESTION, Some(Grammar::JsonObject), 300))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(reason, FinishReason::Stop, "the object closed: {text:?}");
    let object: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(object.is_object(), "{text:?}");

    let schema = Grammar::JsonSchema(person_schema());
    let (text, _, reason) =
        collect(engine.submit(request(QUESTION, Some(schema), 200)).unwrap()).unwrap();
    assert_eq!(reason, FinishReason::Stop, "{text:?}");
    let cat: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let keys: Vec<&str> = cat
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(keys.len(), 3, "{text}");
    assert!(
        cat["name"].as_str().unwrap().chars().count() <= 12,
        "{text}"
    );
    assert!((0..=30).contains(&cat["age"].as_i64().unwrap()), "{text}");
    assert!(cat["indoor"].is_boolean(), "{text}");
    engine.shutdown();
}

#[test]
fn constrained_and_free_requests_share_steps() {
    // Free requests alone, then again beside constrained ones submitted in between: the free
    // ones' greedy tokens are the same, and every constrained answer is JSON.
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    let questions = [
        "Name three colours.",
        "What is 2 + 2?",
        "Say hello in French.",
    ];
    let alone: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            collect(engine.submit(request(q, None, 24)).unwrap())
                .unwrap()
                .1
        })
        .collect();
    let mut streams = Vec::new();
    for (k, q) in questions.iter().enumerate() {
        streams.push((false, engine.submit(request(q, None, 24)).unwrap()));
        let grammar = if k % 2 == 0 {
            Grammar::JsonSchema(person_schema())
        } else {
            Grammar::JsonObject
        };
        streams.push((
            true,
            engine
                .submit(request(QUESTION, Some(grammar), 300))
                .unwrap(),
        ));
        std::thread::sleep(Duration::from_millis(30));
    }
    let mut free = Vec::new();
    for (constrained, stream) in streams {
        let (text, ids, reason) = collect(stream).unwrap();
        if constrained {
            assert_eq!(reason, FinishReason::Stop, "{text:?}");
            assert!(
                serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()),
                "{text:?}"
            );
        } else {
            free.push(ids);
        }
    }
    assert_eq!(free, alone);
    engine.shutdown();
}

#[test]
fn a_schema_that_cannot_compile_is_refused_with_the_reason() {
    let engine = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    for schema in [
        json!({"type": "nonsense"}),
        json!({"$ref": "#/$defs/missing"}),
    ] {
        let error = collect(
            engine
                .submit(request(
                    QUESTION,
                    Some(Grammar::JsonSchema(schema.clone())),
                    20,
                ))
                .unwrap(),
        )
        .unwrap_err();
        assert!(
            error.starts_with("invalid response format"),
            "{schema}: {error}"
        );
    }
    // The engine still serves.
    let (_, ids, _) = collect(engine.submit(request(QUESTION, None, 4)).unwrap()).unwrap();
    assert_eq!(ids.len(), 4);
    engine.shutdown();
}
