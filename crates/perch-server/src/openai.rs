//! OpenAI's Chat Completions and Models endpoints over the engine
//! (<https://platform.openai.com/docs/api-reference/chat>), and what the legacy Completions
//! endpoint shares with them: sampling parameters, usage, finish reasons, log-probabilities.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use perch_engine::text::tool_calls::{ToolCall, ToolOutput};
use perch_engine::{
    CachePin, ChatMessage, EngineRequest, FinishReason, GenerateRequest, GenerationStats, Grammar,
    Prompt, TokenLogprobs, Tokenizer,
};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::running::{with_header, Running, Step};
use crate::tools::{self, Answer, Forced};
use crate::{AppState, ServedName, Shared};

/// `GET /v1/models`: the one model this server serves, or none while none is loaded. Beside
/// OpenAI's fields, `capabilities` as Ollama's `/api/show` lists them: `"completion"`, and
/// `"vision"` for a model that takes images.
pub(crate) async fn models(State(shared): State<Shared>) -> Json<Value> {
    let data: Vec<Value> = shared
        .served
        .current()
        .into_iter()
        .flat_map(|served| {
            let mut capabilities = vec!["completion"];
            if served.engine.tokenizer().image_processor().is_some() {
                capabilities.push("vision");
            }
            // Its id, then each alias (the same model under another name).
            std::iter::once(&served.model_id)
                .chain(&shared.config.model_aliases)
                .map(|id| {
                    json!({
                        "id": id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "perch",
                        "capabilities": capabilities,
                    })
                })
                .collect::<Vec<_>>()
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// The sampling and streaming parameters Chat Completions and Completions share (the fields
/// Perch acts on; others are ignored, as OpenAI-compatible servers do).
#[derive(Debug, Deserialize)]
pub(crate) struct Sampling {
    pub model: String,
    temperature: Option<f32>,
    top_p: Option<f32>,
    stop: Option<Stop>,
    seed: Option<u64>,
    n: Option<usize>,
    /// Token id (as a string) → bias added to its logit, -100..100.
    logit_bias: Option<HashMap<String, f32>>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    /// XTC (mlx_lm's server extension, `perch_engine::sample::sampler`): the probability per token of
    /// excluding the top choices, 0..1 (0: off).
    xtc_probability: Option<f32>,
    /// XTC's threshold for a top choice, 0..0.5 (mlx_lm's default 0.1).
    xtc_threshold: Option<f32>,
    /// Tokens the draft model proposes per step (mlx_lm's server extension; 0: no speculative
    /// decoding; default: the server's when it has a draft model).
    num_draft_tokens: Option<usize>,
    /// mlx_lm's generation KV options, per request (Perch's extension): bound the KV cache to
    /// this many positions (`--max-kv-size`), or quantize it to `kv_bits` (group `kv_group_size`,
    /// default 64) from `quantized_kv_start` positions on (default 5,000). Such a request runs in
    /// the batch without the prefix cache; the engine checks the values.
    max_kv_size: Option<usize>,
    kv_bits: Option<i32>,
    kv_group_size: Option<i32>,
    quantized_kv_start: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    stream_options: Option<StreamOptions>,
    /// Keep generating through the end-of-sequence token (vLLM's extension, for benchmarks).
    #[serde(default)]
    ignore_eos: bool,
    response_format: Option<ResponseFormat>,
    /// How long the model stays in memory once idle, from this request on (Ollama's
    /// `keep_alive`, Perch's extension; see [`KeepAliveField`]).
    keep_alive: Option<KeepAliveField>,
    /// The request's lane (see [`PriorityField`]).
    priority: Option<PriorityField>,
    /// OpenAI's prompt-caching key: the prompt is kept in the prefix cache under it (the key's
    /// next prompt replaces it) for `prompt_cache_retention` (`in_memory`, the default: 5
    /// minutes; `24h`), within the pins' share of the KV cache (`perch_sched::prefix_pins`).
    prompt_cache_key: Option<String>,
    prompt_cache_retention: Option<String>,
}

/// The longest `prompt_cache_key` taken, in bytes.
const MAX_PROMPT_CACHE_KEY_BYTES: usize = 1024;

/// A request's lane in the batch (`perch_engine::Priority`): `"high"`, `"normal"` or `"low"`, or
/// vLLM's integer `priority` (below 0 high, 0 normal, above 0 low). Perch's extension, on every
/// generating endpoint; the `x-perch-priority` header sets it for requests whose body does not.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum PriorityField {
    Vllm(i64),
    Name(String),
}

impl PriorityField {
    /// The engine's lane, or a 400 naming `priority`.
    pub fn parse(&self) -> Result<perch_engine::Priority, ApiError> {
        match self {
            PriorityField::Vllm(value) => Ok(perch_engine::Priority::from_vllm(*value)),
            PriorityField::Name(name) => perch_engine::Priority::from_name(name).ok_or_else(|| {
                ApiError::invalid(
                    format!("priority must be high, normal, low or an integer, not {name:?}"),
                    Some("priority"),
                )
            }),
        }
    }

    /// `field`'s lane, normal without one.
    pub fn lane(field: &Option<PriorityField>) -> Result<perch_engine::Priority, ApiError> {
        Ok(field
            .as_ref()
            .map(Self::parse)
            .transpose()?
            .unwrap_or_default())
    }
}

/// Ollama's `keep_alive`: seconds (`300`, `0` to unload once idle, `-1` to keep) or a duration
/// (`"5m"`, `"1h30m"`, `"-1"`), parsed by [`perch_engine::KeepAlive`].
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum KeepAliveField {
    Seconds(f64),
    Text(String),
}

impl KeepAliveField {
    /// The engine's value, or a 400 naming `keep_alive`.
    pub fn parse(&self) -> Result<perch_engine::KeepAlive, ApiError> {
        match self {
            KeepAliveField::Seconds(seconds) => perch_engine::KeepAlive::from_seconds(*seconds),
            KeepAliveField::Text(text) => perch_engine::KeepAlive::parse(text),
        }
        .map_err(|message| ApiError::invalid(message, Some("keep_alive")))
    }
}

/// OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema
/// (generation constrained to it; see `perch_engine::sample::grammar`).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    /// Required by OpenAI; Perch does not use the name.
    #[serde(rename = "name")]
    _name: Option<String>,
    schema: Option<Value>,
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

/// Recent tokens OpenAI's presence and frequency penalties look at. OpenAI counts the whole
/// text so far; mlx_lm's processors (whose math Perch follows) count a window, 20 by default.
/// A longer window is closer to OpenAI's meaning at a small cost per step.
pub const PENALTY_WINDOW: usize = 256;

impl Sampling {
    /// The pin `prompt_cache_key` asks for (the whole prompt), or a 400 naming the field.
    fn cache_pin(&self) -> Result<Option<CachePin>, ApiError> {
        let ttl = match self.prompt_cache_retention.as_deref() {
            // `in-memory` is how some clients spell it (langchain.js, openai-agents-js).
            None | Some("in_memory" | "in-memory") => CachePin::DEFAULT_TTL,
            Some("24h") => std::time::Duration::from_secs(24 * 3600),
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("prompt_cache_retention must be `in_memory` or `24h`, not {other:?}"),
                    Some("prompt_cache_retention"),
                ))
            }
        };
        let Some(key) = &self.prompt_cache_key else {
            return Ok(None);
        };
        if key.is_empty() || key.len() > MAX_PROMPT_CACHE_KEY_BYTES {
            return Err(ApiError::invalid(
                format!("prompt_cache_key must be 1 to {MAX_PROMPT_CACHE_KEY_BYTES} bytes"),
                Some("prompt_cache_key"),
            ));
        }
        Ok(Some(CachePin {
            tokens: usize::MAX,
            ttl,
            key: Some(key.clone()),
        }))
    }

    /// Checks the model and the parameters and sets them on `params`, or the 400/404 naming the
    /// parameter at fault.
    pub fn apply(
        &self,
        served: ServedName<'_>,
        params: &mut GenerateRequest,
    ) -> Result<(), ApiError> {
        served.check(&self.model)?;
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "only n = 1 is supported: one choice per request",
                Some("n"),
            ));
        }
        let temperature = ApiError::in_range(self.temperature, 1.0, (0.0, 2.0), "temperature")?;
        let top_p = ApiError::in_range(self.top_p, 1.0, (0.0, 1.0), "top_p")?;
        params.sampling.temperature = temperature;
        params.sampling.top_p = top_p;
        params.sampling.seed = self.seed;
        params.ignore_eos = self.ignore_eos;
        params.sampling.presence_penalty =
            ApiError::in_range(self.presence_penalty, 0.0, (-2.0, 2.0), "presence_penalty")?;
        params.sampling.frequency_penalty = ApiError::in_range(
            self.frequency_penalty,
            0.0,
            (-2.0, 2.0),
            "frequency_penalty",
        )?;
        params.num_draft_tokens = self.num_draft_tokens;
        params.keep_alive = self
            .keep_alive
            .as_ref()
            .map(KeepAliveField::parse)
            .transpose()?;
        params.priority = PriorityField::lane(&self.priority)?;
        params.cache_pins = self.cache_pin()?.into_iter().collect();
        params.max_kv_size = self.max_kv_size;
        params.kv_quantization = self.kv_bits.map(|bits| perch_engine::KvQuantization {
            bits,
            group_size: self
                .kv_group_size
                .unwrap_or(perch_engine::KvQuantization::DEFAULT_GROUP_SIZE),
        });
        if let Some(start) = self.quantized_kv_start {
            params.quantized_kv_start = start;
        }
        params.sampling.xtc_probability =
            ApiError::in_range(self.xtc_probability, 0.0, (0.0, 1.0), "xtc_probability")?;
        params.sampling.xtc_threshold = ApiError::in_range(
            self.xtc_threshold,
            perch_engine::sample::sampler::DEFAULT_XTC_THRESHOLD,
            (0.0, 0.5),
            "xtc_threshold",
        )?;
        params.sampling.presence_context_size = PENALTY_WINDOW;
        params.sampling.frequency_context_size = PENALTY_WINDOW;
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
        params.grammar = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Grammar::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema.schema.clone().ok_or_else(|| {
                    ApiError::invalid(
                        "`response_format.json_schema.schema` is required",
                        Some("response_format"),
                    )
                })?;
                Some(Grammar::JsonSchema(schema))
            }
        };
        Ok(())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// `max_tokens` (or its newer name) checked, or `default`.
