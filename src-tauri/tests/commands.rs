//! The app's commands on Tauri's mock runtime (no display): through the IPC layer as the web view
//! calls them (`tauri://localhost`, so the request passes the same origin checks as the app's),
//! and `chat` directly with a Rust-side `Channel`, on the test model (`perch-test-support`). Each app keeps its
//! history and settings in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use perch_app::commands::chat::{self as chat_commands, ChatEvent};
use perch_app::commands::hub as hub_commands;
use perch_app::commands::CommandErrorKind;
use perch_app::store::Store;
use perch_app::AppState;
use perch_store::Turn;
use serde_json::{json, Value};
use tauri::ipc::{CallbackFn, Channel, InvokeBody, InvokeResponseBody};
use tauri::test::{
    get_ipc_response, mock_builder, mock_context, noop_assets, MockRuntime, INVOKE_KEY,
};
use tauri::webview::InvokeRequest;
use tauri::{Manager, WebviewWindow, WebviewWindowBuilder};

fn model_dir() -> PathBuf {
    perch_test_support::model_dir()
}

/// MLX's memory counters and the environment are process-wide: the tests here take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const RAM: u64 = 16 << 30;

fn app(data_dir: &Path) -> (tauri::App<MockRuntime>, WebviewWindow<MockRuntime>) {
    let app = perch_app::with_commands(mock_builder(), Store::open(data_dir, RAM))
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
    let data = tempfile::tempdir().unwrap();
    let (_app, window) = app(data.path());
    assert_eq!(
        invoke(&window, "model_status", json!({})),
        Ok(json!({"state": "not_loaded"}))
    );
    assert_eq!(invoke(&window, "engine_stats", json!({})), Ok(Value::Null));

    // A directory that holds no model: one clear sentence, and the status says so.
    let error = invoke(&window, "load_model", json!({"path": "/nonexistent/model"})).unwrap_err();
    assert_eq!(error["kind"], "invalid_model", "{error}");
    let error = error["message"].as_str().expect("a sentence").to_owned();
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
    // The loaded model cannot be deleted.
    let error = invoke(&window, "delete_model", json!({"path": model_dir()})).unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("is loaded: unload it"),
        "{error}"
    );
    assert!(model_dir().join("config.json").is_file());
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
    assert_eq!(
        system["usable_memory_bytes"].as_u64().unwrap(),
        (total as f64 * 0.75) as u64
    );
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
    assert_eq!(
        error,
        json!({"kind": "model_not_loaded", "message": "No model is loaded; choose one under Models."})
    );
}

#[test]
fn list_models_finds_perch_and_hugging_face_models() {
    let _turn = serial();
    let root = tempfile::tempdir().unwrap();
    let (_app, window) = app(root.path());
    let perch = root.path().join("models");
    std::fs::create_dir_all(&perch).unwrap();
    std::os::unix::fs::symlink(model_dir(), perch.join("smollm")).unwrap();
    // A model of an architecture Perch does not run: listed, and said so.
    std::fs::create_dir(perch.join("mamba")).unwrap();
    std::fs::write(
        perch.join("mamba/config.json"),
        r#"{"model_type": "mamba"}"#,
    )
    .unwrap();
    std::env::set_var("PERCH_MODELS_DIR", &perch);
    std::env::set_var("HF_HUB_CACHE", root.path().join("hub"));
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models.as_array().unwrap().len(), 2, "{models}");
    assert_eq!(models[0]["name"], "mamba");
    let note = models[0]["architecture_note"].as_str().expect("a note");
    assert!(
        note.starts_with("mamba is not supported yet") && note.contains("llama"),
        "{note}"
    );
    assert_eq!(models[1]["name"], "smollm");
    assert_eq!(models[1]["source"], "perch");
    assert_eq!(models[1]["model_type"], "llama");
    assert_eq!(models[1]["quantization_bits"], 4);
    assert_eq!(models[1]["architecture_note"], Value::Null);
    // A 100 MB model and the default KV budget in 16 GiB of RAM.
    assert_eq!(models[1]["fit"], "fits");
    // No hosts in the settings: no group to judge it against.
    assert_eq!(models[1]["group_fit"], Value::Null);

    // Settings → Hosts: this machine under two names is one machine running both ranks; until
    // the hosts are read there is no reading and no group fit, then the model fits the group.
    let mut settings = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    settings["hosts"] = json!(["127.0.0.1", "localhost"]);
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    assert_eq!(invoke(&window, "hosts_status", json!({})), Ok(Value::Null));
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models[1]["group_fit"], Value::Null, "{models}");
    let hosts = invoke(&window, "check_hosts", json!({})).unwrap();
    assert_eq!(hosts["machines"].as_array().unwrap().len(), 1, "{hosts}");
    assert_eq!(hosts["machines"][0]["login"], "127.0.0.1");
    assert_eq!(hosts["machines"][0]["ranks"], 2);
    assert_eq!(hosts["machines"][0]["share"], 1.0);
    assert!(
        hosts["machines"][0]["memory_bytes"].as_u64().unwrap() > 0,
        "{hosts}"
    );
    assert_eq!(invoke(&window, "hosts_status", json!({})), Ok(hosts));
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models[1]["group_fit"], "fits", "{models}");
    // Another list: the reading is of the old one.
    settings["hosts"] = json!(["127.0.0.1"]);
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    assert_eq!(invoke(&window, "hosts_status", json!({})), Ok(Value::Null));
    settings["hosts"] = json!(["-oProxyCommand=x"]);
    let error = invoke(&window, "save_settings", json!({"settings": settings})).unwrap_err();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("is not a host name"),
        "{error}"
    );

    // Deleting: a path that is not a listed model is refused; a model's directory goes (its
    // bytes freed); a link to a model elsewhere loses only the link.
    let error = invoke(&window, "delete_model", json!({"path": perch})).unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    let freed = invoke(
        &window,
        "delete_model",
        json!({"path": perch.join("mamba")}),
    )
    .unwrap();
    assert_eq!(freed, json!(r#"{"model_type": "mamba"}"#.len()));
    assert!(!perch.join("mamba").exists());
    let freed = invoke(
        &window,
        "delete_model",
        json!({"path": perch.join("smollm")}),
    )
    .unwrap();
    assert_eq!(freed, json!(0));
    assert!(
        model_dir().join("config.json").is_file(),
        "the link's target stays"
    );
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models, json!([]));
}

