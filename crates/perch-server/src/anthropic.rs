//! Anthropic's Messages API over the engine (<https://docs.anthropic.com/en/api/messages>):
//! `POST /v1/messages`, plain and streamed, and `POST /v1/messages/count_tokens`. Errors in
//! Anthropic's shape.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use perch_engine::{
    ChatMessage, EngineRequest, FinishReason, GenerateRequest, GenerationStats, Prompt, Tokenizer,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{AnthropicError, ApiError};
use crate::running::{Running, Step};
use crate::AppState;

/// The request body of `POST /v1/messages` (and, without the generation fields, of
/// `count_tokens`). Fields Perch does not act on (`metadata`, …) are ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct MessagesRequest {
    model: String,
    messages: Vec<Message>,
    system: Option<Content>,
    /// Required by `/v1/messages`.
    max_tokens: Option<usize>,
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    #[serde(default)]
    stream: bool,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// A message's content: a string, or content blocks.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl Content {
    /// The text of the content; text blocks are joined by newlines. Other blocks (images,
    /// documents) are a 400 naming them.
    fn text(&self, param: &'static str) -> Result<String, ApiError> {
        match self {
            Content::Text(text) => Ok(text.clone()),
            Content::Blocks(blocks) => blocks
                .iter()
                .map(|block| match (block.kind.as_str(), &block.text) {
                    ("text", Some(text)) => Ok(text.as_str()),
                    (kind, _) => Err(ApiError::invalid(
                        format!("content blocks of type `{kind}` are not supported; send text"),
                        Some(param),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|texts| texts.join("\n")),
        }
    }
}

impl MessagesRequest {
    /// The conversation as chat-template messages, the system prompt first.
    fn conversation(&self, served: &str) -> Result<Vec<ChatMessage>, ApiError> {
        if self.model != served {
            return Err(ApiError::unknown_model(&self.model, served));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages: at least one message is required",
                Some("messages"),
            ));
        }
        let mut conversation = Vec::with_capacity(self.messages.len() + 1);
        if let Some(system) = &self.system {
            conversation.push(ChatMessage::new("system", system.text("system")?));
        }
        for message in &self.messages {
            if !matches!(message.role.as_str(), "user" | "assistant") {
                return Err(ApiError::invalid(
                    format!(
                        "messages: role `{}` is not one of `user`, `assistant`",
                        message.role
                    ),
                    Some("messages"),
                ));
            }
            conversation.push(ChatMessage::new(
                message.role.clone(),
                message.content.text("messages")?,
            ));
        }
        Ok(conversation)
    }

    /// The generation settings, or the 400 naming the parameter at fault.
    fn params(&self) -> Result<GenerateRequest, ApiError> {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = match self.max_tokens {
            None => {
                return Err(ApiError::invalid(
                    "max_tokens: field required",
                    Some("max_tokens"),
                ))
            }
            Some(0) => {
                return Err(ApiError::invalid(
                    "max_tokens: must be at least 1",
                    Some("max_tokens"),
                ))
            }
            Some(n) => n,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "temperature: must be between 0 and 1",
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::invalid(
                "top_p: must be between 0 and 1",
                Some("top_p"),
            ));
        }
        params.sampling.temperature = temperature;
        params.sampling.top_p = top_p;
        params.sampling.top_k = self.top_k.unwrap_or(0);
        params.stop_strings = self.stop_sequences.clone().unwrap_or_default();
        params.stop_strings.retain(|s| !s.is_empty());
        Ok(params)
    }
}

/// Renders and tokenizes the conversation off the async threads (a chat template is a program).
async fn tokenize(
    tokenizer: &Arc<Tokenizer>,
    messages: Vec<ChatMessage>,
) -> Result<Vec<u32>, ApiError> {
    let tokenizer = Arc::clone(tokenizer);
    tokio::task::spawn_blocking(move || tokenizer.encode_chat(&messages))
        .await
        .map_err(|e| ApiError::engine(e.to_string()))?
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
}

fn parse(body: Result<Json<MessagesRequest>, JsonRejection>) -> Result<MessagesRequest, ApiError> {
    body.map(|Json(request)| request)
        .map_err(|e| ApiError::invalid(e.body_text(), None))
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens as the model sees them (the chat
/// template applied, with the assistant's turn header).
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Json<Value>, AnthropicError> {
    let request = parse(body)?;
    let conversation = request.conversation(&state.config.model_id)?;
    let ids = tokenize(state.engine.tokenizer(), conversation).await?;
    Ok(Json(json!({"input_tokens": ids.len()})))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(state): State<AppState>,
    body: Result<Json<MessagesRequest>, JsonRejection>,
) -> Result<Response, AnthropicError> {
    let request = parse(body)?;
    let conversation = request.conversation(&state.config.model_id)?;
    let mut params = request.params()?;
    let ids = tokenize(state.engine.tokenizer(), conversation).await?;
    params.prompt = ids.clone();
    let prompt_tokens = ids.len();
    let running = Running::start(
        &state.engine,
        EngineRequest {
            prompt: Prompt::Tokens(ids),
            params,
        },
    )
    .await?;
    let id = format!("msg_{}", running.id);
    let model = state.config.model_id.clone();
    if request.stream {
        return Ok(Sse::new(events(running, id, model, prompt_tokens)).into_response());
    }
    let done = running.collect().await?;
    let (stop_reason, stop_sequence) = stop_reason(done.reason, done.stop_string);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": done.text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&done.stats),
    }))
    .into_response())
}

/// Anthropic's `stop_reason` and `stop_sequence` for the engine's finish.
fn stop_reason(
    reason: FinishReason,
    stop_string: Option<String>,
) -> (&'static str, Option<String>) {
    match (reason, stop_string) {
        (FinishReason::Length, _) => ("max_tokens", None),
        (_, Some(stop)) => ("stop_sequence", Some(stop)),
        _ => ("end_turn", None),
    }
}

/// Anthropic's `usage`: `input_tokens` counts only the prompt tokens not read from the prefix
/// cache, `cache_read_input_tokens` those read (Anthropic's definitions).
fn usage(stats: &GenerationStats) -> Value {
    json!({
        "input_tokens": stats.prompt_tokens - stats.cached_prompt_tokens,
        "cache_read_input_tokens": stats.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": stats.generation_tokens,
    })
}

/// The message as Anthropic's event stream: `message_start`, `content_block_start`, `ping`, a
/// `content_block_delta` per piece of text, `content_block_stop`, `message_delta` (stop reason
/// and the final usage), `message_stop`. An engine failure mid-stream sends an `error` event.
fn events(
    running: Running,
    id: String,
    model: String,
    prompt_tokens: usize,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let event = |name: &str, data: Value| Event::default().event(name).data(data.to_string());
    let start = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }}),
        ),
        event(
            "content_block_start",
            json!({"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    let rest = running.into_steps().filter_map(move |step| {
        let out = match step {
            Step::Token { text, .. } if text.is_empty() => None,
            Step::Token { text, .. } => Some(vec![event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": text}}),
            )]),
            Step::Done {
                reason,
                stats,
                stop_string,
            } => {
                let (stop_reason, stop_sequence) = stop_reason(reason, stop_string);
                Some(vec![
                    event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    ),
                    event(
                        "message_delta",
                        json!({"type": "message_delta",
                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                               "usage": usage(&stats)}),
                    ),
                    event("message_stop", json!({"type": "message_stop"})),
                ])
            }
            Step::Failed(error) => Some(vec![event("error", AnthropicError(error).body())]),
        };
        std::future::ready(out)
    });
    stream::iter(start)
        .chain(rest.flat_map(stream::iter))
        .map(Ok)
}
