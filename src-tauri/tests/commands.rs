//! The app's commands on Tauri's mock runtime (no display): through the IPC layer as the web view
//! calls them (`tauri://localhost`, so the request passes the same origin checks as the app's),
//! and `chat` directly with a Rust-side `Channel`, on the real shared model.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use perch_app::commands::{self, AppState};
use serde_json::{json, Value};
use tauri::ipc::{CallbackFn, Channel, InvokeBody, InvokeResponseBody};
use tauri::test::{
    get_ipc_response, mock_builder, mock_context, noop_assets, MockRuntime, INVOKE_KEY,
};
use tauri::webview::InvokeRequest;
use tauri::{Manager, WebviewWindow, WebviewWindowBuilder};

fn shared_dir() -> PathBuf {
    std::env::var_os("PERCH_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared"))
}

fn model_dir() -> PathBuf {
    shared_dir().join("models/SmolLM2-135M-Instruct-4bit")
}

/// MLX's memory counters and the environment are process-wide: the tests here take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn app() -> (tauri::App<MockRuntime>, WebviewWindow<MockRuntime>) {
    let app = perch_app::with_commands(mock_builder())
        .build(mock_context(noop_assets()))
        .expect("app builds");
    let window = WebviewWindowBuilder::new(&app, perch_app::WINDOW, Default::default())
        .build()
        .expect("window builds");
    (app, window)
}

fn invoke(window: &WebviewWindow<MockRuntime>, cmd: &str, args: Value) -> Result<Value, Value> {
    get_ipc_response(
        window,
        InvokeRequest {
            cmd: cmd.into(),
            callback: CallbackFn(0),
            error: CallbackFn(1),
            url: "tauri://localhost".parse().unwrap(),
            body: InvokeBody::Json(args),
            headers: Default::default(),
            invoke_key: INVOKE_KEY.to_string(),
        },
    )
    .map(|body| body.deserialize::<Value>().expect("JSON response"))
}

#[test]
fn model_lifecycle_through_ipc() {
    let _turn = serial();
    let (_app, window) = app();
    assert_eq!(
        invoke(&window, "model_status", json!({})),
        Ok(json!({"state": "not_loaded"}))
    );
    assert_eq!(invoke(&window, "engine_stats", json!({})), Ok(Value::Null));

    // A directory that holds no model: one clear sentence, and the status says so.
    let error = invoke(&window, "load_model", json!({"path": "/nonexistent/model"})).unwrap_err();
    let error = error.as_str().expect("a string").to_owned();
    assert!(
        error.starts_with(char::is_uppercase) && error.ends_with('.'),
        "{error}"
    );
    assert!(error.contains("/nonexistent/model"), "{error}");
    let status = invoke(&window, "model_status", json!({})).unwrap();
    assert_eq!(status["state"], "failed");
    assert_eq!(status["error"], error.as_str());

    let status = invoke(&window, "load_model", json!({"path": model_dir()})).unwrap();
    assert_eq!(status["state"], "loaded", "{status}");
    let stats = invoke(&window, "engine_stats", json!({})).unwrap();
    assert_eq!(stats["running"], 0);
    assert!(
        stats["kv_cache"]["blocks_total"].as_u64().unwrap() > 0,
        "{stats}"
    );
    assert!(
        stats["memory"]["active_bytes"].as_u64().unwrap() > 0,
        "{stats}"
    );

    // Reset peak: a new measurement starts from what is live now.
    let peak_before = stats["memory"]["peak_bytes"].as_u64().unwrap();
    assert_eq!(
        invoke(&window, "reset_peak_memory", json!({})),
        Ok(Value::Null)
    );
    let memory = &invoke(&window, "engine_stats", json!({})).unwrap()["memory"];
    let (peak, active) = (
        memory["peak_bytes"].as_u64().unwrap(),
        memory["active_bytes"].as_u64().unwrap(),
    );
    assert!(
        peak >= active && peak <= peak_before,
        "peak {peak}, active {active}, before {peak_before}"
    );

    let system = invoke(&window, "system_stats", json!({})).unwrap();
    let (used, total) = (
        system["ram_used_bytes"].as_u64().unwrap(),
        system["ram_total_bytes"].as_u64().unwrap(),
    );
    assert!(0 < used && used < total, "{system}");
    // The model's weights are resident in this process.
    assert!(
        system["process_rss_bytes"].as_u64().unwrap() > 50 << 20,
        "{system}"
    );

    assert_eq!(invoke(&window, "unload_model", json!({})), Ok(Value::Null));
    assert_eq!(
        invoke(&window, "model_status", json!({})),
        Ok(json!({"state": "not_loaded"}))
    );
    let error = invoke(&window, "stop", json!({"requestId": 1})).unwrap_err();
    assert_eq!(error, json!("No model is loaded; choose one under Models."));
}