#[test]
fn conversations_through_ipc() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (_app, window) = app(data.path());
    assert_eq!(invoke(&window, "startup_notices", json!({})), Ok(json!([])));
    let first = invoke(&window, "create_conversation", json!({})).unwrap();
    let second = invoke(&window, "create_conversation", json!({})).unwrap();
    assert_eq!(first["title"], "New chat");
    let renamed = invoke(
        &window,
        "rename_conversation",
        json!({"id": first["id"], "title": "Sky questions"}),
    )
    .unwrap();
    assert_eq!(renamed["title"], "Sky questions");
    let found = invoke(&window, "list_conversations", json!({"search": "sky"})).unwrap();
    assert_eq!(found.as_array().unwrap().len(), 1, "{found}");
    assert_eq!(found[0]["id"], first["id"]);
    let all = invoke(&window, "list_conversations", json!({})).unwrap();
    assert_eq!(
        all[0]["id"], second["id"],
        "renaming is not activity: {all}"
    );

    // Per-conversation settings are validated and kept.
    let bad = json!({"system_prompt": "", "sampling": {"temperature": -1.0}, "max_tokens": 10});
    let error = invoke(
        &window,
        "set_conversation_settings",
        json!({"id": second["id"], "settings": bad}),
    )
    .unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("temperature"),
        "{error}"
    );
    let good = json!({"system_prompt": "You are a poet.", "sampling": {"temperature": 0.5}, "max_tokens": 10});
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": second["id"], "settings": good}),
    )
    .unwrap();
    let conversation = invoke(&window, "get_conversation", json!({"id": second["id"]})).unwrap();
    assert_eq!(conversation["settings"]["system_prompt"], "You are a poet.");
    assert_eq!(conversation["settings"]["sampling"]["temperature"], 0.5);
    assert_eq!(conversation["messages"], json!([]));

    // Without a model a message is refused, and not saved.
    let error = invoke(&window, "delete_conversation", json!({"id": 999})).unwrap_err();
    assert_eq!(
        error,
        json!({"kind": "invalid_input", "message": "Conversation 999 does not exist."})
    );
    invoke(&window, "delete_conversation", json!({"id": first["id"]})).unwrap();
    let all = invoke(&window, "list_conversations", json!({"search": ""})).unwrap();
    assert_eq!(all.as_array().unwrap().len(), 1);
}

#[test]
fn settings_are_validated_saved_and_applied() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (_app, window) = app(data.path());
    let view = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(view["settings"], view["defaults"]);
    assert_eq!(view["total_memory_bytes"], RAM);

    let mut settings = view["settings"].clone();
    settings["block_size"] = json!(48);
    let error = invoke(&window, "save_settings", json!({"settings": settings})).unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("Setting block_size: must be a power of two"),
        "{error}"
    );
    assert!(!data.path().join(Store::SETTINGS_FILE).exists());

    settings["block_size"] = json!(16);
    settings["shortcut"] = json!("Ctrl+Nope");
    let error = invoke(&window, "save_settings", json!({"settings": settings})).unwrap_err();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("\"Ctrl+Nope\" is not valid"),
        "{error}"
    );
    assert!(!data.path().join(Store::SETTINGS_FILE).exists());

    let models = tempfile::tempdir().unwrap();
    settings["shortcut"] = json!("Alt+Shift+P");
    settings["models_dir"] = json!(models.path());
    settings["chat"]["system_prompt"] = json!("Be brief.");
    let saved = invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    assert_eq!(saved["settings"], settings);
    assert_eq!(saved["models_dir"], json!(models.path()));
    // The models list reads the new directory; new conversations start with the new defaults.
    assert_eq!(invoke(&window, "list_models", json!({})), Ok(json!([])));
    let id = invoke(&window, "create_conversation", json!({})).unwrap()["id"].clone();
    let conversation = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(conversation["settings"]["system_prompt"], "Be brief.");

    // A restarted app reads them back.
    let (_app, window) = app(data.path());
    let view = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(view["settings"], settings);
}

#[test]
fn a_damaged_history_is_set_aside_and_reported() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let garbage = b"not a database".repeat(500);
    std::fs::write(data.path().join(Store::HISTORY_FILE), &garbage).unwrap();
    let (_app, window) = app(data.path());
    let notices = invoke(&window, "startup_notices", json!({})).unwrap();
    let notice = notices[0].as_str().unwrap();
    assert!(
        notice.starts_with("Your chat history could not be read"),
        "{notice}"
    );
    let moved = std::fs::read_dir(data.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains(".corrupt-"))
        .expect("the damaged file is kept");
    assert!(notice.contains(&*moved.to_string_lossy()), "{notice}");
    assert!(std::fs::read(&moved).unwrap() == garbage);
    // The new history works.
    invoke(&window, "create_conversation", json!({})).unwrap();
}

