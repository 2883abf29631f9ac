//! The official Python SDKs (`openai` and `anthropic` from PyPI, in the oracle virtualenv)
//! against the server on 127.0.0.1 with the default model.
//!
//! OpenAI: models, chat completions plain and streamed (with
//! usage only when asked), stop sequences, the documented errors (a prompt longer than the
//! context among them), log-probabilities, OpenAI's penalties, the legacy Completions endpoint
//! (text and token-id prompts, echo, several prompts, streamed), and the greedy text equal to what
//! the engine gives for the same messages or prompt directly.
//!
//! Anthropic: messages plain, with blocks and streamed (the SDK's own stream helper checks the
//! event sequence), stop sequences, usage with cache reads, count_tokens, and errors in
//! Anthropic's shape.

use std::process::Command;

use perch_engine::{
    ChatMessage, EngineConfig, EngineEvent, EngineHandle, EngineRequest, GenerateRequest, Prompt,
};
use perch_server::{router, serve, ServerConfig};
use serde_json::Value;

const KEY: &str = "test-key";
const MODEL: &str = "smollm2-135m";
/// Long enough that the prompt fills KV blocks (32 tokens each), which a second request reads
/// from the prefix cache.
const SYSTEM: &str = "You are a helpful assistant for a small team of engineers who build a \
    desktop application. Answer briefly and plainly, in one or two sentences, without lists.";

/// A completion prompt, and a second one the client sends as token ids.
const TEXT: &str = "Once upon a time, in a small village by the sea,";
const TEXT_AS_IDS: &str = "The capital of France is";

/// The messages as the client sends them (`developer` is the template's `system`).
fn chat() -> Prompt {
    Prompt::Chat(vec![
        ChatMessage::new("system", SYSTEM),
        ChatMessage::new("user", "Name three colors of the rainbow."),
    ])
}

/// The greedy answer the engine gives directly with `max_tokens` and settings from `adjust`.
fn direct_answer(
    engine: &EngineHandle,
    prompt: Prompt,
    max_tokens: usize,
    adjust: impl FnOnce(&mut GenerateRequest),
) -> (String, usize) {
    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = max_tokens;
    adjust(&mut params);
    let stream = engine.submit(EngineRequest { prompt, params }).unwrap();
    let mut text = String::new();
    for event in stream.events {
        match event {
            EngineEvent::Token { text: piece, .. } => text.push_str(&piece),
            EngineEvent::Finished { stats, .. } => return (text, stats.prompt_tokens),
        }
    }
    panic!("the stream ended without Finished");
}

/// Serves `engine` on a free port of 127.0.0.1 with the test's key; the runtime must live as
/// long as the server is used.
fn start_server(engine: &EngineHandle) -> (tokio::runtime::Runtime, std::net::SocketAddr) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig {
        model_id: MODEL.into(),
        api_key: Some(KEY.into()),
    };
    runtime.spawn(serve(listener, router(engine.clone(), config)));
    (runtime, addr)
}

