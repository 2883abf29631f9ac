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

use std::collections::HashMap;
use std::process::Command;

use perch_engine::{
    ChatMessage, ContentPart, EngineConfig, EngineEvent, EngineHandle, EngineRequest,
    GenerateRequest, Prompt,
};
use perch_server::{router, serve, Served, ServedModel, ServerConfig};
use perch_test_support::http;
use serde_json::{json, Value};

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
            EngineEvent::Admitted { .. } => {}
        }
    }
    panic!("the stream ended without Finished");
}

/// Headers of a JSON request with the test's key.
const JSON_WITH_KEY: [(&str, &str); 2] = [
    ("Authorization", "Bearer test-key"),
    ("Content-Type", "application/json"),
];

/// A two-token chat request (either API's shape) naming `model`.
fn chat_json(model: &str) -> String {
    serde_json::json!({"model": model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    .to_string()
}

/// The test's server settings: its model id and key, defaults otherwise.
fn config() -> ServerConfig {
    ServerConfig {
        api_key: Some(KEY.into()),
        ..ServerConfig::new()
    }
}

/// Serves `engine` on a free port of 127.0.0.1 with `config`; the runtime must live as long as
/// the server is used.
fn start_server(
    engine: &EngineHandle,
    config: ServerConfig,
) -> (tokio::runtime::Runtime, std::net::SocketAddr) {
    start_serving(ServedModel::new(engine.clone(), MODEL), config)
}

/// Serves whatever `served` holds, as [`start_server`] does.
fn start_serving(
    served: ServedModel,
    config: ServerConfig,
) -> (tokio::runtime::Runtime, std::net::SocketAddr) {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    runtime.spawn(serve(listener, router(served, config)));
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
    let (expected, prompt_tokens) = direct_answer(&engine, chat(), 12, |_| {});
    let (penalized, _) = direct_answer(&engine, chat(), 12, |p| {
        p.sampling.presence_penalty = 1.5;
        p.sampling.frequency_penalty = 1.0;
        p.sampling.presence_context_size = perch_server::PENALTY_WINDOW;
        p.sampling.frequency_context_size = perch_server::PENALTY_WINDOW;
    });
    assert_ne!(penalized, expected, "the penalties change this answer");
    let seeded = |p: &mut GenerateRequest| {
        p.sampling.temperature = 1.0;
        p.sampling.seed = Some(5);
    };
    let (sampled, _) = direct_answer(&engine, chat(), 12, seeded);
    let (xtc, _) = direct_answer(&engine, chat(), 12, |p| {
        seeded(p);
        p.sampling.xtc_probability = 1.0;
        p.sampling.xtc_threshold = 0.05;
    });
    assert_ne!(xtc, sampled, "XTC changes this sample");
    let (bounded, _) = direct_answer(&engine, chat(), 12, |p| p.max_kv_size = Some(8));
    let tokenizer = engine.tokenizer().clone();
    let text_ids = tokenizer.encode(TEXT, true).unwrap();
    let (continued, _) = direct_answer(&engine, Prompt::Tokens(text_ids.clone()), 4, |_| {});
    let france_ids = tokenizer.encode(TEXT_AS_IDS, true).unwrap();
    let (france, _) = direct_answer(&engine, Prompt::Tokens(france_ids.clone()), 4, |_| {});
    let (_runtime, addr) = start_server(&engine, config());
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
    assert!((1..=12).contains(&completion));
    assert_eq!(
        plain["finish_reason"],
        if completion == 12 { "length" } else { "stop" }
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
    assert_eq!(seen["xtc"], xtc.as_str());
    assert_eq!(seen["bounded"], bounded.as_str());
    assert_ne!(bounded, expected, "max_kv_size 8 changes the answer");
    check_completions(&seen, &continued, &france, text_ids.len());
    // Echo with logprobs: the prompt's tokens scored as the engine scores them.
    let echoed = &seen["completion_echo_logprobs"]["logprobs"][0];
    let tokens = echoed["tokens"].as_array().unwrap();
    let generated = seen["completion_echo_logprobs"]["usage"]["completion_tokens"]
        .as_u64()
        .unwrap() as usize;
    assert_eq!(tokens.len(), text_ids.len() + generated);
    assert_eq!(
        echoed["token_logprobs"][0],
        Value::Null,
        "the first token has none"
    );
    assert_eq!(echoed["top_logprobs"][0], Value::Null);
    for i in [1, text_ids.len() - 1] {
        let direct = engine.next_token_logprobs(text_ids[..i].to_vec()).unwrap();
        let got = echoed["token_logprobs"][i].as_f64().unwrap();
        assert!(
            (got - direct[text_ids[i] as usize] as f64).abs() < 1e-4,
            "prompt token {i}"
        );
    }

    for (case, status, param) in [
        ("n2", 400, Value::from("n")),
        ("bad_penalty", 400, Value::from("presence_penalty")),
        ("bad_xtc", 400, Value::from("xtc_threshold")),
        ("top_logprobs_alone", 400, Value::from("top_logprobs")),
        ("no_tool_support", 400, Value::from("tools")),
        ("unknown_model", 404, Value::from("model")),
        ("no_key", 401, Value::Null),
        ("bad_json", 400, Value::Null),
        ("too_long", 400, Value::Null),
        ("too_long_streamed", 400, Value::Null),
        ("bad_schema", 400, Value::Null),
        ("bad_kv", 400, Value::Null),
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
    let message = seen["bad_kv"]["body"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("cannot be combined"), "{message}");
    let message = seen["bad_schema"]["body"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.starts_with("invalid response format"), "{message}");

    // Structured outputs: the SDK parsed the answer into its Pydantic model (a strict schema),
    // and json_object gave one JSON object.
    let parsed = &seen["parsed"];
    assert_eq!(parsed["finish_reason"], "stop", "{parsed}");
    let cat = &parsed["cat"];
    assert!(
        cat["name"].is_string() && cat["age"].is_i64() && cat["indoor"].is_boolean(),
        "{cat}"
    );
    let object = &seen["json_object"];
    assert_eq!(object["finish_reason"], "stop", "{object}");
    let content = object["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(content).is_ok_and(|v| v.is_object()),
        "{content}"
    );
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
        if generated == 4 { "length" } else { "stop" }
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

/// Opens a chat completion streaming 2,000 tokens and reads its first bytes (the 200).
fn open_stream(addr: &str) -> std::net::TcpStream {
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
    socket
}

/// A streaming client that reads its first chunk and hangs up: the request is cancelled in the
/// engine, which then runs nothing and holds no block for it (it asked for 2,000 tokens).
fn disconnecting_cancels(engine: &EngineHandle, addr: &str) {
    let socket = open_stream(addr);
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

/// A server at its request limit answers 503 with `Retry-After` in each format's error shape
/// (no unbounded wait), counts its requests live, and admits again once one ends; CORS headers
/// only for the origins it was given, and a preflight needs no key.
#[test]
fn a_server_follows_the_model_the_app_has_loaded() {
    // The app's server: nothing loaded, then a model, then another id, then nothing again.
    let served = ServedModel::default();
    let (_runtime, addr) = start_serving(served.clone(), config());
    let addr = addr.to_string();
    let auth = JSON_WITH_KEY;
    let listed = || {
        let (status, _, body) = http(&addr, "GET", "/v1/models", &auth, "");
        assert_eq!(status, 200, "{body}");
        let list: Value = serde_json::from_str(&body).unwrap();
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let unloaded = || {
        assert_eq!(listed(), Vec::<String>::new());
        let (status, _, body) = http(
            &addr,
            "POST",
            "/v1/chat/completions",
            &auth,
            &chat_json(MODEL),
        );
        assert_eq!(status, 503, "{body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["code"], "model_not_loaded", "{body}");
        let (status, _, body) = http(&addr, "POST", "/v1/messages", &auth, &chat_json(MODEL));
        assert_eq!(status, 503, "{body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["type"], "error", "Anthropic's shape: {body}");
    };
    unloaded();

    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    served.replace(Some(Served {
        engine: engine.clone(),
        model_id: "first".into(),
    }));
    assert_eq!(listed(), ["first"]);
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        &chat_json("first"),
    );
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        &chat_json(MODEL),
    );
    assert_eq!(status, 404, "the old id is gone: {body}");
    served.replace(Some(Served {
        engine: engine.clone(),
        model_id: "second".into(),
    }));
    assert_eq!(listed(), ["second"]);
    let (status, _, body) = http(&addr, "POST", "/v1/messages", &auth, &chat_json("second"));
    assert_eq!(status, 200, "{body}");

    served.replace(None);
    unloaded();
    engine.shutdown();
}

/// Agents send their vendor's model names: a server with aliases answers them (Messages and
/// Chat Completions) and lists them in `GET /v1/models`, other names get 404; with
/// `any_model_name` every name is the served model.
#[test]
fn agents_name_the_model_their_own_way() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let aliased = ServerConfig {
        model_aliases: vec!["claude-sonnet-4-5".into(), "gpt-4o".into()],
        ..config()
    };
    let (_runtime, addr) = start_server(&engine, aliased);
    let addr = addr.to_string();
    let auth = JSON_WITH_KEY;
    let (status, _, body) = http(&addr, "GET", "/v1/models", &auth, "");
    assert_eq!(status, 200, "{body}");
    let list: Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, "claude-sonnet-4-5", "gpt-4o"]);
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/messages",
        &auth,
        &chat_json("claude-sonnet-4-5"),
    );
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        &chat_json("gpt-4o"),
    );
    assert_eq!(status, 200, "{body}");
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/messages",
        &auth,
        &chat_json("claude-opus-4"),
    );
    assert_eq!(status, 404, "not an alias: {body}");
    let any = ServerConfig {
        any_model_name: true,
        ..config()
    };
    let (_runtime, addr) = start_server(&engine, any);
    let addr = addr.to_string();
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/messages",
        &auth,
        &chat_json("claude-opus-4"),
    );
    assert_eq!(status, 200, "any name: {body}");
    engine.shutdown();
}