/// Collects a channel's messages (a chat's events, a download's progress) as JSON.
fn channel<T: tauri::ipc::IpcResponse>() -> (Channel<T>, mpsc::Receiver<Value>) {
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

/// Runs one turn to its end: the streamed text and the `finished` event.
fn run_turn(app: &tauri::App<MockRuntime>, conversation: i64, turn: Turn) -> (String, Value) {
    let (text, finished, trimmed) = run_turn_trimmed(app, conversation, turn);
    assert_eq!(trimmed, None, "nothing trimmed here");
    (text, finished)
}

/// [`run_turn`], with the messages the `context_trimmed` event said were left out, if it came.
fn run_turn_trimmed(
    app: &tauri::App<MockRuntime>,
    conversation: i64,
    turn: Turn,
) -> (String, Value, Option<u64>) {
    let turn = run_turn_events(app, conversation, turn);
    (turn.text, turn.finished, turn.trimmed)
}

/// What one turn streamed.
struct TurnEvents {
    text: String,
    finished: Value,
    trimmed: Option<u64>,
    /// The `started` event's sampling.
    sampling: Value,
}

/// Runs one turn to its end; `started` must come before any token, `context_trimmed` before it.
fn run_turn_events(app: &tauri::App<MockRuntime>, conversation: i64, turn: Turn) -> TurnEvents {
    let (events, received) = channel::<ChatEvent>();
    chat_commands::start_chat(&app.state(), &app.state(), conversation, turn, events)
        .expect("chat starts");
    let mut text = String::new();
    let mut trimmed = None;
    let mut sampling = None;
    loop {
        let event = received
            .recv_timeout(Duration::from_secs(300))
            .expect("an event");
        match event["event"].as_str() {
            Some("context_trimmed") if sampling.is_none() => {
                trimmed = event["dropped_messages"].as_u64()
            }
            Some("started") if sampling.is_none() => sampling = Some(event["sampling"].clone()),
            Some("token") if sampling.is_some() => text.push_str(event["text"].as_str().unwrap()),
            Some("finished") => {
                return TurnEvents {
                    text,
                    finished: event,
                    trimmed,
                    sampling: sampling.expect("a started event"),
                }
            }
            other => panic!("unexpected event {other:?}"),
        }
    }
}

fn send(content: &str) -> Turn {
    Turn::Send {
        content: content.into(),
        images: Vec::new(),
    }
}

#[test]
fn chat_answers_saves_regenerates_and_stop_cancels() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (first_run, window) = app(data.path());
    // Blocks of 8 tokens, so that the short prompts here fill some (a prefix hit needs one).
    let config = perch_engine::EngineConfig {
        block_size: 8,
        ..Default::default()
    };
    first_run
        .state::<AppState>()
        .load(model_dir(), config)
        .expect("model loads");

    // The reference case with a system prompt: greedy, chat-templated.
    let reference = perch_test_support::reference();
    let case = reference.case("haiku");
    let messages = case.messages.as_ref().expect("a chat");
    let id = invoke(&window, "create_conversation", json!({})).unwrap()["id"].clone();
    let settings = json!({"system_prompt": messages[0].content, "max_tokens": reference.max_tokens,
        "sampling_source": "custom"});
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": settings}),
    )
    .unwrap();
    let id = id.as_i64().unwrap();
    let question = messages[1].content.as_str();
    let turn = run_turn_events(&first_run, id, send(question));
    let (text, finished) = (turn.text, turn.finished);
    assert_eq!(text, case.greedy_text);
    // The conversation's own sampling (greedy), as sent to the engine.
    assert_eq!(turn.sampling["source"], "custom");
    assert_eq!(turn.sampling["params"]["temperature"], 0.0);
    let finish_reason = if case.ends_with_eos { "stop" } else { "length" };
    assert_eq!(finished["finish_reason"], finish_reason);
    assert_eq!(finished["save_error"], Value::Null);
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(saved["messages"][1]["id"], finished["message_id"]);
    assert_eq!(saved["messages"][1]["content"], text.as_str());
    assert_eq!(
        saved["messages"][1]["stats"]["generation_tokens"],
        case.greedy_ids.len()
    );

    // Regenerate replaces the answer (greedy: the same text, now partly from the prefix cache).
    let (again, finished) = run_turn(&first_run, id, Turn::Regenerate);
    assert_eq!(again, text);
    assert!(
        finished["stats"]["cached_prompt_tokens"].as_u64().unwrap() > 0,
        "{finished}"
    );
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(saved["messages"].as_array().unwrap().len(), 2);

    // Stop after the first token: cancelled long before 200 tokens, and what was shown is saved.
    let long = json!({"system_prompt": "", "max_tokens": 200, "sampling_source": "custom"});
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": long}),
    )
    .unwrap();
    let (events, received) = channel();
    let request = chat_commands::start_chat(
        &first_run.state(),
        &first_run.state(),
        id,
        send("Count from 1 to 500."),
        events,
    )
    .unwrap();
    let started = received.recv_timeout(Duration::from_secs(300)).unwrap();
    assert_eq!(started["event"], "started");
    let first = received.recv_timeout(Duration::from_secs(300)).unwrap();
    assert_eq!(first["event"], "token");
    chat_commands::stop(first_run.state(), request).unwrap();
    let mut shown = first["text"].as_str().unwrap().to_owned();
    let finished = loop {
        let event = received.recv_timeout(Duration::from_secs(300)).unwrap();
        match event["event"].as_str() {
            Some("token") => shown.push_str(event["text"].as_str().unwrap()),
            _ => break event,
        }
    };
    assert_eq!(finished["finish_reason"], "cancelled");
    // The stats count what was generated before the stop.
    let generated = finished["stats"]["generation_tokens"].as_u64().unwrap();
    assert!((1..200).contains(&generated), "{finished}");
    assert!(
        finished["stats"]["ttft_s"].as_f64().unwrap() > 0.0,
        "{finished}"
    );
    // The chat runs in the high lane, ahead of background work.
    assert_eq!(finished["stats"]["priority"], "high", "{finished}");

    // A restarted app finds the conversation with the stopped answer.
    drop(first_run);
    let (_app, window) = app(data.path());
    let conversations = invoke(&window, "list_conversations", json!({})).unwrap();
    assert_eq!(conversations[0]["id"], id);
    assert_eq!(conversations[0]["title"], question);
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    let last = &saved["messages"][3];
    assert_eq!(last["content"], shown.as_str());
    assert_eq!(last["finish_reason"], "cancelled");
}

