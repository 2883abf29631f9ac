//! OpenAI's Chat Completions and Models endpoints over the engine
//! (<https://platform.openai.com/docs/api-reference/chat>).

use std::collections::HashMap;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use perch_engine::kv_cache_manager::RequestId;
use perch_engine::{
    ChatMessage, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenerateRequest,
    GenerationStats, Prompt,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::AppState;

/// `GET /v1/models`: the one model this server serves.
pub(crate) async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "perch",
        }],
    }))
}

/// The request body of `POST /v1/chat/completions` (the fields Perch acts on; others are
/// ignored, as OpenAI-compatible servers do).
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCompletionRequest {
    model: String,
    messages: Vec<ChatMessage>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    stop: Option<Stop>,
    seed: Option<u64>,
    n: Option<usize>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Token id (as a string) → bias added to its logit, -100..100.
    logit_bias: Option<HashMap<String, f32>>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Tokens generated when a request names no limit (OpenAI's is the context; a local server
/// answering an agent with no limit should still end).
const DEFAULT_MAX_TOKENS: usize = 2048;

impl ChatCompletionRequest {
    /// The engine request this asks for, or the 400 naming the parameter at fault.
    fn to_engine(&self) -> Result<EngineRequest, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "only n = 1 is supported: one choice per request",
                Some("n"),
            ));
        }
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "`messages` must hold at least one message",
                Some("messages"),
            ));
        }
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = self
            .max_completion_tokens
            .or(self.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS);
        if params.max_tokens == 0 {
            return Err(ApiError::invalid(
                "`max_tokens` must be at least 1",
                Some("max_tokens"),
            ));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                "`temperature` must be between 0 and 2",
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&top_p) {
            return Err(ApiError::invalid(
                "`top_p` must be between 0 and 1",
                Some("top_p"),
            ));
        }
        params.sampling.temperature = temperature;
        params.sampling.top_p = top_p;
        params.sampling.seed = self.seed;
        for (token, bias) in self.logit_bias.iter().flatten() {
            let id = token.parse::<u32>().map_err(|_| {
                ApiError::invalid(
                    format!("`logit_bias` keys are token ids; `{token}` is not one"),
                    Some("logit_bias"),
                )
            })?;
            if !(-100.0..=100.0).contains(bias) {
                return Err(ApiError::invalid(
                    "`logit_bias` values must be between -100 and 100",
                    Some("logit_bias"),
                ));
            }
            params.sampling.logit_bias.insert(id, *bias);
        }
        params.stop_strings = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        params.stop_strings.retain(|s| !s.is_empty());
        // OpenAI's `developer` role is the newer name of `system`, which chat templates know.
        let messages = self
            .messages
            .iter()
            .map(|m| match m.role.as_str() {
                "developer" => ChatMessage::new("system", m.content.clone()),
                _ => m.clone(),
            })
            .collect();
        Ok(EngineRequest {
            prompt: Prompt::Chat(messages),
            params,
        })
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::invalid(e.body_text(), None))?;
    if request.model != state.config.model_id {
        return Err(ApiError::unknown_model(
            &request.model,
            &state.config.model_id,
        ));
    }
    let engine_request = request.to_engine()?;
    let mut running = Running::submit(&state.engine, engine_request)?;
    // A request the engine refuses (a prompt longer than the context, …) is the client's error:
    // a 400 before any stream starts.
    running.check_refused().await?;
    let meta = Meta {
        id: format!("chatcmpl-{}", running.id),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: state.config.model_id.clone(),
    };
    if request.stream {
        let include_usage = request
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        Ok(Sse::new(stream_chunks(running, meta, include_usage)).into_response())
    } else {
        complete(running, meta)
            .await
            .map(IntoResponse::into_response)
    }
}

/// What every response and chunk of one completion repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
}

impl Meta {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }
}

/// A request in the engine, its events forwarded to async code; cancelled in the engine when
/// dropped before its end (the client went away).
struct Running {
    id: RequestId,
    engine: EngineHandle,
    events: mpsc::UnboundedReceiver<EngineEvent>,
    /// An event read ahead by [`Running::check_refused`], handed out first.
    peeked: Option<EngineEvent>,
    finished: bool,
}