#[test]
fn requests_ask_for_a_lane_in_the_body_or_a_header() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let (_runtime, addr) = start_server(&engine, config());
    let addr = addr.to_string();
    // One token: only the status matters.
    let with_priority = |priority: Value| {
        let mut body: Value = serde_json::from_str(&chat_json(MODEL)).unwrap();
        body["max_tokens"] = json!(1);
        body["priority"] = priority;
        body.to_string()
    };
    let all = [json!("high"), json!("LOW"), json!(-1), json!(0), json!(5)];
    // Both endpoints read the body's lane with the same `PriorityField::lane`: Messages tries
    // one name and one integer.
    for (path, lanes) in [
        ("/v1/chat/completions", &all[..]),
        ("/v1/messages", &all[1..3]),
    ] {
        for lane in lanes {
            let (status, _, body) = http(
                &addr,
                "POST",
                path,
                &JSON_WITH_KEY,
                &with_priority(lane.clone()),
            );
            assert_eq!(status, 200, "{path} {lane}: {body}");
        }
        let (status, _, body) = http(
            &addr,
            "POST",
            path,
            &JSON_WITH_KEY,
            &with_priority(json!("urgent")),
        );
        assert_eq!(status, 400, "{path}: {body}");
        assert!(
            body.contains("priority must be high, normal, low"),
            "{body}"
        );
        let with_header = |lane| {
            let header = [
                JSON_WITH_KEY[0],
                JSON_WITH_KEY[1],
                ("x-perch-priority", lane),
            ];
            http(&addr, "POST", path, &header, &chat_json(MODEL))
        };
        let (status, _, body) = with_header("low");
        assert_eq!(status, 200, "{path}: {body}");
        let (status, _, body) = with_header("soon");
        assert_eq!(status, 400, "{path}: {body}");
        assert!(
            body.contains("x-perch-priority header must be high, normal or low"),
            "{body}"
        );
    }
    engine.shutdown();
}