#[test]
fn model_status_reports_load_progress() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    let handle = app.handle().clone();
    let loader = std::thread::spawn(move || {
        handle
            .state::<AppState>()
            .load(model_dir(), Default::default())
    });
    let mut seen = Vec::new();
    loop {
        let status = invoke(&window, "model_status", json!({})).unwrap();
        match status["state"].as_str().unwrap() {
            "loading" => seen.push((
                status["bytes_read"].as_u64().unwrap(),
                status["bytes_total"].as_u64().unwrap(),
            )),
            "loaded" => break,
            "not_loaded" => {}
            other => panic!("{other}: {status}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    loader.join().unwrap().expect("model loads");
    let weights = std::fs::metadata(model_dir().join("model.safetensors"))
        .unwrap()
        .len();
    let with_total: Vec<_> = seen.iter().filter(|(_, total)| *total > 0).collect();
    assert!(!with_total.is_empty(), "no progress seen: {seen:?}");
    assert!(with_total
        .iter()
        .all(|(read, total)| *total == weights && read <= total));
    assert!(
        with_total.windows(2).all(|w| w[0].0 <= w[1].0),
        "progress went back: {with_total:?}"
    );
}

#[test]
fn search_download_cancel_and_load_from_the_hub() {
    use perch_hub::fake_hub::{FakeHub, FakeRepo};
    const REPO: &str = "mlx-community/SmolLM2-135M-Instruct-4bit";
    let _turn = serial();
    let root = tempfile::tempdir().unwrap();
    let mut repo = FakeRepo::from_dir(REPO, &model_dir()).unwrap();
    repo.safetensors_parameters = [("U32".to_owned(), 1 << 30)].into(); // 4 GiB of weights
    let commit = repo.commit.clone();
    let hub = FakeHub::start(vec![repo]);
    std::env::set_var("HF_ENDPOINT", hub.url());
    std::env::set_var("HF_HUB_CACHE", root.path().join("hub"));
    std::env::set_var("PERCH_MODELS_DIR", root.path().join("models"));
    std::env::remove_var("HF_TOKEN");
    let (app, window) = app(root.path());

    // 16 GiB of RAM: 12 GiB usable, so 4 GiB of weights and the default 2 GiB KV budget fit.
    let found = invoke(&window, "search_models", json!({"text": "smollm"})).unwrap();
    assert_eq!(found.as_array().unwrap().len(), 1, "{found}");
    assert_eq!(found[0]["id"], REPO);
    assert_eq!(found[0]["weights_bytes"], 4u64 << 30);
    assert_eq!(found[0]["model_type"], "llama");
    assert_eq!(found[0]["architecture_note"], Value::Null);
    assert_eq!(
        (&found[0]["fit"], &found[0]["snapshot_dir"]),
        (&json!("fits"), &Value::Null)
    );
    // From its config.json: 46,080 bytes per token (float32 on CPU), so the 2 GiB budget holds
    // its whole 8,192-token context.
    assert_eq!(found[0]["context_tokens"], 8192, "{found}");

    // Cancelled mid-file: the command fails with a sentence, and nothing is listed yet.
    hub.configure(|b| b.chunk_delay = Duration::from_millis(20));
    let download = |progress: Channel<perch_hub::DownloadProgress>| {
        let handle = app.handle().clone();
        std::thread::spawn(move || {
            tauri::async_runtime::block_on(hub_commands::download_model(
                handle,
                REPO.to_owned(),
                None,
                progress,
            ))
        })
    };
    let (progress, reports) = channel();
    let running = download(progress);
    let first = reports
        .recv_timeout(Duration::from_secs(60))
        .expect("progress");
    assert_eq!(first["repo_id"], REPO);
    let twice = tauri::async_runtime::block_on(hub_commands::download_model(
        app.handle().clone(),
        REPO.to_owned(),
        None,
        channel().0,
    ));
    assert!(twice.unwrap_err().message.contains("already downloading"));
    while reports
        .recv_timeout(Duration::from_secs(60))
        .expect("progress")["file"]
        != "model.safetensors"
    {}
    assert_eq!(
        invoke(&window, "cancel_download", json!({"repoId": REPO})),
        Ok(json!(true))
    );
    let error = running.join().unwrap().unwrap_err().message;
    assert!(
        error.contains("cancelled") && error.ends_with('.'),
        "{error}"
    );
    assert_eq!(invoke(&window, "list_models", json!({})), Ok(json!([])));
    assert_eq!(
        invoke(&window, "cancel_download", json!({"repoId": REPO})),
        Ok(json!(false))
    );
    // Listed as stopped, with what it fetched, until it resumes.
    let stopped = invoke(&window, "partial_downloads", json!({})).unwrap();
    assert_eq!(stopped.as_array().unwrap().len(), 1, "{stopped}");
    assert_eq!(
        (&stopped[0]["repo_id"], &stopped[0]["has_snapshot"]),
        (&json!(REPO), &json!(false))
    );
    assert_eq!(
        stopped[0]["revision"], "main",
        "the revision it asked for: {stopped}"
    );
    assert!(
        stopped[0]["bytes_present"].as_u64().unwrap() > 0,
        "{stopped}"
    );

    // Again at full speed: it resumes, and the model is listed and loads under its id.
    hub.configure(|b| b.chunk_delay = Duration::ZERO);
    let (progress, reports) = channel();
    let done = download(progress).join().unwrap().expect("download");
    let last = reports.try_iter().last().expect("progress");
    assert_eq!(last["bytes_done"], last["bytes_total"]);
    let resumed = hub.file_requests("model.safetensors").pop().unwrap();
    assert!(
        resumed.range.as_deref().is_some_and(|r| r != "bytes=0-"),
        "{resumed:?}"
    );
    assert_eq!(
        invoke(&window, "partial_downloads", json!({})),
        Ok(json!([]))
    );
    // A revision by its commit is the same snapshot, nothing fetched again; an unknown one is a
    // sentence.
    let at_commit = tauri::async_runtime::block_on(hub_commands::download_model(
        app.handle().clone(),
        REPO.to_owned(),
        Some(commit.clone()),
        channel().0,
    ))
    .expect("download at a commit");
    assert_eq!(at_commit.snapshot_dir, done.snapshot_dir);
    assert!(at_commit.snapshot_dir.ends_with(&commit));
    assert_eq!(at_commit.bytes_fetched, 0);
    let no_such = tauri::async_runtime::block_on(hub_commands::download_model(
        app.handle().clone(),
        REPO.to_owned(),
        Some("v9".into()),
        channel().0,
    ))
    .unwrap_err()
    .message;
    assert!(no_such.ends_with('.'), "{no_such}");

    // A stopped download given up: its partial files go, and a second discard is a sentence.
    let other = root.path().join("hub/models--org--stopped/blobs");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("abc.incomplete"), [0u8; 100]).unwrap();
    assert_eq!(
        invoke(
            &window,
            "discard_partial_download",
            json!({"repoId": "org/stopped"})
        ),
        Ok(json!(100))
    );
    let again = invoke(
        &window,
        "discard_partial_download",
        json!({"repoId": "org/stopped"}),
    )
    .unwrap_err();
    assert!(
        again["message"]
            .as_str()
            .is_some_and(|m| m.contains("no stopped download")),
        "{again}"
    );
    let models = invoke(&window, "list_models", json!({})).unwrap();
    assert_eq!(models[0]["name"], REPO, "{models}");
    assert_eq!(models[0]["path"], json!(done.snapshot_dir));
    let found = invoke(&window, "search_models", json!({"text": "smollm"})).unwrap();
    assert_eq!(found[0]["snapshot_dir"], json!(done.snapshot_dir));
    let status = invoke(&window, "load_model", json!({"path": done.snapshot_dir})).unwrap();
    assert_eq!(
        (&status["state"], &status["name"]),
        (&json!("loaded"), &json!(REPO)),
        "{status}"
    );
    invoke(&window, "unload_model", json!({})).unwrap();

    // An unknown repository is one sentence.
    let unknown = tauri::async_runtime::block_on(hub_commands::download_model(
        app.handle().clone(),
        "mlx-community/Missing".into(),
        None,
        channel().0,
    ))
    .unwrap_err();
    assert_eq!(unknown.kind, CommandErrorKind::Network);
    let unknown = unknown.message;
    assert!(
        unknown.contains("no such repository") && unknown.ends_with('.'),
        "{unknown}"
    );
    std::env::remove_var("HF_ENDPOINT");
}

#[test]
fn the_local_server_follows_its_settings_and_the_loaded_model() {
    use perch_test_support::http;
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (_app, window) = app(data.path());
    let status = || invoke(&window, "server_status", json!({})).unwrap();
    assert_eq!(status()["running"], false, "off by default");

    // On, on a free port, with a key.
    let mut settings = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    settings["server"] = json!({"enabled": true, "port": 0, "api_key": "k-1", "allow_lan": false,
        "any_model_name": true, "model_aliases": ["gpt-4o"]});
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    let on = status();
    assert_eq!(
        (on["running"].clone(), on["api_key"].clone()),
        (json!(true), json!(true))
    );
    let url = on["url"].as_str().unwrap().to_owned();
    let addr = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|rest| rest.strip_suffix("/v1"))
        .map(|port| format!("127.0.0.1:{port}"))
        .unwrap_or_else(|| panic!("served on 127.0.0.1 only: {url}"));
    let key = [
        ("Authorization", "Bearer k-1"),
        ("Content-Type", "application/json"),
    ];
    let chat = json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]});

    // No model yet: nothing listed, requests get 503.
    let (code, _, body) = http(&addr, "GET", "/v1/models", &key, "");
    assert_eq!(
        (
            code,
            serde_json::from_str::<Value>(&body).unwrap()["data"].clone()
        ),
        (200, json!([]))
    );
    let (code, _, body) = http(
        &addr,
        "POST",
        "/v1/chat/completions",
        &key,
        &chat.to_string(),
    );
    assert_eq!(code, 503, "{body}");

    // The app loads a model: the server serves it, under the name the app shows.
    let loaded = invoke(&window, "load_model", json!({"path": model_dir()})).unwrap();
    let name = loaded["name"].as_str().unwrap().to_owned();
    let (_, _, body) = http(&addr, "GET", "/v1/models", &key, "");
    let listed: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed["data"][0]["id"], name.as_str(), "{body}");
    // The other names of the settings are listed after it.
    assert_eq!(listed["data"][1]["id"], "gpt-4o", "{body}");
    let chat = json!({"model": name, "max_tokens": 3, "temperature": 0,
        "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let (code, _, body) = http(&addr, "POST", "/v1/chat/completions", &key, &chat);
    assert_eq!(code, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 3, "{body}");
    let counted = status();
    assert_eq!(
        (counted["served"].clone(), counted["requests"].clone()),
        (json!(1), json!(0)),
        "the dashboard counts the request that reached the engine, none live now"
    );
    let (code, _, _) = http(&addr, "POST", "/v1/chat/completions", &key[1..], &chat);
    assert_eq!(code, 401, "the key is required");
    // Any model name is the loaded model (the setting is on): an agent's own name is answered.
    let agent = json!({"model": "claude-sonnet-4-5", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    .to_string();
    let (code, _, body) = http(&addr, "POST", "/v1/messages", &key, &agent);
    assert_eq!(code, 200, "{body}");

    // A port already taken: a clear error, and the running server and saved settings stay.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut busy = settings.clone();
    busy["server"]["port"] = json!(port);
    let error = invoke(&window, "save_settings", json!({"settings": busy})).unwrap_err();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains(&format!("port {port}")),
        "{error}"
    );
    assert_eq!(status()["url"], url.as_str());
    let view = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(view["settings"]["server"], settings["server"]);

    // Off: the port closes.
    settings["server"]["enabled"] = json!(false);
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    assert_eq!(
        status(),
        json!({"running": false, "url": null, "requests": 0, "served": 0,
        "api_key": false, "allow_lan": false})
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "{addr} still accepts connections"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    invoke(&window, "unload_model", json!({})).unwrap();
}

/// A conversation with `max_tokens`, no system prompt and greedy sampling, through IPC; its id.
fn conversation_with(window: &WebviewWindow<MockRuntime>, max_tokens: usize) -> i64 {
    let id = invoke(window, "create_conversation", json!({})).unwrap()["id"].clone();
    let settings =
        json!({"system_prompt": "", "max_tokens": max_tokens, "sampling_source": "custom"});
    invoke(
        window,
        "set_conversation_settings",
        json!({"id": id, "settings": settings}),
    )
    .unwrap();
    id.as_i64().unwrap()
}

#[test]
fn engine_stats_and_stop_answer_while_a_step_is_slow() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    let step = Duration::from_millis(1500);
    let config = perch_engine::EngineConfig {
        fault_injection: perch_engine::FaultInjection {
            step_delay: step,
            panic_at_step: None,
        },
        ..Default::default()
    };
    app.state::<AppState>().load(model_dir(), config).unwrap();
    let id = conversation_with(&window, 50);
    let (events, received) = channel::<ChatEvent>();
    let request =
        chat_commands::start_chat(&app.state(), &app.state(), id, send("Hello!"), events).unwrap();
    // The engine is in its first 1.5 s step now.
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let stats = invoke(&window, "engine_stats", json!({})).unwrap();
    let stats_took = started.elapsed();
    let started = std::time::Instant::now();
    chat_commands::stop(app.state(), request).unwrap();
    let stop_took = started.elapsed();
    assert!(
        stats_took < Duration::from_millis(500) && stop_took < Duration::from_millis(500),
        "engine_stats took {stats_took:?}, stop {stop_took:?} during a {step:?} step"
    );
    // The request is in the engine (admitted at the slow step's start, or waiting for it).
    assert_eq!(
        stats["running"].as_u64().unwrap() + stats["waiting"].as_u64().unwrap(),
        1,
        "{stats}"
    );
    let finished = loop {
        let event = received.recv_timeout(Duration::from_secs(60)).unwrap();
        if event["event"] == "finished" {
            break event;
        }
    };
    assert_eq!(finished["finish_reason"], "cancelled");
}

#[test]
fn an_engine_failure_mid_answer_is_saved_as_an_error_and_the_next_turn_works() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    let config = perch_engine::EngineConfig {
        fault_injection: perch_engine::FaultInjection {
            step_delay: Duration::ZERO,
            panic_at_step: Some(4),
        },
        ..Default::default()
    };
    app.state::<AppState>().load(model_dir(), config).unwrap();
    // 8 tokens take 8 steps at least (one a step): the panic at step 4 lands mid-answer.
    let id = conversation_with(&window, 8);
    let (text, finished) = run_turn(&app, id, send("Count from 1 to 100."));
    assert_eq!(finished["finish_reason"], "error", "{finished}");
    let error = finished["error"].as_str().expect("an error sentence");
    assert!(
        error.starts_with("The engine failed") && error.ends_with('.'),
        "{error}"
    );
    assert!(!text.is_empty(), "tokens came before the failure");
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(saved["messages"][1]["content"], text.as_str());
    assert_eq!(saved["messages"][1]["finish_reason"], "error");
    assert_eq!(saved["messages"][1]["error"], error);
    // The same model answers the next turn.
    let (_, finished) = run_turn(&app, id, Turn::Regenerate);
    assert_ne!(finished["finish_reason"], "error", "{finished}");
}

#[test]
fn a_conversation_longer_than_the_context_drops_its_oldest_turns() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    // A KV cache of a few hundred tokens: a handful of turns fill it.
    let config = perch_engine::EngineConfig {
        kv_cache_bytes: 12 << 20,
        block_size: 8,
        ..Default::default()
    };
    let state = app.state::<AppState>();
    state.load(model_dir(), config).unwrap();
    let limits = state.engine().unwrap().limits();
    assert!(limits.kv_cache_tokens < 1000, "{limits:?}");
    let id = conversation_with(&window, 16);
    let question = "Please tell me, in a few words, what colour the sky is on a clear summer day \
                    at noon, and why it looks that way to people standing on the ground.";
    let mut turns = 0;
    let dropped = loop {
        turns += 1;
        assert!(turns <= 40, "the context never filled");
        let (_, finished, trimmed) = run_turn_trimmed(&app, id, send(question));
        assert_ne!(
            finished["finish_reason"], "error",
            "turn {turns}: {finished}"
        );
        if let Some(dropped) = trimmed {
            break dropped;
        }
    };
    assert!(turns > 1 && dropped >= 2 && dropped % 2 == 0, "{dropped}");
    // The history keeps every message; only the prompt left the oldest out.
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(saved["messages"].as_array().unwrap().len(), 2 * turns);
    // Later turns keep working.
    let (_, finished, trimmed) = run_turn_trimmed(&app, id, send(question));
    assert_ne!(finished["finish_reason"], "error", "{finished}");
    assert!(trimmed.is_some());
}