pub(crate) fn max_tokens(asked: Option<usize>, default: usize) -> Result<usize, ApiError> {
    match asked {
        Some(0) => Err(ApiError::invalid(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        )),
        Some(n) => Ok(n),
        None => Ok(default),
    }
}

/// The request body of `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct ChatCompletionRequest {
    #[serde(flatten)]
    sampling: Sampling,
    messages: Vec<ChatMessage>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    /// Return each generated token's log-probability.
    logprobs: Option<bool>,
    /// With `logprobs`: also the most likely alternatives at each position, 0..=20.
    top_logprobs: Option<usize>,
    /// Functions the model may call (`{"type": "function", "function": {"name", "description",
    /// "parameters"}}`), rendered by the chat template.
    #[serde(default)]
    tools: Vec<Value>,
    /// `"none"` leaves the tools out; `"auto"` lets the model choose; `"required"` and a named
    /// function (`{"type": "function", "function": {"name"}}`) force a call (see
    /// [`tools::Forced`]).
    tool_choice: Option<Value>,
}

/// Tokens generated when a chat request names no limit (OpenAI's is the context; a local server
/// answering an agent with no limit should still end).
const DEFAULT_MAX_TOKENS: usize = 2048;

/// Most alternatives a request may ask for per position (OpenAI's limit).
const MAX_TOP_LOGPROBS: usize = 20;

