//! Conversations and chat: the history's commands, and `chat`, which answers a turn of a
//! conversation through the engine, streams the tokens to the UI and saves the answer before it
//! reports it finished (so nothing shown as finished is lost, even to `kill -9`).

use super::CommandError;
use perch_engine::{
    ChatMessage, EngineEvent, EngineRequest, FinishReason, GenerateRequest, GenerationStats, Prompt,
};
use perch_store::{
    AnswerSampling, Conversation, ConversationSettings, ConversationSummary, History, HistoryError,
    Turn,
};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::{AppHandle, Manager, Runtime, State};

use super::model::AppState;
use super::{off_main_thread, sentence};
use crate::store::Store;

/// The app's chat as a client of the engine ([`perch_engine::GenerateRequest::client`]).
pub const APP_CLIENT: &str = "Perch chat";

/// Conversations, most recently active first; a non-empty `search` keeps those whose title or
/// messages contain it.
#[tauri::command]
pub async fn list_conversations<R: Runtime>(
    app: AppHandle<R>,
    search: Option<String>,
) -> Result<Vec<ConversationSummary>, CommandError> {
    with_history(app, move |history| {
        history.conversations(search.as_deref().unwrap_or(""))
    })
    .await
}

/// Starts an empty conversation with the settings' defaults (system prompt, sampling).
#[tauri::command]
pub async fn create_conversation<R: Runtime>(
    app: AppHandle<R>,
) -> Result<ConversationSummary, CommandError> {
    let defaults = app.state::<Store>().settings()?.chat;
    with_history(app, move |history| history.create_conversation(&defaults)).await
}

#[tauri::command]
pub async fn get_conversation<R: Runtime>(
    app: AppHandle<R>,
    id: i64,
) -> Result<Conversation, CommandError> {
    with_history(app, move |history| history.conversation(id)).await
}

/// Renames conversation `id`; an empty title goes back to its first message.
#[tauri::command]
pub async fn rename_conversation<R: Runtime>(
    app: AppHandle<R>,
    id: i64,
    title: String,
) -> Result<ConversationSummary, CommandError> {
    with_history(app, move |history| history.rename(id, &title)).await
}

#[tauri::command]
pub async fn delete_conversation<R: Runtime>(
    app: AppHandle<R>,
    id: i64,
) -> Result<(), CommandError> {
    with_history(app, move |history| history.delete(id)).await
}

/// Sets conversation `id`'s system prompt and sampling (validated) for its next answers.
#[tauri::command]
pub async fn set_conversation_settings<R: Runtime>(
    app: AppHandle<R>,
    id: i64,
    settings: ConversationSettings,
) -> Result<(), CommandError> {
    settings.validate().map_err(|e| CommandError::invalid(&e))?;
    with_history(app, move |history| history.set_settings(id, &settings)).await
}

/// Runs `work` on the history off the main thread (SQLite reads and fsync'd writes).
async fn with_history<R: Runtime, T: Send + 'static>(
    app: AppHandle<R>,
    work: impl FnOnce(&mut History) -> Result<T, HistoryError> + Send + 'static,
) -> Result<T, CommandError> {
    off_main_thread(app, move |app| {
        work(&mut *app.state::<Store>().history()?).map_err(|e| history_error(&e))
    })
    .await
}

/// A history error's kind: what the user asked for does not exist or is empty, or the history's
/// file failed.
fn history_error(err: &HistoryError) -> CommandError {
    match err {
        HistoryError::NoSuchConversation(_)
        | HistoryError::EmptyMessage
        | HistoryError::BadImage(_)
        | HistoryError::NoUserMessage => CommandError::invalid(err),
        _ => CommandError::storage(err),
    }
}

/// What a chat request streams to the UI.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ChatEvent {
    /// Sent when the request is in the engine, before any token (after `ContextTrimmed`): the
    /// sampling the answer is generated with, as submitted to the engine, and
    /// where its values come from (the model's defaults, Perch's, or the conversation's own).
    Started { sampling: AnswerSampling },
    /// Sent first when the conversation is longer than the model's context: the oldest
    /// `dropped_messages` messages (whole turns; the system prompt stays) are left out of this
    /// answer's prompt. The history keeps them.
    ContextTrimmed { dropped_messages: usize },
    /// Text the next token completes (may be empty).
    Token { text: String },
    /// The answer ended. It is in the history when this is sent (`message_id`), unless saving
    /// failed (`save_error`).
    Finished {
        finish_reason: FinishReason,
        stats: GenerationStats,
        /// Why generation failed, when `finish_reason` is `error`.
        error: Option<String>,
        message_id: Option<i64>,
        save_error: Option<String>,
    },
}

/// Applies `turn` (send, regenerate, edit the last user message) to conversation
/// `conversation_id` and answers it with the conversation's settings; tokens stream to
/// `on_event`. Returns the request id, for [`stop`]. Runs off the main thread (see
/// [`start_chat`]).
#[tauri::command]
pub async fn chat<R: Runtime>(
    app: AppHandle<R>,
    conversation_id: i64,
    turn: Turn,
    on_event: Channel<ChatEvent>,
) -> Result<u64, CommandError> {
    off_main_thread(app, move |app| {
        start_chat(
            &app.state::<AppState>(),
            &app.state::<Store>(),
            conversation_id,
            turn,
            on_event,
        )
    })
    .await
}