#[test]
fn list_models_finds_perch_and_hugging_face_models() {
    let _turn = serial();
    let (_app, window) = app();
    let root = tempfile::tempdir().unwrap();
    let perch = root.path().join("models");
    std::fs::create_dir_all(&perch).unwrap();
    std::os::unix::fs::symlink(model_dir(), perch.join("smollm")).unwrap();
    std::env::set_var("PERCH_MODELS_DIR", &perch);
    std::env::set_var("HF_HUB_CACHE", root.path().join("hub"));
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models.as_array().unwrap().len(), 1, "{models}");
    assert_eq!(models[0]["name"], "smollm");
    assert_eq!(models[0]["source"], "perch");
    assert_eq!(models[0]["model_type"], "llama");
    assert_eq!(models[0]["quantization_bits"], 4);
}

/// Collects a chat's channel messages.
fn channel() -> (Channel<commands::ChatEvent>, mpsc::Receiver<Value>) {
    let (tx, rx) = mpsc::channel();
    let channel = Channel::new(move |body| {
        let value = match body {
            InvokeResponseBody::Json(text) => serde_json::from_str(&text).unwrap(),
            InvokeResponseBody::Raw(bytes) => serde_json::from_slice(&bytes).unwrap(),
        };
        let _ = tx.send(value);
        Ok(())
    });
    (channel, rx)
}

#[test]
fn chat_streams_the_reference_answer_and_stop_cancels() {
    let _turn = serial();
    let (app, _window) = app();
    let state = app.state::<AppState>();
    state.load(model_dir()).expect("model loads");

    // The shared reference: greedy, 32 tokens, chat-templated.
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(shared_dir().join("reference/smollm2-135m-4bit-greedy.json"))
            .unwrap(),
    )
    .unwrap();
    let case = reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["messages"].is_array())
        .expect("a chat case");
    let messages = serde_json::from_value(case["messages"].clone()).unwrap();
    let options = serde_json::from_value(json!({"max_tokens": 32})).unwrap();
    let (events, received) = channel();
    commands::chat(app.state(), messages, Some(options), events).expect("chat starts");
    let mut text = String::new();
    let finished = loop {
        let event = received
            .recv_timeout(Duration::from_secs(300))
            .expect("an event");
        match event["event"].as_str() {
            Some("token") => text.push_str(event["text"].as_str().unwrap()),
            Some("finished") => break event,
            other => panic!("unexpected event {other:?}"),
        }
    };
    assert_eq!(text, case["greedy_text"].as_str().unwrap());
    assert!(finished["stats"]["generation_tokens"].as_u64().unwrap() > 0);

    // Stop after the first token: the request ends as cancelled, long before 200 tokens.
    let messages =
        serde_json::from_value(json!([{"role": "user", "content": "Count from 1 to 500."}]))
            .unwrap();
    let options = serde_json::from_value(json!({"max_tokens": 200})).unwrap();
    let (events, received) = channel();
    let id = commands::chat(app.state(), messages, Some(options), events).unwrap();
    let first = received.recv_timeout(Duration::from_secs(300)).unwrap();
    assert_eq!(first["event"], "token");
    commands::stop(app.state(), id).unwrap();
    let finished = received
        .iter()
        .find(|e| e["event"] == "finished")
        .expect("a finished event");
    assert_eq!(finished["finish_reason"], "cancelled");
    assert!(finished["stats"]["generation_tokens"].as_u64().unwrap() < 200);
}