/// Anthropic's `cache_control` breakpoints pin their prefixes and the usage says what was
/// created and read; OpenAI's `prompt_cache_key` pins the prompt; every response says what its
/// prompt read from the cache and why it missed (`x-perch-prompt-cache`); bad breakpoints are
/// 400s naming them.
#[test]
fn cache_breakpoints_pin_prefixes_and_misses_are_explained() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let (_runtime, addr) = start_server(&engine, config());
    let addr = addr.to_string();
    let headers = [
        ("x-api-key", KEY),
        ("Content-Type", "application/json"),
        ("User-Agent", "agent-under-test"),
    ];
    let messages = |question: &str, control: Value| {
        json!({"model": MODEL, "max_tokens": 2,
               "system": [{"type": "text", "text": SYSTEM, "cache_control": control}],
               "messages": [{"role": "user", "content": question}]})
        .to_string()
    };
    let ephemeral = json!({"type": "ephemeral"});
    let pinned = || engine.stats().unwrap().kv_cache.pinned_tokens;
    let (status, head, body) = http(
        &addr,
        "POST",
        "/v1/messages",
        &headers,
        &messages("Name a color.", ephemeral.clone()),
    );
    assert_eq!(status, 200, "{body}");
    let usage = serde_json::from_str::<Value>(&body).unwrap()["usage"].clone();
    let (input, created, read) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["cache_creation_input_tokens"].as_u64().unwrap(),
        usage["cache_read_input_tokens"].as_u64().unwrap(),
    );
    // The system prompt's whole blocks (of 32 tokens) are created, nothing read.
    assert!(created >= 32 && created.is_multiple_of(32), "{usage}");
    assert_eq!(read, 0, "{usage}");
    assert_eq!(pinned(), created as usize);
    let prompt = input + created + read;
    assert_eq!(
        head["x-perch-prompt-cache"],
        format!("cached=0; prompt={prompt}; miss=not_seen; at=0")
    );
    // The next question (long enough to fill another block) reads the pinned system prompt and
    // creates nothing new; it left the client's previous prompt where the question begins.
    let (status, head, body) = http(
        &addr,
        "POST",
        "/v1/messages",
        &headers,
        &messages(
            "Name a season, and say in one short sentence why the people who live by the sea \
             like that season more than any of the other three.",
            ephemeral.clone(),
        ),
    );
    assert_eq!(status, 200, "{body}");
    let usage = serde_json::from_str::<Value>(&body).unwrap()["usage"].clone();
    assert_eq!(usage["cache_creation_input_tokens"], 0, "{usage}");
    let read = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read >= created, "{usage}");
    let header = &head["x-perch-prompt-cache"];
    assert!(
        header.starts_with(&format!("cached={read}; prompt="))
            && header.contains("; miss=diverged; at="),
        "{header}"
    );
    // Bad breakpoints.
    let five = json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": (0..5)
            .map(|k| json!({"type": "text", "text": format!("part {k}"), "cache_control": ephemeral}))
            .collect::<Vec<_>>()}]});
    for (body, says) in [
        (
            messages("Hi", json!({"type": "forever"})),
            "cache_control.type must be `ephemeral`",
        ),
        (
            messages("Hi", json!({"type": "ephemeral", "ttl": "2h"})),
            "cache_control.ttl must be `5m` or `1h`",
        ),
        (five.to_string(), "at most 4 blocks may carry cache_control"),
    ] {
        let (status, _, answer) = http(&addr, "POST", "/v1/messages", &headers, &body);
        assert_eq!(status, 400, "{answer}");
        assert!(answer.contains(says), "{answer}");
    }
    // OpenAI's prompt_cache_key pins its whole prompt (beside the breakpoint's pin).
    let before = pinned();
    let mut chat: Value = serde_json::from_str(&chat_json(MODEL)).unwrap();
    chat["messages"][0]["content"] = json!(format!("{SYSTEM} Name a color."));
    chat["prompt_cache_key"] = json!("team-agent");
    let (status, head, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &JSON_WITH_KEY,
        &chat.to_string(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        head["x-perch-prompt-cache"].starts_with("cached="),
        "{head:?}"
    );
    assert!(pinned() > before);
    chat["prompt_cache_retention"] = json!("forever");
    let (status, _, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &JSON_WITH_KEY,
        &chat.to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("prompt_cache_retention"), "{body}");
    engine.shutdown();
}