impl ChatCompletionRequest {
    /// The generation settings and the conversation as the template sees it, or the 400 naming
    /// the parameter at fault.
    fn prepare(
        &self,
        served: ServedName<'_>,
    ) -> Result<(GenerateRequest, Vec<ChatMessage>), ApiError> {
        let mut params = GenerateRequest::new(Vec::new());
        self.sampling.apply(served, &mut params)?;
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "`messages` must hold at least one message",
                Some("messages"),
            ));
        }
        params.max_tokens = max_tokens(
            self.max_completion_tokens.or(self.max_tokens),
            DEFAULT_MAX_TOKENS,
        )?;
        params.logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
                return Err(ApiError::invalid(
                    format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}"),
                    Some("top_logprobs"),
                ))
            }
            (false, Some(_)) => {
                return Err(ApiError::invalid(
                    "`top_logprobs` needs `logprobs: true`",
                    Some("top_logprobs"),
                ))
            }
            (true, top) => Some(top.unwrap_or(0)),
            (false, None) => None,
        };
        // OpenAI's `developer` role is the newer name of `system`, which chat templates know.
        let mut messages: Vec<ChatMessage> = self
            .messages
            .iter()
            .cloned()
            .map(|mut m| {
                if m.role == "developer" {
                    m.role = "system".into();
                }
                m
            })
            .collect();
        tools::arguments_as_objects(&mut messages);
        Ok((params, messages))
    }

    /// The call `tool_choice` forces, if any; an unknown choice is a 400.
    fn forced(&self) -> Result<Option<Forced>, ApiError> {
        let bad = || {
            ApiError::invalid(
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": …}}",
                Some("tool_choice"),
            )
        };
        match &self.tool_choice {
            None => Ok(None),
            Some(Value::String(choice)) => match choice.as_str() {
                "none" | "auto" => Ok(None),
                "required" => Ok(Some(Forced::Any)),
                _ => Err(bad()),
            },
            Some(choice) => choice
                .pointer("/function/name")
                .and_then(Value::as_str)
                .map(|name| Some(Forced::Named(name.to_owned())))
                .ok_or_else(bad),
        }
    }

    /// The tools the template gets: none when `tool_choice` is `"none"`.
    fn offered_tools(&self) -> Vec<Value> {
        match &self.tool_choice {
            Some(Value::String(choice)) if choice == "none" => Vec::new(),
            _ => self.tools.clone(),
        }
    }
}