impl Running {
    fn submit(engine: &EngineHandle, request: EngineRequest) -> Result<Self, ApiError> {
        let stream = engine
            .submit(request)
            .map_err(|e| ApiError::engine(e.to_string()))?;
        let (tx, events) = mpsc::unbounded_channel();
        let receiver = stream.events;
        // The engine's events arrive on a blocking channel; a blocking task moves them over.
        tokio::task::spawn_blocking(move || {
            for event in receiver {
                if tx.send(event).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            id: stream.id,
            engine: engine.clone(),
            events,
            peeked: None,
            finished: false,
        })
    }

    /// Waits for the request's first event: a 400 with the engine's message when the engine
    /// refused the request (the message names what is wrong, e.g. both lengths of a prompt
    /// longer than the context); otherwise the event is kept for [`Running::next`].
    async fn check_refused(&mut self) -> Result<(), ApiError> {
        let first = self.next().await;
        if let Some(EngineEvent::Finished {
            refused: true,
            error,
            ..
        }) = &first
        {
            let message = error.clone().unwrap_or_else(|| "refused".into());
            return Err(ApiError::invalid(message, None));
        }
        self.peeked = first;
        Ok(())
    }

    async fn next(&mut self) -> Option<EngineEvent> {
        if let Some(event) = self.peeked.take() {
            return Some(event);
        }
        let event = self.events.recv().await;
        if matches!(event, Some(EngineEvent::Finished { .. }) | None) {
            self.finished = true;
        }
        event
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            self.engine.cancel(self.id);
        }
    }
}

/// OpenAI's `finish_reason` for the engine's.
fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled | FinishReason::Error => "stop",
    }
}

/// The `usage` object: prompt tokens with those read from the prefix cache, generated tokens.
fn usage(stats: &GenerationStats) -> Value {
    json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    })
}

/// Waits for the whole completion and answers it in one `chat.completion` object.
async fn complete(mut running: Running, meta: Meta) -> Result<Json<Value>, ApiError> {
    let mut text = String::new();
    while let Some(event) = running.next().await {
        match event {
            EngineEvent::Token { text: piece, .. } => text.push_str(&piece),
            EngineEvent::Finished {
                finish_reason: reason,
                stats,
                error,
                ..
            } => {
                if reason == FinishReason::Error {
                    return Err(ApiError::engine(
                        error.unwrap_or_else(|| "generation failed".into()),
                    ));
                }
                return Ok(Json(json!({
                    "id": meta.id,
                    "object": "chat.completion",
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [{
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": null,
                        "finish_reason": finish_reason(reason),
                    }],
                    "usage": usage(&stats),
                })));
            }
        }
    }
    Err(ApiError::engine(
        "the engine stopped before the request ended",
    ))
}

/// The completion as `chat.completion.chunk` events: the assistant role, one chunk per piece of
/// text, the finish reason, the usage when asked (a last chunk with no choices), then `[DONE]`.
/// An engine failure mid-stream sends an error object in OpenAI's shape instead of the finish.
fn stream_chunks(
    running: Running,
    meta: Meta,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> {
    enum Stage {
        Start,
        Tokens,
        Done,
        End,
    }
    let data = |value: Value| Ok(Event::default().data(value.to_string()));
    stream::unfold(
        (running, meta, Stage::Start, Vec::<Value>::new()),
        move |(mut running, meta, stage, mut queued)| async move {
            if let Some(next) = queued.pop() {
                return Some((data(next), (running, meta, stage, queued)));
            }
            match stage {
                Stage::Start => {
                    let delta = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]);
                    let first = meta.chunk(delta, None);
                    Some((data(first), (running, meta, Stage::Tokens, queued)))
                }
                Stage::Tokens => loop {
                    match running.next().await {
                        Some(EngineEvent::Token { text, .. }) if text.is_empty() => continue,
                        Some(EngineEvent::Token { text, .. }) => {
                            let delta = json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}]);
                            let chunk = meta.chunk(delta, None);
                            break Some((data(chunk), (running, meta, Stage::Tokens, queued)));
                        }
                        Some(EngineEvent::Finished {
                            finish_reason: reason,
                            stats,
                            error,
                            ..
                        }) => {
                            let last = if reason == FinishReason::Error {
                                ApiError::engine(
                                    error.unwrap_or_else(|| "generation failed".into()),
                                )
                                .body()
                            } else {
                                let choice = json!([{"index": 0, "delta": {}, "finish_reason": finish_reason(reason)}]);
                                if include_usage {
                                    // Sent after the finish chunk, before `[DONE]`.
                                    queued.push(meta.chunk(json!([]), Some(usage(&stats))));
                                }
                                meta.chunk(choice, None)
                            };
                            break Some((data(last), (running, meta, Stage::Done, queued)));
                        }
                        None => {
                            let error =
                                ApiError::engine("the engine stopped before the request ended");
                            break Some((data(error.body()), (running, meta, Stage::Done, queued)));
                        }
                    }
                },
                Stage::Done => Some((
                    Ok(Event::default().data("[DONE]")),
                    (running, meta, Stage::End, queued),
                )),
                Stage::End => None,
            }
        },
    )
}