/// Runs a client script of this directory with the oracle Python; returns what it printed.
fn run_client(script: &str, args: &[String]) -> Value {
    let output = Command::new(perch_test_support::oracle_python())
        .arg(format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .output()
        .expect("the oracle Python runs");
    assert!(
        output.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen: Value = serde_json::from_slice(&output.stdout).unwrap();
    eprintln!("{seen:#}");
    seen
}

#[test]
fn the_openai_sdk_gets_chat_completions() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let (expected, prompt_tokens) = direct_answer(&engine, chat(), 24, |_| {});
    let (penalized, _) = direct_answer(&engine, chat(), 24, |p| {
        p.sampling.presence_penalty = 1.5;
        p.sampling.frequency_penalty = 1.0;
        p.sampling.presence_context_size = perch_server::PENALTY_WINDOW;
        p.sampling.frequency_context_size = perch_server::PENALTY_WINDOW;
    });
    assert_ne!(penalized, expected, "the penalties change this answer");
    let tokenizer = engine.tokenizer().clone();
    let text_ids = tokenizer.encode(TEXT, true).unwrap();
    let (continued, _) = direct_answer(&engine, Prompt::Tokens(text_ids.clone()), 10, |_| {});
    let france_ids = tokenizer.encode(TEXT_AS_IDS, true).unwrap();
    let (france, _) = direct_answer(&engine, Prompt::Tokens(france_ids.clone()), 10, |_| {});
    let (_runtime, addr) = start_server(&engine);
    let mut args = vec![
        format!("http://{addr}/v1"),
        KEY.into(),
        MODEL.into(),
        SYSTEM.into(),
        TEXT.into(),
    ];
    args.extend(france_ids.iter().map(u32::to_string));
    let seen = run_client("openai_client.py", &args);

    assert_eq!(seen["models"], serde_json::json!([MODEL]));
    let plain = &seen["plain"];
    assert_eq!(
        plain["content"],
        expected.as_str(),
        "greedy text as the engine gives it"
    );
    assert_eq!(plain["role"], "assistant");
    let usage = &plain["usage"];
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!((1..=24).contains(&completion));
    assert_eq!(
        plain["finish_reason"],
        if completion == 24 { "length" } else { "stop" }
    );
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(prompt_tokens as u64 + completion)
    );
    // The same prompt again: its full blocks come from the prefix cache.
    let stream = &seen["stream"];
    assert_eq!(stream["content"], expected.as_str());
    assert_eq!(stream["finish_reason"], plain["finish_reason"]);
    assert_eq!(stream["usage"]["completion_tokens"], completion);
    assert!(stream["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0));
    assert!(stream["chunks"].as_u64() >= Some(3));
    assert_eq!(seen["stream_without_usage_has_usage"], false);

    let stop = &seen["stop"];
    let word = stop["stop"].as_str().unwrap();
    let cut = expected.find(word).expect("the stop word is in the answer");
    assert_eq!(stop["content"], &expected[..cut]);
    assert_eq!(stop["finish_reason"], "stop");

    check_logprobs(&seen);
    assert_eq!(seen["penalized"], penalized.as_str());
    check_completions(&seen, &continued, &france, text_ids.len());

    for (case, status, param) in [
        ("n2", 400, Value::from("n")),
        ("bad_penalty", 400, Value::from("presence_penalty")),
        ("top_logprobs_alone", 400, Value::from("top_logprobs")),
        ("echo_logprobs", 400, Value::from("echo")),
        ("unknown_model", 404, Value::from("model")),
        ("no_key", 401, Value::Null),
        ("bad_json", 400, Value::Null),
        ("too_long", 400, Value::Null),
        ("too_long_streamed", 400, Value::Null),
    ] {
        let error = &seen[case];
        assert_eq!(error["status"], status, "{case}: {error}");
        // The SDK hands over the `error` object; the raw request sees the whole body.
        let body = error["body"].get("error").unwrap_or(&error["body"]);
        assert!(
            body["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{case}: {error}"
        );
        assert!(body["type"].is_string(), "{case}: {error}");
        assert_eq!(body["param"], param, "{case}: {error}");
    }
    // A prompt longer than the context: the engine's message names both lengths.
    for case in ["too_long", "too_long_streamed"] {
        let message = seen[case]["body"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("tokens, more than the model's context of"),
            "{case}: {message}"
        );
    }
    disconnecting_cancels(&engine, &addr.to_string());
    engine.shutdown();
}

/// Chat log-probabilities, plain and streamed: one entry per generated token whose texts make the
/// answer, the greedy token first among its three alternatives, bytes its UTF-8.
fn check_logprobs(seen: &Value) {
    let scored = &seen["logprobs"];
    let entries = scored["entries"].as_array().unwrap();
    assert_eq!(
        entries.len() as u64,
        scored["completion_tokens"].as_u64().unwrap()
    );
    let joined: String = entries
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, scored["content"].as_str().unwrap());
    for entry in entries {
        let token = entry["token"].as_str().unwrap();
        let logprob = entry["logprob"].as_f64().unwrap();
        assert!(logprob <= 0.0, "{entry}");
        assert_eq!(entry["bytes"], serde_json::json!(token.as_bytes()));
        let top = entry["top"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        assert_eq!(
            top[0],
            serde_json::json!([token, logprob]),
            "greedy: {entry}"
        );
        assert!(top.windows(2).all(|w| w[0][1].as_f64() >= w[1][1].as_f64()));
    }
    assert_eq!(&seen["logprobs_streamed"], &scored["entries"]);
}

/// The legacy Completions endpoint: the engine's greedy continuation of the text (and of the
/// token ids), echo, log-probabilities whose tokens make the text, two prompts in one request,
/// and streamed.
fn check_completions(seen: &Value, continued: &str, france: &str, prompt_tokens: usize) {
    let plain = &seen["completion"];
    assert_eq!(plain["texts"], serde_json::json!([continued]));
    assert_eq!(plain["usage"]["prompt_tokens"], prompt_tokens);
    let generated = plain["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(
        plain["finish"][0],
        if generated == 10 { "length" } else { "stop" }
    );
    assert_eq!(
        seen["completion_echo"]["texts"],
        serde_json::json!([format!("{TEXT}{continued}")])
    );
    let scored = &seen["completion_logprobs"];
    assert_eq!(scored["texts"], plain["texts"]);
    let logprobs = &scored["logprobs"][0];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.len() as u64, generated);
    assert_eq!(tokens.concat(), continued);
    let mut offset = 0;
    for (i, token) in tokens.iter().enumerate() {
        assert_eq!(logprobs["text_offset"][i], offset);
        offset += token.chars().count();
        let chosen = logprobs["token_logprobs"][i].as_f64().unwrap();
        let top = logprobs["top_logprobs"][i].as_object().unwrap();
        assert!((1..=2).contains(&top.len()), "{logprobs}");
        assert_eq!(
            top.get(*token).and_then(Value::as_f64),
            Some(chosen),
            "greedy: {logprobs}"
        );
        assert!(top.values().all(|v| v.as_f64() <= Some(chosen)));
    }
    let two = &seen["completion_two"];
    assert_eq!(two["texts"], serde_json::json!([continued, france]));
    assert_eq!(two["indexes"], serde_json::json!([0, 1]));
    assert_eq!(seen["completion_ids"]["texts"], serde_json::json!([france]));
    assert_eq!(seen["completion_stream"]["text"], continued);
    assert_eq!(
        seen["completion_stream"]["finish_reason"],
        plain["finish"][0]
    );
}

/// A streaming client that reads its first chunk and hangs up: the request is cancelled in the
/// engine, which then runs nothing and holds no block for it (it asked for 2,000 tokens).
fn disconnecting_cancels(engine: &EngineHandle, addr: &str) {
    use std::io::{Read, Write};
    let body = serde_json::json!({
        "model": MODEL, "stream": true, "max_tokens": 2000, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
    })
    .to_string();
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 512];
    let read = socket.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..read]).starts_with("HTTP/1.1 200"));
    // Generating now.
    let running = || engine.stats().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while running().running == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never ran"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    drop(socket);
    loop {
        let stats = running();
        if stats.running == 0 && stats.kv_cache.blocks_used == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running after the client left: {stats:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn the_anthropic_sdk_gets_messages() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let (expected, prompt_tokens) = direct_answer(&engine, chat(), 24, |_| {});
    // The direct run filled the prefix cache; the server's engine starts empty.
    engine.shutdown();
    let engine =
        EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default()).unwrap();
    let (_runtime, addr) = start_server(&engine);
    let args = [
        format!("http://{addr}"),
        KEY.into(),
        MODEL.into(),
        SYSTEM.into(),
    ];
    let seen = run_client("anthropic_client.py", &args);

    assert_eq!(seen["count"], prompt_tokens, "count_tokens");
    let plain = &seen["plain"];
    assert_eq!(plain["type"], "message");
    assert_eq!(plain["role"], "assistant");
    assert_eq!(plain["model"], MODEL);
    assert_eq!(
        plain["content"],
        serde_json::json!([{"type": "text", "text": expected}])
    );
    let output = plain["usage"]["output_tokens"].as_u64().unwrap();
    assert!((1..=24).contains(&output));
    let ended = if output == 24 {
        "max_tokens"
    } else {
        "end_turn"
    };
    assert_eq!(plain["stop_reason"], ended);
    assert_eq!(plain["stop_sequence"], Value::Null);
    // The first request met an empty prefix cache: every prompt token is input.
    assert_eq!(plain["usage"]["input_tokens"], prompt_tokens);
    assert_eq!(plain["usage"]["cache_read_input_tokens"], 0);

    assert_eq!(seen["blocks"]["content"], plain["content"]);
    // Later requests read the prompt's full blocks from the prefix cache; `input_tokens` counts
    // only the rest, as Anthropic defines it.
    let usage = &seen["blocks"]["usage"];
    let read = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read > 0, "{usage}");
    assert_eq!(
        usage["input_tokens"].as_u64().unwrap() + read,
        prompt_tokens as u64
    );

    assert_eq!(seen["stream_text"], expected.as_str());
    let streamed = &seen["stream_final"];
    assert_eq!(streamed["content"], plain["content"]);
    assert_eq!(streamed["stop_reason"], ended);
    assert_eq!(streamed["usage"]["output_tokens"], output);
    assert_eq!(streamed["usage"]["cache_read_input_tokens"], read);
    assert_eq!(
        streamed["usage"]["input_tokens"].as_u64().unwrap() + read,
        prompt_tokens as u64
    );
    // The SDK hands over every event but `ping`; the raw stream shows it after the block starts.
    for (case, head) in [
        (
            "stream_events",
            &["message_start", "content_block_start"][..],
        ),
        (
            "wire_events",
            &["message_start", "content_block_start", "ping"][..],
        ),
    ] {
        let events: Vec<&str> = seen[case]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        let (tail_at, deltas) = (events.len() - 3, head.len());
        assert_eq!(events[..deltas], *head, "{case}: {events:?}");
        assert_eq!(
            events[tail_at..],
            ["content_block_stop", "message_delta", "message_stop"],
            "{case}: {events:?}"
        );
        assert!(
            tail_at > deltas
                && events[deltas..tail_at]
                    .iter()
                    .all(|e| *e == "content_block_delta"),
            "{case}: {events:?}"
        );
    }

    let stop = &seen["stop"];
    let word = stop["stop"].as_str().unwrap();
    let cut = expected.find(word).expect("the stop word is in the answer");
    let stopped = &stop["message"];
    assert_eq!(stopped["content"][0]["text"], &expected[..cut]);
    assert_eq!(stopped["stop_reason"], "stop_sequence");
    assert_eq!(stopped["stop_sequence"], word);

    for (case, status, kind) in [
        ("no_max_tokens", 400, "invalid_request_error"),
        ("bad_json", 400, "invalid_request_error"),
        ("unknown_model", 404, "not_found_error"),
        ("too_long", 400, "invalid_request_error"),
        ("image", 400, "invalid_request_error"),
        ("hot", 400, "invalid_request_error"),
        ("no_key", 401, "authentication_error"),
    ] {
        let error = &seen[case];
        assert_eq!(error["status"], status, "{case}: {error}");
        assert_eq!(error["body"]["type"], "error", "{case}: {error}");
        assert_eq!(error["body"]["error"]["type"], kind, "{case}: {error}");
        assert!(
            error["body"]["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{case}: {error}"
        );
    }
    let message = seen["too_long"]["body"]["error"]["message"]
        .as_str()
        .unwrap();
    assert!(
        message.contains("more than the model's context of"),
        "{message}"
    );
    engine.shutdown();
}