/// `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    state: AppState,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::invalid(e.body_text(), None))?;
    let (mut params, messages) = request.prepare(state.served_name())?;
    let tokenizer = Arc::clone(state.engine.tokenizer());
    let tools = request.offered_tools();
    let forced = request.forced()?;
    if let Some(forced) = &forced {
        params.grammar = Some(tools::forced_grammar(&tools, forced)?);
    }
    let (ids, images) = tools::render(&tokenizer, messages, tools.clone()).await?;
    params.prompt = ids.clone();
    params.images = images;
    let engine_request = EngineRequest {
        prompt: Prompt::Tokens(ids),
        params,
    };
    let running = Running::start(&state, engine_request).await?;
    let cache_header = running.cache_header();
    let meta = Meta::new(format!("chatcmpl-{}", running.id), &state.model_id);
    let answer = match forced {
        Some(forced) => Answer::forced(forced),
        None => Answer::new(tools::parser(&tokenizer, &tools, true)),
    };
    if request.sampling.stream {
        let include_usage = request.sampling.include_usage();
        let events = chat_chunks(running, meta, tokenizer, include_usage, answer);
        return Ok(with_header(Sse::new(events).into_response(), cache_header));
    }
    let done = running.collect().await?;
    let logprobs = request.logprobs.unwrap_or(false).then(|| {
        let content: Vec<Value> = done
            .tokens
            .iter()
            .map(|(id, lp)| chat_logprob(&tokenizer, *id, lp.as_ref()))
            .collect();
        json!({"content": content, "refusal": null})
    });
    let mut answer = answer;
    let mut outputs = answer.push(&done.text);
    outputs.extend(answer.finish());
    let mut message = json!({"role": "assistant", "content": null});
    let mut calls = Vec::new();
    let (mut content, mut reasoning) = (String::new(), String::new());
    for output in outputs {
        match output {
            ToolOutput::Text(text) => content.push_str(&text),
            ToolOutput::Reasoning(text) => reasoning.push_str(&text),
            ToolOutput::Call(call) => calls.push(tool_call_json(&meta.id, calls.len(), &call)),
        }
    }
    if !content.is_empty() || calls.is_empty() {
        message["content"] = content.into();
    }
    if !reasoning.is_empty() {
        message["reasoning_content"] = reasoning.into();
    }
    let finish = if calls.is_empty() {
        finish_reason(done.reason)
    } else {
        message["tool_calls"] = calls.into();
        "tool_calls"
    };
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
        }],
        "usage": usage(&done.stats),
    }))
    .into_response())
    .map(|response| with_header(response, cache_header))
}