#[test]
fn busy_servers_turn_requests_away_and_cors_is_opt_in() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let limited = ServerConfig {
        max_requests: 1,
        cors_origins: vec![perch_server::HeaderValue::from_static(
            "http://allowed.test",
        )],
        ..config()
    };
    let activity = limited.activity.clone();
    let (_runtime, addr) = start_server(&engine, limited);
    let addr = addr.to_string();
    let auth = [
        ("Authorization", "Bearer test-key"),
        ("Content-Type", "application/json"),
    ];
    let chat = serde_json::json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();

    let long = open_stream(&addr);
    assert_eq!(activity.requests(), 1);
    let (status, headers, body) = http(&addr, "POST", "/v1/chat/completions", &auth, &chat);
    assert_eq!(status, 503, "{body}");
    assert_eq!(headers.get("retry-after").map(String::as_str), Some("1"));
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "overloaded", "{body}");
    let message = serde_json::json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let (status, headers, body) = http(&addr, "POST", "/v1/messages", &auth, &message);
    assert_eq!(status, 503, "{body}");
    assert!(headers.contains_key("retry-after"));
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "overloaded_error", "{body}");

    drop(long);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while activity.requests() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (status, _, body) = http(&addr, "POST", "/v1/chat/completions", &auth, &chat);
    assert_eq!(status, 200, "{body}");
    assert_eq!(activity.served(), 2, "the two admitted requests");

    let preflight = |addr: &str, origin: &str| {
        http(
            addr,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                (
                    "Access-Control-Request-Headers",
                    "authorization,content-type",
                ),
            ],
            "",
        )
    };
    let allowed = |(status, headers, _): (u16, HashMap<String, String>, String)| {
        assert_eq!(status, 200);
        headers.get("access-control-allow-origin").cloned()
    };
    let origin = Some("http://allowed.test".to_owned());
    assert_eq!(allowed(preflight(&addr, "http://allowed.test")), origin);
    assert_eq!(allowed(preflight(&addr, "http://elsewhere.test")), None);
    let mut with_origin = auth.to_vec();
    with_origin.push(("Origin", "http://allowed.test"));
    let answer = http(&addr, "POST", "/v1/chat/completions", &with_origin, &chat);
    assert_eq!(allowed(answer), origin);
    // The default: no CORS at all.
    let (_other_runtime, plain) = start_server(&engine, config());
    let (_, headers, _) = preflight(&plain.to_string(), "http://allowed.test");
    assert!(!headers.contains_key("access-control-allow-origin"));
    engine.shutdown();
}