/// A copy of the test model (links to its files) whose `generation_config.json` has `extra`.
fn model_with_generation_config(dir: &Path, extra: Value) -> PathBuf {
    let copy = dir.join("model");
    std::fs::create_dir(&copy).unwrap();
    for entry in std::fs::read_dir(model_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "generation_config.json" {
            std::os::unix::fs::symlink(entry.path(), copy.join(entry.file_name())).unwrap();
        }
    }
    let original = model_dir().join("generation_config.json");
    let mut config: Value = if original.is_file() {
        serde_json::from_slice(&std::fs::read(original).unwrap()).unwrap()
    } else {
        json!({})
    };
    for (key, value) in extra.as_object().unwrap() {
        config[key] = value.clone();
    }
    std::fs::write(copy.join("generation_config.json"), config.to_string()).unwrap();
    copy
}

#[test]
fn a_fresh_install_samples_with_the_model_s_defaults_and_says_where_they_came_from() {
    use perch_engine::sample::generation_config as defaults;
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    // The test model's generation_config.json names no sampling: Perch's defaults.
    let status = app
        .state::<AppState>()
        .load(model_dir(), Default::default())
        .unwrap();
    let status = serde_json::to_value(status).unwrap();
    assert_eq!(status["sampling_defaults"]["source"], "perch", "{status}");
    let id = invoke(&window, "create_conversation", json!({})).unwrap()["id"]
        .as_i64()
        .unwrap();
    let conversation = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(conversation["settings"]["sampling_source"], "model");
    // Short answers (sampled answers rarely stop early): the sampling is what is checked.
    let mut short = conversation["settings"].clone();
    short["max_tokens"] = json!(4);
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": short}),
    )
    .unwrap();
    let turn = run_turn_events(&app, id, send("Write a short poem about the sea."));
    assert_ne!(turn.finished["finish_reason"], "error", "{}", turn.finished);
    let sampling = &turn.sampling;
    assert_eq!(sampling["source"], "perch", "{sampling}");
    let params = &sampling["params"];
    for (field, value) in [
        ("temperature", defaults::PERCH_TEMPERATURE as f64),
        ("top_p", defaults::PERCH_TOP_P as f64),
        ("top_k", defaults::PERCH_TOP_K as f64),
        ("min_p", defaults::PERCH_MIN_P as f64),
        (
            "repetition_penalty",
            defaults::PERCH_REPETITION_PENALTY as f64,
        ),
    ] {
        assert!(
            (params[field].as_f64().unwrap() - value).abs() < 1e-6,
            "{field}: {params}"
        );
    }
    // Chats are not greedy (the point of the defaults): the first answer carried a temperature.
    assert!(params["temperature"].as_f64().unwrap() > 0.0, "{params}");
    // The answer keeps the sampling it was generated with.
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(&saved["messages"][1]["sampling"], sampling);

    // A model that names its sampling in generation_config.json (Qwen3's values).
    let model = model_with_generation_config(
        data.path(),
        json!({"do_sample": true, "temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    );
    let status = app
        .state::<AppState>()
        .load(model.clone(), Default::default())
        .unwrap();
    let status = serde_json::to_value(status).unwrap();
    assert_eq!(status["sampling_defaults"]["source"], "model", "{status}");
    // The same conversation follows the model it now talks to.
    let turn = run_turn_events(&app, id, send("And one about the mountains."));
    assert_eq!(turn.sampling["source"], "model");
    let params = &turn.sampling["params"];
    assert!(
        (params["temperature"].as_f64().unwrap() - 0.6).abs() < 1e-6,
        "{params}"
    );
    assert_eq!(params["top_k"], 20);
    assert_eq!(params["min_p"], 0.0);
    assert_eq!(params["repetition_penalty"], 0.0);

    // Custom values are sent as they are; the seed is kept either way.
    let mut settings = saved["settings"].clone();
    settings["sampling_source"] = json!("custom");
    settings["sampling"]["temperature"] = json!(0.25);
    settings["sampling"]["seed"] = json!(7);
    settings["sampling"]["xtc_probability"] = json!(0.5);
    settings["sampling"]["presence_penalty"] = json!(0.25);
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": settings}),
    )
    .unwrap();
    let turn = run_turn_events(&app, id, Turn::Regenerate);
    assert_eq!(turn.sampling["source"], "custom");
    assert_eq!(turn.sampling["params"]["temperature"], 0.25);
    assert_eq!(turn.sampling["params"]["seed"], 7);
    assert_eq!(turn.sampling["params"]["xtc_probability"], 0.5);
    assert_eq!(turn.sampling["params"]["xtc_threshold"], 0.1);
    assert_eq!(turn.sampling["params"]["presence_penalty"], 0.25);
    // Out of range: refused with the parameter's name, nothing saved.
    settings["sampling"]["xtc_threshold"] = json!(0.9);
    let refused = invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": settings}),
    )
    .unwrap_err();
    assert!(refused.to_string().contains("xtc_threshold"), "{refused}");
    invoke(&window, "unload_model", json!({})).unwrap();
}

