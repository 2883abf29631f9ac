//! Conversations and chat: the history's commands, and `chat`, which answers a turn of a
//! conversation through the engine, streams the tokens to the UI and saves the answer before it
//! reports it finished (so nothing shown as finished is lost, even to `kill -9`).

use perch_engine::{
    EngineEvent, EngineRequest, FinishReason, GenerateRequest, GenerationStats, Prompt,
};
use perch_store::{Conversation, ConversationSettings, ConversationSummary, Turn};
use serde::Serialize;
use tauri::ipc::Channel;
use tauri::State;

use super::model::AppState;
use super::sentence;
use crate::store::Store;

/// Conversations, most recently active first; a non-empty `search` keeps those whose title or
/// messages contain it.
#[tauri::command]
pub fn list_conversations(
    store: State<'_, Store>,
    search: Option<String>,
) -> Result<Vec<ConversationSummary>, String> {
    store
        .history()?
        .conversations(search.as_deref().unwrap_or(""))
        .map_err(|e| sentence(&e))
}

/// Starts an empty conversation with the settings' defaults (system prompt, sampling).
#[tauri::command]
pub fn create_conversation(store: State<'_, Store>) -> Result<ConversationSummary, String> {
    let defaults = store.settings()?.chat;
    store
        .history()?
        .create_conversation(&defaults)
        .map_err(|e| sentence(&e))
}

#[tauri::command]
pub fn get_conversation(store: State<'_, Store>, id: i64) -> Result<Conversation, String> {
    store.history()?.conversation(id).map_err(|e| sentence(&e))
}

/// Renames conversation `id`; an empty title goes back to its first message.
#[tauri::command]
pub fn rename_conversation(
    store: State<'_, Store>,
    id: i64,
    title: String,
) -> Result<ConversationSummary, String> {
    store
        .history()?
        .rename(id, &title)
        .map_err(|e| sentence(&e))
}

#[tauri::command]
pub fn delete_conversation(store: State<'_, Store>, id: i64) -> Result<(), String> {
    store.history()?.delete(id).map_err(|e| sentence(&e))
}

/// Sets conversation `id`'s system prompt and sampling (validated) for its next answers.
#[tauri::command]
pub fn set_conversation_settings(
    store: State<'_, Store>,
    id: i64,
    settings: ConversationSettings,
) -> Result<(), String> {
    settings.validate().map_err(|e| sentence(&e))?;
    store
        .history()?
        .set_settings(id, &settings)
        .map_err(|e| sentence(&e))
}

/// What a chat request streams to the UI.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ChatEvent {
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
/// `on_event`. Returns the request id, for [`stop`].
#[tauri::command]
pub fn chat(
    state: State<'_, AppState>,
    store: State<'_, Store>,
    conversation_id: i64,
    turn: Turn,
    on_event: Channel<ChatEvent>,
) -> Result<u64, String> {
    // No model, no turn: the user's message is not saved without an answer to come.
    let engine = state.engine()?;
    let (settings, messages) = store
        .history()?
        .begin_turn(conversation_id, &turn)
        .map_err(|e| sentence(&e))?;
    let mut params = GenerateRequest::new(Vec::new());
    params.sampling = settings.sampling;
    params.max_tokens = settings.max_tokens;
    let stream = engine
        .submit(EngineRequest {
            prompt: Prompt::Chat(messages),
            params,
        })
        .map_err(|e| sentence(&e))?;
    let id = stream.id;
    let history = store.shared_history();
    std::thread::spawn(move || {
        let mut answer = String::new();
        let mut window_open = true;
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
                    let error = error.map(|e| sentence(&e));
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
                            )
                            .map_err(|e| sentence(&e))
                        });
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
                    break;
                }
            }
        }
    });
    Ok(id)
}

/// Cancels request `request_id` in the engine at once (it finishes as `cancelled`, and what was
/// generated is saved).
#[tauri::command]
pub fn stop(state: State<'_, AppState>, request_id: u64) -> Result<(), String> {
    state.engine()?.cancel(request_id);
    Ok(())
}