#[test]
fn the_anthropic_sdk_gets_messages() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    // The server's engine starts with an empty prefix cache; the direct answer comes after the
    // client's requests (greedy text is the same with the prefix read from the cache).
    let (_runtime, addr) = start_server(&engine, config());
    let args = [
        format!("http://{addr}"),
        KEY.into(),
        MODEL.into(),
        SYSTEM.into(),
    ];
    let seen = run_client("anthropic_client.py", &args);
    let (expected, prompt_tokens) = direct_answer(&engine, chat(), 8, |_| {});

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
    assert!((1..=8).contains(&output));
    let ended = if output == 8 {
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

    // A breakpoint: whole blocks of the system prompt created, then read (streamed).
    let first = &seen["cache_first"]["usage"];
    let created = first["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(created >= 32 && created.is_multiple_of(32), "{first}");
    assert_eq!(first["cache_read_input_tokens"], 0, "{first}");
    let second = &seen["cache_second"]["usage"];
    assert_eq!(second["cache_creation_input_tokens"], 0, "{second}");
    assert!(
        second["cache_read_input_tokens"].as_u64() >= Some(created),
        "{second}"
    );

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

/// The default model's files with a tool-capable chat template (`fixtures/tools_chatml.jinja`,
/// Hermes / Qwen 2.5 format) in `chat_template.jinja`, which wins over the tokenizer config's.
fn model_with_tool_template() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(perch_test_support::model_dir()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let template = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tools_chatml.jinja"
    );
    std::fs::copy(template, dir.path().join("chat_template.jinja")).unwrap();
    dir
}

/// A model that answers one prompt with a script: after `prompt_len` tokens it emits `script`
/// token by token (then its last token, an end of turn, forever), whatever it is fed. Its KV
/// cache holds zeros of the right length, so the engine's caches, prefix cache and streaming
/// work as for a real model. It runs per sequence (the CPU path).
#[derive(Clone)]
struct ScriptedModel {
    info: perch_engine::models::ModelInfo,
    prompt_len: usize,
    script: Vec<u32>,
}

impl ScriptedModel {
    /// The token after the one at `position`.
    fn next_after(&self, position: usize) -> u32 {
        (position + 1)
            .checked_sub(self.prompt_len)
            .and_then(|k| self.script.get(k))
            .or(self.script.last())
            .copied()
            .unwrap_or(0)
    }

    /// Logits `[rows, vocab]` with all the mass on `tokens`.
    fn one_hot(&self, tokens: &[u32]) -> mlx_rs::Array {
        let vocab = self.info.vocab_size;
        let mut logits = vec![0f32; tokens.len() * vocab];
        for (row, &t) in tokens.iter().enumerate() {
            logits[row * vocab + t as usize] = 30.0;
        }
        mlx_rs::Array::from_slice(&logits, &[tokens.len() as i32, vocab as i32])
    }

    fn remember(cache: &mut [perch_engine::testing::KvCache], n: i32) -> perch_engine::Result<()> {
        for layer in cache {
            let zeros = mlx_rs::Array::zeros::<f32>(&[1, 1, n, 8])?;
            layer.update_and_fetch(&zeros, &zeros)?;
        }
        Ok(())
    }
}

impl perch_engine::models::Model for ScriptedModel {
    fn forward(
        &self,
        ids: &mlx_rs::Array,
        _spliced: Option<&perch_engine::models::Spliced>,
        caches: &mut perch_engine::kv::LayerCaches<'_>,
        _output: perch_engine::models::Output,
    ) -> perch_engine::Result<Option<mlx_rs::Array>> {
        use perch_engine::kv::LayerCaches;
        let (rows, tokens) = (ids.shape()[0], ids.shape()[1]);
        // Only each row's last position's logits are ever read (a decode step's).
        let last: Vec<usize> = match caches {
            LayerCaches::Sequence(cache) => {
                let last = cache[0].offset() as usize + tokens as usize - 1;
                Self::remember(cache, tokens)?;
                vec![last]
            }
            LayerCaches::Slots { cache, step } => {
                // Something in the cache, for the prefix cache to copy out.
                let zeros = mlx_rs::Array::zeros::<f32>(&[rows, 1, tokens, 8])?;
                cache.update_and_fetch(0, step, &zeros, &zeros)?;
                step.positions
                    .as_slice::<i32>()
                    .iter()
                    .map(|&p| p as usize + tokens as usize - 1)
                    .collect()
            }
        };
        let next: Vec<u32> = last.iter().map(|&p| self.next_after(p)).collect();
        let vocab = self.info.vocab_size as i32;
        let last = self.one_hot(&next).reshape(&[rows, 1, vocab])?;
        if tokens == 1 {
            return Ok(Some(last));
        }
        let before = mlx_rs::Array::zeros::<f32>(&[rows, tokens - 1, vocab])?;
        Ok(Some(mlx_rs::ops::concatenate(&[before, last], 1)?))
    }

    fn clone_for_compile(&self) -> Box<dyn perch_engine::models::Model> {
        Box::new(self.clone())
    }

    fn info(&self) -> &perch_engine::models::ModelInfo {
        &self.info
    }
}

/// Tool calling through both SDKs, on a model with a tool-capable template whose answer to the
/// tool request is scripted to call the tool (the default model never does): the prompt with
/// tool definitions is transformers' own rendering of the same conversation; the answer comes
/// back split into text and calls, with no markup left in the text, plain and streamed (the
/// markup arrives in pieces, as the detokenizer streams it); tool results come back in a later
/// turn (and its prompt is transformers' too), in OpenAI's and Anthropic's shapes.
#[test]
fn tool_calls_through_both_sdks() {
    let dir = model_with_tool_template();
    let tools = vec![serde_json::json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]},
    }})];
    let messages = [
        ChatMessage::new(
            "system",
            "You are a helpful assistant with access to tools.",
        ),
        ChatMessage::new("user", "What is the weather like in Paris today?"),
    ];
    let tokenizer = perch_engine::Tokenizer::load(dir.path()).unwrap();
    let ids = tokenizer
        .encode_chat_with_tools(&messages, Some(&tools))
        .unwrap();
    let answer = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let mut script = tokenizer.encode(answer, false).unwrap();
    script.extend(tokenizer.encode("<|im_end|>", false).unwrap());
    let model = ScriptedModel {
        info: perch_engine::models::ModelInfo {
            model_type: "scripted".into(),
            vocab_size: 49152,
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 8,
            context_length: 8192,
            hidden_size: 8,
            num_heads: 1,
            mlp_width: 8,
        },
        prompt_len: ids.len(),
        script,
    };
    let tokenizer_dir = dir.path().to_path_buf();
    // The engine never unloads it (keep-alive forever), so it loads once.
    let mut model = Some(model);
    let engine = EngineHandle::spawn_with(EngineConfig::default(), "scripted".into(), move |_| {
        let model = model.take().ok_or_else(|| {
            perch_engine::EngineError::Request("the scripted model loads once".into())
        })?;
        Ok((
            Box::new(model) as Box<dyn perch_engine::models::Model>,
            perch_engine::Tokenizer::load(&tokenizer_dir)?,
        ))
    })
    .unwrap();
    let (raw, _) = direct_answer(&engine, Prompt::Tokens(ids.clone()), 60, |_| {});
    assert_eq!(raw, answer, "the script, streamed by the engine");
    let text = "Let me check.\n";
    let calls = vec![serde_json::json!({"name": "get_weather", "arguments": {"city": "Paris"}})];

    let (_runtime, addr) = start_server(&engine, config());
    let args = [
        format!("http://{addr}"),
        KEY.into(),
        MODEL.into(),
        dir.path().display().to_string(),
    ];
    let seen = run_client("tools_client.py", &args);

    assert_eq!(
        seen["hf_ids"],
        serde_json::json!(ids),
        "transformers renders the same prompt"
    );
    for case in ["openai", "openai_stream"] {
        let answer = &seen[case];
        assert_eq!(answer["content"], text, "{case}: {answer}");
        let got: Vec<Value> = answer["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| serde_json::json!({"name": c["name"], "arguments": c["arguments"]}))
            .collect();
        assert_eq!(got, calls, "{case}: {answer}");
        assert!(answer["tool_calls"][0]["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")));
        assert_eq!(answer["finish_reason"], "tool_calls", "{case}");
    }
    assert_eq!(seen["openai"]["prompt_tokens"], ids.len());
    let followup = &seen["openai_followup"];
    assert_eq!(followup["prompt_tokens"], seen["hf_followup_tokens"]);
    assert!(followup["cached_tokens"].as_u64() > Some(0), "{followup}");
    assert!(
        seen["openai_none_prompt_tokens"].as_u64() < Some(ids.len() as u64),
        "tool_choice none leaves the tools out of the prompt"
    );
    for case in ["anthropic", "anthropic_stream"] {
        let reply = &seen[case];
        let blocks = reply["content"].as_array().unwrap();
        let texts: String = blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .map(|b| b["text"].as_str().unwrap())
            .collect();
        assert_eq!(texts, text, "{case}: {reply}");
        let uses: Vec<Value> = blocks
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| serde_json::json!({"name": b["name"], "arguments": b["input"]}))
            .collect();
        assert_eq!(uses, calls, "{case}: {reply}");
        assert_eq!(reply["stop_reason"], "tool_use", "{case}");
    }
    assert_eq!(
        seen["anthropic_followup_tokens"],
        seen["hf_followup_tokens"]
    );
    engine.shutdown();
}