fn engine_threads() -> usize {
    perch_engine::engine::live_engines()
}

#[test]
fn model_loads_run_one_at_a_time_and_the_last_one_wins() {
    let _turn = serial();
    // Engines of earlier tests in this process (their apps are not all dropped) are the
    // baseline, once their number has settled.
    let mut before = engine_threads();
    let mut settled = std::time::Instant::now();
    while settled.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(20));
        let now = engine_threads();
        if now != before {
            (before, settled) = (now, std::time::Instant::now());
        }
    }
    let data = tempfile::tempdir().unwrap();
    let (app, _window) = app(data.path());
    let state = app.state::<AppState>();
    // A watcher counts engine threads while four loads race.
    let done = std::sync::atomic::AtomicBool::new(false);
    let most = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| {
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(engine_threads());
                std::thread::sleep(Duration::from_millis(1));
            }
            most
        });
        let loads: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| state.load(model_dir(), Default::default())))
            .collect();
        for load in loads {
            load.join().unwrap().expect("each load succeeds");
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        watcher.join().unwrap()
    });
    assert_eq!(most, before + 1, "two models were resident at once");
    assert_eq!(engine_threads(), before + 1);
    // The app and the local server see the same engine.
    let engine = state.engine().unwrap();
    let served = state.served().current().expect("served").engine;
    assert!(std::sync::Arc::ptr_eq(
        engine.tokenizer(),
        served.tokenizer()
    ));
    state.unload().unwrap();
    let waited = std::time::Instant::now();
    while engine_threads() > before {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "unload left the engine"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn without_a_display_the_app_says_so_and_exits() {
    let data = tempfile::tempdir().unwrap();
    let run = |display: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_perch-app"));
        command
            .env_remove("DISPLAY")
            .env_remove("WAYLAND_DISPLAY")
            .env("PERCH_DATA_DIR", data.path())
            .env("PERCH_MODELS_DIR", data.path().join("models"));
        if let Some(display) = display {
            command.env("DISPLAY", display);
        }
        let output = command.output().unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    // No display variable at all; then a display that is not there (GTK fails to open it).
    for (display, says) in [
        (None, "needs a graphical session"),
        (Some(":97"), "could not open a window"),
    ] {
        let (status, stderr) = run(display);
        assert_eq!(status.code(), Some(1), "{display:?}: {stderr}");
        assert!(stderr.contains(says), "{display:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{display:?}: {stderr}");
    }
}

/// Speculative decoding from Settings: a draft model (here the model itself, by directory) is
/// loaded with the next model and chats use it (the answer's stats count its proposals, the
/// saved answer keeps them); a draft that is not a model fails the load with a sentence, and the
/// number of draft tokens is checked.
#[test]
fn a_draft_model_in_settings_drafts_for_chats() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    let mut settings = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    assert_eq!(settings["draft_model"], Value::Null);
    settings["num_draft_tokens"] = json!(0);
    let error = invoke(&window, "save_settings", json!({"settings": settings})).unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("num_draft_tokens"),
        "{error}"
    );

    settings["num_draft_tokens"] = json!(2);
    settings["draft_model"] = json!("/nonexistent/draft");
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    let error = invoke(&window, "load_model", json!({"path": model_dir()})).unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("draft model /nonexistent/draft"),
        "{error}"
    );

    settings["draft_model"] = json!(model_dir());
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    invoke(&window, "load_model", json!({"path": model_dir()})).unwrap();
    // 6 tokens: the first from the prefill, then verify steps of 2 proposals each.
    let id = conversation_with(&window, 6);
    let (text, finished) = run_turn(&app, id, send("Name three colours."));
    assert!(!text.is_empty());
    let stats = &finished["stats"];
    assert!(stats["draft_tokens"].as_u64().unwrap() > 0, "{stats}");
    assert!(
        stats["accepted_draft_tokens"].as_u64().unwrap() > 0,
        "{stats}"
    );
    let saved = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(
        saved["messages"][1]["stats"]["draft_tokens"],
        stats["draft_tokens"]
    );

    // A conversation's own KV cache options: checked, and a bounded cache answers without
    // the draft (it cannot be rewound).
    let mut conversation = saved["settings"].clone();
    conversation["kv_bits"] = json!(7);
    let error = invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": conversation}),
    )
    .unwrap_err();
    assert_eq!(error["kind"], "invalid_input", "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("chat.kv_bits"),
        "{error}"
    );
    conversation["kv_bits"] = Value::Null;
    conversation["max_kv_size"] = json!(8);
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": conversation}),
    )
    .unwrap();
    let (text, finished) = run_turn(&app, id, send("And three animals?"));
    assert!(!text.is_empty());
    assert_eq!(finished["stats"]["draft_tokens"], 0);
    assert_eq!(finished["finish_reason"], "length");
}