/// One call of `tool_calls`: its id (unique in this server's answers), the function's name and
/// its arguments as a JSON string, as OpenAI sends them.
fn tool_call_json(completion: &str, index: usize, call: &ToolCall) -> Value {
    json!({
        "id": format!("call_{}_{index}", completion.trim_start_matches("chatcmpl-")),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments.to_string()},
    })
}

/// What every response and chunk of one completion repeats.
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(id: String, model: &str) -> Self {
        Self {
            id,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_owned(),
        }
    }

    /// One streamed object of type `object` (`chat.completion.chunk`, `text_completion`).
    pub fn chunk(&self, object: &str, choices: Value, usage: Option<Value>) -> Value {
        let mut chunk = json!({
            "id": self.id,
            "object": object,
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

/// OpenAI's `finish_reason` for the engine's.
pub(crate) fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled | FinishReason::Error => "stop",
    }
}

/// The `usage` object: prompt tokens with those read from the prefix cache, generated tokens.
pub(crate) fn usage(stats: &GenerationStats) -> Value {
    let mut usage = json!({
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generation_tokens,
        "total_tokens": stats.prompt_tokens + stats.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    });
    cut_for_memory(&mut usage, stats);
    usage
}

/// Perch's extension of a `usage` object: `"cut_for_memory": true` when the engine ended the
/// answer early for lack of KV memory (its finish reason is then the token limit's).
pub(crate) fn cut_for_memory(usage: &mut Value, stats: &GenerationStats) {
    if stats.cut_for_memory {
        usage["cut_for_memory"] = Value::Bool(true);
    }
}

/// A log-probability as JSON: `-inf` (a token the processors ruled out) has no JSON number, so
/// it is OpenAI's floor of -9999.
pub(crate) fn logprob_value(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}

/// One entry of a chat choice's `logprobs.content`: the token, its log-probability and UTF-8
/// bytes, and the alternatives asked for.
fn chat_logprob(tokenizer: &Tokenizer, id: u32, logprobs: Option<&TokenLogprobs>) -> Value {
    let entry = |id: u32, logprob: f32| {
        json!({"token": tokenizer.token_text(id), "logprob": logprob_value(logprob),
            "bytes": tokenizer.token_bytes(id)})
    };
    let Some(lp) = logprobs else {
        return json!(null);
    };
    let mut value = entry(id, lp.logprob);
    value["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
    value
}

/// Server-sent events from batches of JSON objects, then `[DONE]`.
pub(crate) fn sse_with_done(
    batches: impl Stream<Item = Vec<Value>> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    batches
        .flat_map(stream::iter)
        .map(|value| Event::default().data(value.to_string()))
        .chain(stream::once(async { Event::default().data("[DONE]") }))
        .map(Ok)
}

/// The completion as `chat.completion.chunk` events: the assistant role, one chunk per piece of
/// text (with its log-probabilities when asked), reasoning as `reasoning_content`, each tool call
/// whole in one `tool_calls` delta, the finish reason (`tool_calls` after calls), the usage when
/// asked (a last chunk with no choices), then `[DONE]`. An engine failure mid-stream sends an
/// error object in OpenAI's shape instead of the finish.
fn chat_chunks(
    running: Running,
    meta: Meta,
    tokenizer: Arc<Tokenizer>,
    include_usage: bool,
    mut answer: Answer,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    const OBJECT: &str = "chat.completion.chunk";
    let first = meta.chunk(
        OBJECT,
        json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
        None,
    );
    let delta_chunk = |meta: &Meta, delta: Value, logprobs: Option<Value>| {
        let mut choice = json!({"index": 0, "delta": delta, "finish_reason": null});
        if let Some(lp) = logprobs {
            choice["logprobs"] = lp;
        }
        meta.chunk(OBJECT, json!([choice]), None)
    };
    let rest = running.into_steps().filter_map(move |step| {
        let out = match step {
            Step::Token { text, logprobs, id } => {
                let mut logprobs = id
                    .zip(logprobs)
                    .map(|(id, lp)| json!({"content": [chat_logprob(&tokenizer, id, Some(&lp))]}));
                let calls_before = answer.calls;
                let outputs = answer.push(&text);
                let mut chunks = deltas(&meta.id, calls_before, outputs);
                if chunks.is_empty() && logprobs.is_some() {
                    chunks.push(json!({"content": ""}));
                }
                let chunks: Vec<Value> = chunks
                    .into_iter()
                    .map(|delta| delta_chunk(&meta, delta, logprobs.take()))
                    .collect();
                (!chunks.is_empty()).then_some(chunks)
            }
            Step::Done { reason, stats, .. } => {
                let calls_before = answer.calls;
                let outputs = answer.finish();
                let mut out: Vec<Value> = deltas(&meta.id, calls_before, outputs)
                    .into_iter()
                    .map(|delta| delta_chunk(&meta, delta, None))
                    .collect();
                let finish = if answer.calls > 0 {
                    "tool_calls"
                } else {
                    finish_reason(reason)
                };
                let choice = json!([{"index": 0, "delta": {}, "finish_reason": finish}]);
                out.push(meta.chunk(OBJECT, choice, None));
                if include_usage {
                    out.push(meta.chunk(OBJECT, json!([]), Some(usage(&stats))));
                }
                Some(out)
            }
            Step::Failed(error) => Some(vec![error.body()]),
        };
        std::future::ready(out)
    });
    sse_with_done(stream::once(async move { vec![first] }).chain(rest))
}

/// The `delta` objects of parsed output; calls are numbered from `calls_before`.
fn deltas(completion: &str, calls_before: usize, outputs: Vec<ToolOutput>) -> Vec<Value> {
    let mut index = calls_before;
    outputs
        .into_iter()
        .map(|output| match output {
            ToolOutput::Text(text) => json!({"content": text}),
            ToolOutput::Reasoning(text) => json!({"reasoning_content": text}),
            ToolOutput::Call(call) => {
                let mut call = tool_call_json(completion, index, &call);
                call["index"] = index.into();
                index += 1;
                json!({"tool_calls": [call]})
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use perch_engine::GenerationStats;

    use super::usage;

    /// `cut_for_memory` appears in `usage` only when the engine cut the answer short.
    #[test]
    fn usage_says_when_an_answer_was_cut_for_memory() {
        let mut stats = GenerationStats {
            prompt_tokens: 7,
            generation_tokens: 3,
            ..Default::default()
        };
        let plain = usage(&stats);
        assert_eq!(plain["total_tokens"], 10);
        assert!(plain.get("cut_for_memory").is_none(), "{plain}");
        stats.cut_for_memory = true;
        assert_eq!(usage(&stats)["cut_for_memory"], true);
    }
}