/// `POST /v1/next_token_logprobs`: base64 float32 rows equal to what the engine answers
/// directly, top-k in order, and the documented errors.
#[test]
fn next_token_logprobs_over_http() {
    use base64::Engine as _;
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let prompts = vec![
        vec![1u32, 9690, 198, 2683],
        vec![1, 9690, 198, 2683, 359, 253],
    ];
    let direct = engine.batch_next_token_logprobs(prompts.clone()).unwrap();
    let vocab = direct[0].len();
    let (_runtime, addr) = start_server(&engine, config());
    let addr = addr.to_string();
    let auth = [
        ("Authorization", "Bearer test-key"),
        ("Content-Type", "application/json"),
    ];
    let ask = |body: Value| {
        let (status, _, answer) = http(
            &addr,
            "POST",
            "/v1/next_token_logprobs",
            &auth,
            &body.to_string(),
        );
        (status, serde_json::from_str::<Value>(&answer).unwrap())
    };
    let (status, answer) = ask(serde_json::json!({"token_ids": prompts}));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["shape"], serde_json::json!([2, vocab]));
    assert_eq!(answer["dtype"], "float32");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(answer["data"].as_str().unwrap())
        .unwrap();
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for (row, want) in floats.chunks(vocab).zip(&direct) {
        let diff = row
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "max |diff| {diff}");
    }

    let (status, answer) =
        ask(serde_json::json!({"token_ids": [prompts[1]], "top_k": 5, "model": MODEL}));
    assert_eq!(status, 200, "{answer}");
    let top = answer["top_logprobs"][0].as_array().unwrap();
    assert_eq!(top.len(), 5);
    assert!(top.iter().all(|t| t["token"].is_string()));
    let got: Vec<(usize, f64)> = top
        .iter()
        .map(|t| {
            (
                t["token_id"].as_u64().unwrap() as usize,
                t["logprob"].as_f64().unwrap(),
            )
        })
        .collect();
    assert!(
        got.windows(2).all(|w| w[0].1 >= w[1].1),
        "most likely first"
    );
    // Each is the engine's value, and no token left out is more likely than the fifth.
    for &(id, logprob) in &got {
        assert!((logprob - direct[1][id] as f64).abs() < 1e-4);
    }
    let best_left_out = (0..vocab)
        .filter(|id| got.iter().all(|(g, _)| g != id))
        .map(|id| direct[1][id] as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    assert!(best_left_out <= got[4].1 + 1e-4);

    for (body, status, param) in [
        (
            serde_json::json!({"token_ids": []}),
            400,
            Value::from("token_ids"),
        ),
        (serde_json::json!({"token_ids": [[]]}), 400, Value::Null),
        (
            serde_json::json!({"token_ids": [[1]], "model": "other"}),
            404,
            Value::from("model"),
        ),
        (serde_json::json!({"token_ids": "no"}), 400, Value::Null),
    ] {
        let (got, answer) = ask(body.clone());
        assert_eq!(got, status, "{body}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{body}: {answer}");
    }
    engine.shutdown();
}