/// The tray's actions without a tray: the models it offers to switch to (those Perch runs, the
/// loaded one marked) and the local server's switch (saved in the settings, as Settings would).
#[test]
fn the_trays_model_list_and_server_switch() {
    use perch_app::commands::model::switchable_models;
    use perch_app::commands::settings::set_server_enabled;
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let models = data.path().join("models");
    std::fs::create_dir_all(models.join("mamba")).unwrap();
    std::fs::write(
        models.join("mamba/config.json"),
        r#"{"model_type": "mamba"}"#,
    )
    .unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(model_dir(), models.join("test-model")).unwrap();
    std::env::set_var("PERCH_MODELS_DIR", &models);
    std::env::set_var("HF_HUB_CACHE", data.path().join("hub"));
    let (app, window) = app(data.path());
    let handle = app.handle().clone();
    let offered = switchable_models(&handle, 12).unwrap();
    assert_eq!(
        offered,
        vec![("test-model".into(), models.join("test-model"), false)]
    );
    invoke(
        &window,
        "load_model",
        json!({"path": models.join("test-model")}),
    )
    .unwrap();
    let offered = switchable_models(&handle, 12).unwrap();
    assert!(offered[0].2, "the loaded model is marked: {offered:?}");
    assert!(switchable_models(&handle, 0).unwrap().is_empty());
    invoke(&window, "unload_model", json!({})).unwrap();

    let mut settings = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    settings["server"] = json!({"enabled": false, "port": 0, "api_key": null, "allow_lan": false,
        "any_model_name": false, "model_aliases": []});
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    set_server_enabled(&handle, true).unwrap();
    assert_eq!(
        invoke(&window, "server_status", json!({})).unwrap()["running"],
        true
    );
    let saved = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(saved["settings"]["server"]["enabled"], true);
    set_server_enabled(&handle, false).unwrap();
    assert_eq!(
        invoke(&window, "server_status", json!({})).unwrap()["running"],
        false
    );
    std::env::remove_var("PERCH_MODELS_DIR");
}