/// What [`chat`] does, blocking: saves the turn, renders the conversation (dropping its oldest
/// turns when it is longer than the context allows, see
/// [`perch_engine::Tokenizer::encode_chat_fitting`]), submits it and streams the answer from a
/// thread of its own, which saves the answer (also a partial one, with finish reason `error`
/// or `cancelled`) before it sends `Finished`.
pub fn start_chat(
    state: &AppState,
    store: &Store,
    conversation_id: i64,
    turn: Turn,
    on_event: Channel<ChatEvent>,
) -> Result<u64, CommandError> {
    // No model, no turn: the user's message is not saved without an answer to come.
    let engine = state.engine()?;
    // A text-only model says so before the message is saved.
    if matches!(&turn, Turn::Send { images, .. } if !images.is_empty())
        && engine.tokenizer().image_processor().is_none()
    {
        return Err(CommandError::invalid(
            &"The loaded model takes no images: choose a model marked as seeing images, or send \
              the message without them.",
        ));
    }
    let (settings, messages) = store
        .history()?
        .begin_turn(conversation_id, &turn)
        .map_err(|e| history_error(&e))?;
    // Room for the answer: its max_tokens, but at most a quarter of the context, so that a
    // long conversation keeps most of its history.
    let limits = engine.limits();
    let room = limits.context_length.min(limits.kv_cache_tokens);
    let answer_room = settings.max_tokens.clamp(1, (room / 4).max(1));
    // A text-only model reads the conversation's text: images attached earlier (with a model
    // that sees them) are left out of its prompt, and stay in the history.
    let messages: Vec<ChatMessage> = match engine.tokenizer().image_processor() {
        Some(_) => messages,
        None => messages
            .into_iter()
            .map(|m| ChatMessage::new(m.role, m.content))
            .collect(),
    };
    let fitted = engine
        .tokenizer()
        .encode_chat_fitting(&messages, limits.max_prompt_tokens(answer_room))
        .map_err(|e| CommandError::engine(&e))?;
    let (prompt, dropped_messages) = (fitted.tokens, fitted.dropped_messages);
    if dropped_messages > 0 {
        let _ = on_event.send(ChatEvent::ContextTrimmed { dropped_messages });
    }
    let mut params = GenerateRequest::new(Vec::new());
    // The person at the keyboard goes ahead of background work (agents through the local
    // server, batch jobs): the chat's prompt prefills between their chunks.
    params.priority = perch_engine::Priority::High;
    // Its prompts are compared with its own (a miss explained), and tallied on the dashboard.
    params.client = Some(APP_CLIENT.to_owned());
    params.images = fitted.images;
    let sampling = settings.effective_sampling(engine.tokenizer().sampling_defaults());
    params.sampling = sampling.params.clone();
    params.max_tokens = settings.max_tokens;
    // A bounded KV cache runs in the batch, a late-quantized one beside it (see
    // `perch_engine::sequence::speculative`); a bounded one cannot be rewound, so it takes no draft.
    params.max_kv_size = settings.max_kv_size;
    params.kv_quantization = settings.kv_bits.map(|bits| perch_engine::KvQuantization {
        bits,
        group_size: perch_engine::KvQuantization::DEFAULT_GROUP_SIZE,
    });
    params.quantized_kv_start = settings.quantized_kv_start;
    // Speculative decoding takes no images (see `perch_engine::sequence::speculative`).
    if engine.has_draft_model() && settings.max_kv_size.is_none() && params.images.is_empty() {
        params.num_draft_tokens = Some(store.num_draft_tokens()?);
    }
    let stream = engine
        .submit(EngineRequest {
            prompt: Prompt::Tokens(prompt),
            params,
        })
        .map_err(|e| CommandError::engine(&e))?;
    let id = stream.id;
    let _ = on_event.send(ChatEvent::Started {
        sampling: sampling.clone(),
    });
    let history = store.shared_history();
    std::thread::spawn(move || {
        let mut answer = String::new();
        let mut window_open = true;
        // The engine's end of the answer; a stream that stops without one (the engine went
        // away) ends as an error.
        let mut finished = None;
        for event in stream.events.iter() {
            match event {
                EngineEvent::Token { text, .. } => {
                    answer.push_str(&text);
                    if window_open && on_event.send(ChatEvent::Token { text }).is_err() {
                        // The window went away: stop spending compute, but save what there is.
                        window_open = false;
                        engine.cancel(id);
                    }
                }
                EngineEvent::Finished {
                    finish_reason,
                    stats,
                    error,
                    ..
                } => {
                    finished = Some((finish_reason, stats, error));
                    break;
                }
                EngineEvent::Admitted { .. } => {}
            }
        }
        let (finish_reason, stats, error) = finished.unwrap_or_else(|| {
            (
                FinishReason::Error,
                GenerationStats::default(),
                Some(perch_engine::api::RequestError::new(
                    perch_engine::api::ErrorKind::ModelNotLoaded,
                    "the engine stopped before the answer ended",
                )),
            )
        });
        let error = error.map(|e| sentence(&e.message));
        let saved = history
            .lock()
            .map_err(|_| super::poisoned())
            .and_then(|mut h| {
                h.save_answer(
                    conversation_id,
                    &answer,
                    finish_reason,
                    &stats,
                    error.as_deref(),
                    Some(&sampling),
                )
                .map_err(|e| history_error(&e))
            });
        let saved = saved.map_err(|e| e.message);
        let (message_id, save_error) = match saved {
            Ok(message) => (Some(message.id), None),
            Err(err) => (None, Some(err)),
        };
        let _ = on_event.send(ChatEvent::Finished {
            finish_reason,
            stats,
            error,
            message_id,
            save_error,
        });
    });
    Ok(id)
}

/// Cancels request `request_id` in the engine at once (it finishes as `cancelled`, and what was
/// generated is saved).
#[tauri::command]
pub fn stop(state: State<'_, AppState>, request_id: u64) -> Result<(), CommandError> {
    state.engine()?.cancel(request_id);
    Ok(())
}