/// Agent loops keep their cache: each of the five turns of a scripted coding-agent conversation
/// (long system prompt and tools, answers and tool results appended, a system reminder appended
/// to the last turn) reads at least 90% of the previous turn's prompt from the prefix cache.
#[test]
fn an_agent_loop_keeps_its_cache() {
    let dir = model_with_tool_template();
    let engine = EngineHandle::load(dir.path(), EngineConfig::default()).unwrap();
    let (_runtime, addr) = start_server(&engine, config());
    let seen = run_client(
        "agent_loop_client.py",
        &[format!("http://{addr}"), KEY.into(), MODEL.into()],
    );
    let turns = seen["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 5);
    assert!(
        turns[0]["prompt_tokens"].as_u64() > Some(800),
        "a long system prompt and tools"
    );
    for k in 1..turns.len() {
        let seen_before = turns[k - 1]["prompt_tokens"].as_u64().unwrap() as f64;
        let cached = turns[k]["cached_tokens"].as_u64().unwrap() as f64;
        assert!(
            cached >= 0.9 * seen_before,
            "turn {k}: {cached} cached of the {seen_before} tokens sent before"
        );
    }
    engine.shutdown();
}

#[test]
fn forced_tool_calls_through_both_sdks() {
    // The real test model (which never writes a tool call by itself) with a tool-capable
    // template: a forced choice makes it call, with arguments valid against the tool's schema.
    let dir = model_with_tool_template();
    let engine = EngineHandle::load(dir.path(), EngineConfig::default()).unwrap();
    let (_runtime, addr) = start_server(&engine, config());
    let seen = run_client(
        "forced_tools_client.py",
        &[format!("http://{addr}"), KEY.into(), MODEL.into()],
    );
    let valid = |call: &Value| match call["name"].as_str() {
        Some("get_weather") => ["Paris", "London", "Tokyo"]
            .contains(&call["arguments"]["city"].as_str().unwrap_or_default()),
        Some("get_time") => {
            ["UTC", "CET", "JST"]
                .contains(&call["arguments"]["timezone"].as_str().unwrap_or_default())
                && call["arguments"]["24h"].is_boolean()
        }
        _ => false,
    };
    for case in ["required", "named", "streamed"] {
        let answer = &seen[case];
        assert_eq!(answer["finish_reason"], "tool_calls", "{case}: {answer}");
        let calls = answer["calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{case}: {answer}");
        assert!(calls.iter().all(valid), "{case}: {answer}");
    }
    assert_eq!(seen["named"]["calls"].as_array().unwrap().len(), 1);
    assert_eq!(seen["named"]["calls"][0]["name"], "get_time");
    let indexed: Vec<Value> = seen["required"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, c)| serde_json::json!({"index": i, "name": c["name"], "arguments": c["arguments"]}))
        .collect();
    assert_eq!(
        seen["streamed"]["calls"],
        Value::Array(indexed),
        "the same calls streamed as deltas"
    );
    for case in ["required_without_tools", "unknown_name"] {
        assert_eq!(seen[case]["status"], 400, "{case}: {}", seen[case]);
    }
    for case in ["anthropic_any", "anthropic_tool"] {
        let reply = &seen[case];
        assert_eq!(reply["stop_reason"], "tool_use", "{case}: {reply}");
        let uses: Vec<&Value> = reply["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert!(!uses.is_empty(), "{case}: {reply}");
        for block in uses {
            let call = serde_json::json!({"name": block["name"], "arguments": block["input"]});
            assert!(valid(&call), "{case}: {reply}");
        }
    }
    assert_eq!(seen["anthropic_tool"]["blocks"][0]["name"], "get_weather");
    engine.shutdown();
}

#[test]
fn eight_streaming_clients_are_served_batched() {
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    // What each client should see: its greedy answer, from the engine directly (all at once:
    // batched answers are each request's own, `perch-engine`'s batch_parity.rs).
    let expected: Vec<String> = std::thread::scope(|scope| {
        let answers: Vec<_> = (0..8)
            .map(|k| {
                let engine = &engine;
                scope.spawn(move || {
                    let prompt = Prompt::Chat(vec![ChatMessage::new(
                        "user",
                        format!("Count from {k} to {}, one number per line.", k + 20),
                    )]);
                    direct_answer(engine, prompt, 8, |_| {}).0
                })
            })
            .collect();
        answers.into_iter().map(|a| a.join().unwrap()).collect()
    });
    let (_runtime, addr) = start_server(&engine, config());
    let before = engine.stats().unwrap().step_times;
    let seen = run_client(
        "concurrent_client.py",
        &[format!("http://{addr}/v1"), KEY.into(), MODEL.into()],
    );
    let after = engine.stats().unwrap().step_times;
    let streams = seen["streams"].as_array().unwrap();
    assert_eq!(streams.len(), 8);
    for (k, stream) in streams.iter().enumerate() {
        assert!(
            ["stop", "length"].contains(&stream["finish_reason"].as_str().unwrap_or_default()),
            "client {k}: {stream}"
        );
        assert_eq!(stream["content"], expected[k].as_str(), "client {k}");
    }
    // Run one after another, 8 answers of up to 8 tokens take a decode step per token; batched,
    // the steps serve many clients each.
    let tokens: usize = expected
        .iter()
        .map(|text| engine.tokenizer().encode(text, false).unwrap().len())
        .sum();
    let steps = after.decode_steps - before.decode_steps;
    eprintln!("8 clients, about {tokens} tokens: {steps} decode steps");
    assert!(
        (steps as usize) * 2 < tokens,
        "{steps} decode steps for {tokens} tokens: not batched"
    );
    engine.shutdown();
}

/// Waits up to a minute for `engine`'s residency to be `want`.
fn reaches(engine: &EngineHandle, want: perch_engine::Residency) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if engine.stats().unwrap().residency == want {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    false
}

#[test]
fn keep_alive_over_http_unloads_the_model_and_the_next_request_loads_it() {
    use perch_engine::Residency;
    let engine = EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default())
        .expect("the default model loads");
    let (_runtime, addr) = start_server(&engine, config());
    let addr = addr.to_string();
    let auth = [
        ("Authorization", "Bearer test-key"),
        ("Content-Type", "application/json"),
    ];
    let chat = |keep_alive: Value| {
        let mut body = serde_json::json!({"model": MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]});
        if !keep_alive.is_null() {
            body["keep_alive"] = keep_alive;
        }
        let (status, _, body) = http(
            &addr,
            "POST",
            "/v1/chat/completions",
            &auth,
            &body.to_string(),
        );
        let body: Value = serde_json::from_str(&body).unwrap();
        (status, body)
    };
    let (status, first) = chat(Value::Null);
    assert_eq!(status, 200, "{first}");
    // Ollama's `keep_alive: 0`: unloaded once the request ends.
    let (status, body) = chat(serde_json::json!(0));
    assert_eq!(status, 200, "{body}");
    assert!(reaches(&engine, Residency::Unloaded));
    // The next request loads it again and answers the same; "-1" keeps it loaded.
    let (status, again) = chat(serde_json::json!("-1"));
    assert_eq!(status, 200, "{again}");
    let text = |b: &Value| b["choices"][0]["message"]["content"].clone();
    assert_eq!(text(&again), text(&first));
    assert_eq!(engine.stats().unwrap().residency, Residency::Loaded);
    // Anthropic's endpoint takes it too, as a duration.
    let message = serde_json::json!({"model": MODEL, "max_tokens": 2, "keep_alive": "0s",
        "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, body) = http(&addr, "POST", "/v1/messages", &auth, &message.to_string());
    assert_eq!(status, 200, "{body}");
    assert!(reaches(&engine, Residency::Unloaded));
    // A value that is not a duration is the client's error, naming the field.
    let (status, body) = chat(serde_json::json!("soon"));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "keep_alive", "{body}");
    engine.shutdown();
}