/// The first run is remembered in the settings: `finish_first_run` sets it, and a settings form
/// read before it (saved with `false`) does not bring the first run back.
#[test]
fn the_first_run_is_remembered_in_the_settings() {
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (_app, window) = app(data.path());
    let before = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    assert_eq!(before["first_run_done"], false);
    invoke(&window, "finish_first_run", json!({})).unwrap();
    let done = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(done["settings"]["first_run_done"], true);
    invoke(&window, "save_settings", json!({"settings": before})).unwrap();
    let kept = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(kept["settings"]["first_run_done"], true);
    // Saved on disk: a new app over the same data directory knows it.
    drop(window);
    let (_app, window) = app(data.path());
    let reopened = invoke(&window, "get_settings", json!({})).unwrap();
    assert_eq!(reopened["settings"]["first_run_done"], true);
}

/// The idle-unload setting: checked on save (a minute at least), given to the engine as its
/// keep-alive at the next load, and the engine's residency shown in its stats.
#[test]
fn the_idle_unload_setting_reaches_the_engine() {
    use tauri::Manager;
    let _turn = serial();
    let data = tempfile::tempdir().unwrap();
    let (app, window) = app(data.path());
    let mut settings = invoke(&window, "get_settings", json!({})).unwrap()["settings"].clone();
    assert_eq!(
        settings["unload_after_idle_secs"],
        json!(3600),
        "an hour by default"
    );
    settings["unload_after_idle_secs"] = json!(30);
    let error = invoke(&window, "save_settings", json!({"settings": settings})).unwrap_err();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("unload_after_idle_secs"),
        "{error}"
    );
    settings["unload_after_idle_secs"] = json!(120);
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    let config = app.state::<Store>().engine_config().unwrap();
    assert_eq!(
        config.keep_alive,
        perch_engine::KeepAlive::Idle(std::time::Duration::from_secs(120))
    );
    settings["unload_after_idle_secs"] = Value::Null;
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    let config = app.state::<Store>().engine_config().unwrap();
    assert_eq!(config.keep_alive, perch_engine::KeepAlive::Forever);
    // Prompt lookup: off by default, its engine defaults when on.
    assert_eq!(config.prompt_lookup, None);
    settings["prompt_lookup"] = json!(true);
    invoke(&window, "save_settings", json!({"settings": settings})).unwrap();
    let config = app.state::<Store>().engine_config().unwrap();
    assert_eq!(
        config.prompt_lookup,
        Some(perch_engine::PromptLookup::default())
    );
    invoke(&window, "load_model", json!({"path": model_dir()})).unwrap();
    let stats = invoke(&window, "engine_stats", json!({})).unwrap();
    assert_eq!(stats["residency"], json!({"state": "loaded"}), "{stats}");
    invoke(&window, "unload_model", json!({})).unwrap();
}

/// A chat turn with an image on a model that sees images (a tiny random Gemma 3 with its vision
/// tower, written by mlx-vlm: perch-engine's `tests/oracle/tiny_vision.py`): answered, saved with
/// its image, and the conversation read back with it; the same turn on the text-only default
/// model is refused before anything is saved, in one sentence.
#[test]
fn a_turn_with_an_image_is_answered_and_kept_with_its_image() {
    let _turn = serial();
    let models = tempfile::tempdir().unwrap();
    let script = format!(
        "{}/../crates/perch-engine/tests/oracle/tiny_vision.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let status = std::process::Command::new(perch_test_support::oracle_python())
        .arg(script)
        .arg(models.path())
        .arg(model_dir())
        .status()
        .unwrap();
    assert!(status.success(), "tiny_vision.py failed");
    let png = std::fs::read(models.path().join("gemma3-image.png")).unwrap();
    let data = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(&png)
    };
    let turn = || Turn::Send {
        content: "What is this?".into(),
        images: vec![perch_store::Attachment {
            media_type: "image/png".into(),
            data: data.clone(),
        }],
    };

    let data_dir = tempfile::tempdir().unwrap();
    let (app, window) = app(data_dir.path());
    app.state::<AppState>()
        .load(
            models.path().join("gemma3"),
            perch_engine::EngineConfig::default(),
        )
        .expect("the vision model loads");
    let status = invoke(&window, "model_status", json!({})).unwrap();
    assert_eq!(status["vision"], true);
    let id = invoke(&window, "create_conversation", json!({})).unwrap()["id"]
        .as_i64()
        .unwrap();
    let settings = json!({"max_tokens": 5, "sampling_source": "custom"});
    invoke(
        &window,
        "set_conversation_settings",
        json!({"id": id, "settings": settings}),
    )
    .unwrap();
    let (_, finished) = run_turn(&app, id, turn());
    assert_eq!(finished["finish_reason"], "length", "{finished}");
    assert!(
        finished["stats"]["prompt_tokens"].as_u64().unwrap() > 16,
        "the image's 16 tokens"
    );
    let conversation = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    let messages = conversation["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(
        messages[0]["images"],
        json!([format!("data:image/png;base64,{data}")])
    );
    assert_eq!(messages[1]["role"], "assistant");
    // Regenerating reads the saved image again.
    let (_, again) = run_turn(&app, id, Turn::Regenerate);
    assert_eq!(
        again["stats"]["prompt_tokens"],
        finished["stats"]["prompt_tokens"]
    );

    // The text-only default model: refused before the message is saved.
    app.state::<AppState>()
        .load(model_dir(), perch_engine::EngineConfig::default())
        .expect("the default model loads");
    let id = invoke(&window, "create_conversation", json!({})).unwrap()["id"]
        .as_i64()
        .unwrap();
    let (events, _) = channel::<ChatEvent>();
    let refused = chat_commands::start_chat(&app.state(), &app.state(), id, turn(), events)
        .expect_err("refused");
    assert!(
        refused.message.contains("takes no images"),
        "{}",
        refused.message
    );
    let conversation = invoke(&window, "get_conversation", json!({"id": id})).unwrap();
    assert_eq!(conversation["messages"], json!([]));
}