/// Images through both SDKs (OpenAI's `image_url` data URLs, Anthropic's base64 `image` blocks)
/// to a tiny random Gemma 3 with its vision tower (written by mlx-vlm: perch-engine's
/// `tests/oracle/tiny_vision.py`): each answers as the engine answers the same chat, streamed or
/// not; `/v1/models` lists it with `vision`; a remote URL and a damaged image are 400s; the
/// default (text-only) model answers an image with a 400 and lists no `vision`.
#[test]
fn images_through_both_sdks() {
    let out = tempfile::tempdir().unwrap();
    let script = format!(
        "{}/../perch-engine/tests/oracle/tiny_vision.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let status = Command::new(perch_test_support::oracle_python())
        .arg(script)
        .arg(out.path())
        .arg(perch_test_support::model_dir())
        .status()
        .unwrap();
    assert!(status.success(), "tiny_vision.py failed");
    let dir = out.path().join("gemma3");
    // A 32 × 32 image (the tower's size, so no resampling) of varied pixels.
    let image = image::RgbImage::from_fn(32, 32, |x, y| {
        image::Rgb([(x * 8) as u8, (y * 8) as u8, 90])
    });
    let png = out.path().join("square.png");
    image.save(&png).unwrap();
    let url = format!(
        "data:image/png;base64,{}",
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            std::fs::read(&png).unwrap()
        )
    );
    let engine = EngineHandle::load(&dir, EngineConfig::default()).unwrap();
    let chat = Prompt::Chat(vec![ChatMessage::from_parts(
        "user",
        vec![
            ContentPart::Image(url),
            ContentPart::Text("What is this?".into()),
        ],
    )]);
    let (expected, prompt_tokens) =
        direct_answer(&engine, chat, 6, |p| p.sampling.temperature = 0.0);
    let (_runtime, addr) = start_server(&engine, config());
    let args = [
        format!("http://{addr}"),
        KEY.into(),
        MODEL.into(),
        png.display().to_string(),
    ];
    let seen = run_client("vision_client.py", &args);
    assert_eq!(
        seen["models"][0]["capabilities"],
        serde_json::json!(["completion", "vision"])
    );
    assert_eq!(seen["openai"]["content"], expected.as_str());
    assert_eq!(seen["openai"]["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(seen["openai_stream"], expected.as_str());
    assert_eq!(seen["anthropic"]["content"], expected.as_str());
    for (case, says) in [("remote", "does not fetch"), ("damaged", "damaged")] {
        assert_eq!(seen[case]["status"], 400, "{case}");
        let message = seen[case]["message"].as_str().unwrap();
        assert!(message.contains(says), "{case}: {message}");
    }
    // A photo-sized image (a 1,024 × 1,024 PNG of noise, over 3 MB): past axum's default body
    // limit, within the server's.
    let mut state = 1u32;
    let noise = image::RgbImage::from_fn(1024, 1024, |_, _| {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        image::Rgb([(state >> 24) as u8, (state >> 16) as u8, (state >> 8) as u8])
    });
    let big = out.path().join("big.png");
    noise.save(&big).unwrap();
    let bytes = std::fs::read(&big).unwrap();
    assert!(bytes.len() > 3 << 20);
    let body = serde_json::json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &bytes))}},
        {"type": "text", "text": "Hi"}]}]});
    let auth = [
        ("Authorization", "Bearer test-key"),
        ("Content-Type", "application/json"),
    ];
    let (status, _, reply) = http(
        &addr.to_string(),
        "POST",
        "/v1/chat/completions",
        &auth,
        &body.to_string(),
    );
    assert_eq!(status, 200, "{reply}");

    // The text-only default model: a 400 that says so.
    let text =
        EngineHandle::load(&perch_test_support::model_dir(), EngineConfig::default()).unwrap();
    let (_runtime, addr) = start_server(&text, config());
    let body = serde_json::json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "Hi"}]}]});
    let addr = addr.to_string();
    let auth = [
        ("Authorization", "Bearer test-key"),
        ("Content-Type", "application/json"),
    ];
    let (status, _, reply) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &auth,
        &body.to_string(),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply.contains("takes no images"), "{reply}");
    let (_, _, models) = http(&addr, "GET", "/v1/models", &auth, "");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(
        models["data"][0]["capabilities"],
        serde_json::json!(["completion"])
    );
}
