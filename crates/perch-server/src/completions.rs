//! OpenAI's legacy Completions endpoint (<https://platform.openai.com/docs/api-reference/completions>):
//! raw text or token ids in, text out, no chat template.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::future::try_join_all;
use futures_util::stream::{Stream, StreamExt};
use perch_engine::{
    EngineHandle, EngineRequest, GenerateRequest, GenerationStats, Prompt, TokenLogprobs, Tokenizer,
};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::logprobs::top_k;
use crate::openai::{
    finish_reason, logprob_value, max_tokens, sse_with_done, usage, Meta, Sampling,
};
use crate::running::{with_header, Running, Step};
use crate::{AppState, ServedName};

/// The request body of `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    #[serde(flatten)]
    sampling: Sampling,
    prompt: PromptInput,
    max_tokens: Option<usize>,
    /// Return the prompt before the completion.
    #[serde(default)]
    echo: bool,
    /// Each generated token's log-probability and those of the `logprobs` most likely
    /// alternatives (0..=20); with `echo`, the prompt's tokens' too.
    logprobs: Option<usize>,
    suffix: Option<String>,
    best_of: Option<usize>,
}

/// `prompt`: a string, token ids, or a list of either (one choice each).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
    Texts(Vec<String>),
}

/// OpenAI's default for this endpoint.
const DEFAULT_MAX_TOKENS: usize = 16;
const MAX_LOGPROBS: usize = 20;

/// One prompt of the request, as text (echoed back) and token ids.
struct OnePrompt {
    text: String,
    ids: Vec<u32>,
}

impl CompletionRequest {
    /// The prompts tokenized (text with the tokenizer's special tokens, as mlx_lm.server does)
    /// and the shared generation settings, or the 400/404 naming the parameter at fault.
    fn prepare(
        &self,
        served: ServedName<'_>,
        tokenizer: &Tokenizer,
    ) -> Result<(Vec<OnePrompt>, GenerateRequest), ApiError> {
        let mut params = GenerateRequest::new(Vec::new());
        self.sampling.apply(served, &mut params)?;
        params.max_tokens = max_tokens(self.max_tokens, DEFAULT_MAX_TOKENS)?;
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                "`suffix` (insertion) is not supported",
                Some("suffix"),
            ));
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "only best_of = 1 is supported",
                Some("best_of"),
            ));
        }
        match self.logprobs {
            Some(n) if n > MAX_LOGPROBS => {
                return Err(ApiError::invalid(
                    format!("`logprobs` must be between 0 and {MAX_LOGPROBS}"),
                    Some("logprobs"),
                ))
            }
            n => params.logprobs = n,
        }
        let tokenize = |text: &String| -> Result<OnePrompt, ApiError> {
            let ids = tokenizer
                .encode(text, true)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
            Ok(OnePrompt {
                text: text.clone(),
                ids,
            })
        };
        let from_ids = |ids: &Vec<u32>| OnePrompt {
            text: tokenizer.decode(ids).unwrap_or_default(),
            ids: ids.clone(),
        };
        let prompts = match &self.prompt {
            PromptInput::Text(text) => vec![tokenize(text)?],
            PromptInput::Texts(texts) => texts.iter().map(tokenize).collect::<Result<_, _>>()?,
            PromptInput::Ids(ids) => vec![from_ids(ids)],
            PromptInput::IdLists(lists) => lists.iter().map(from_ids).collect(),
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid(
                "`prompt` must hold at least one prompt",
                Some("prompt"),
            ));
        }
        if self.sampling.stream && prompts.len() > 1 {
            return Err(ApiError::invalid(
                "a streamed request takes one prompt",
                Some("prompt"),
            ));
        }
        Ok((prompts, params))
    }
}

/// `POST /v1/completions`: every prompt of the request runs in the engine at once (batched),
/// one choice each.
pub(crate) async fn completions(
    state: AppState,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::invalid(e.body_text(), None))?;
    let tokenizer = Arc::clone(state.engine.tokenizer());
    let (prompts, params) = request.prepare(state.served_name(), &tokenizer)?;
    // `echo` with `logprobs`: the prompt's own tokens are scored first.
    let mut scored_prompts = Vec::new();
    if let (true, Some(top)) = (request.echo, request.logprobs) {
        for prompt in &prompts {
            scored_prompts.push(prompt_logprobs(&state, &prompt.ids, top).await?);
        }
    }
    let started = try_join_all(prompts.iter().map(|prompt| {
        let mut params = params.clone();
        params.prompt = prompt.ids.clone();
        Running::start(
            &state,
            EngineRequest {
                prompt: Prompt::Tokens(prompt.ids.clone()),
                params,
            },
        )
    }))
    .await?;
    let meta = Meta::new(format!("cmpl-{}", started[0].id), &state.model_id);
    // The first prompt's lookup (a request of several prompts has one header).
    let cache_header = started[0].cache_header();
    let echo = |prompt: &OnePrompt| {
        if request.echo {
            prompt.text.clone()
        } else {
            String::new()
        }
    };
    if request.sampling.stream {
        let (running, prompt) = started.into_iter().zip(prompts).next().expect("one prompt");
        let echoed = echo(&prompt);
        let echoed_logprobs = scored_prompts.first().map(|scored| {
            let mut logprobs = LegacyLogprobs::new(0);
            for (id, lp) in scored {
                logprobs.push(&tokenizer, *id, lp.as_ref());
            }
            logprobs
        });
        let events = text_chunks(
            running,
            meta,
            tokenizer,
            (echoed, echoed_logprobs),
            request.sampling.include_usage(),
        );
        return Ok(with_header(Sse::new(events).into_response(), cache_header));
    }
    let done = try_join_all(started.into_iter().map(Running::collect)).await?;
    let mut total = GenerationStats::default();
    let choices: Vec<Value> = done
        .iter()
        .zip(&prompts)
        .enumerate()
        .map(|(index, (done, prompt))| {
            total.prompt_tokens += done.stats.prompt_tokens;
            total.cached_prompt_tokens += done.stats.cached_prompt_tokens;
            total.generation_tokens += done.stats.generation_tokens;
            total.cut_for_memory |= done.stats.cut_for_memory;
            let echoed = echo(prompt);
            let logprobs = request.logprobs.map(|_| {
                let mut logprobs = LegacyLogprobs::new(0);
                match scored_prompts.get(index) {
                    Some(scored) => {
                        for (id, lp) in scored {
                            logprobs.push(&tokenizer, *id, lp.as_ref());
                        }
                    }
                    None => logprobs.offset = echoed.chars().count(),
                }
                for (id, lp) in &done.tokens {
                    logprobs.push(&tokenizer, *id, lp.as_ref());
                }
                logprobs.into_json()
            });
            json!({
                "index": index,
                "text": echoed + &done.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(done.reason),
            })
        })
        .collect();
    Ok(Json(json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": usage(&total),
    }))
    .into_response())
    .map(|response| with_header(response, cache_header))
}

/// Prompt tokens scored at once while echoing a prompt with its log-probabilities.
const SCORING_WINDOW: usize = 32;

/// The tokens of `ids` with their log-probabilities given the tokens before them (the first has
/// none) and the `top` most likely alternatives: each prefix's next-token distribution from the
/// engine, a window of prefixes at a time (each extends the one before, so the engine computes
/// about a token per prefix).
async fn prompt_logprobs(
    state: &AppState,
    ids: &[u32],
    top: usize,
) -> Result<Vec<(u32, Option<TokenLogprobs>)>, ApiError> {
    let mut scored = vec![(ids[0], None)];
    let positions: Vec<usize> = (1..ids.len()).collect();
    for window in positions.chunks(SCORING_WINDOW) {
        let started = try_join_all(
            window
                .iter()
                .map(|&i| Running::start(state, EngineHandle::scoring_request(ids[..i].to_vec()))),
        )
        .await?;
        let answers = try_join_all(started.into_iter().map(Running::collect)).await?;
        for (&i, answer) in window.iter().zip(answers) {
            let distribution = answer
                .next_token_logprobs
                .ok_or_else(|| ApiError::engine("the engine returned no distribution"))?;
            let logprobs = TokenLogprobs {
                logprob: distribution[ids[i] as usize],
                top: top_k(&distribution, top)
                    .into_iter()
                    .map(|id| (id as u32, distribution[id]))
                    .collect(),
            };
            scored.push((ids[i], Some(logprobs)));
        }
    }
    Ok(scored)
}

/// The Completions endpoint's `logprobs` object: parallel lists of tokens, their
/// log-probabilities, the alternatives (token text → log-probability) and each token's offset
/// in the choice's text (in characters, as Python indexes strings, the echoed prompt included).
/// An echoed prompt's first token has no log-probability (`null`).
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<Value>>,
    text_offset: Vec<usize>,
    offset: usize,
}

impl LegacyLogprobs {
    fn new(offset: usize) -> Self {
        Self {
            tokens: Vec::new(),
            token_logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            text_offset: Vec::new(),
            offset,
        }
    }

    fn push(&mut self, tokenizer: &Tokenizer, id: u32, logprobs: Option<&TokenLogprobs>) {
        let token = tokenizer.token_text(id);
        self.text_offset.push(self.offset);
        self.offset += token.chars().count();
        self.token_logprobs
            .push(logprobs.map(|lp| logprob_value(lp.logprob)));
        self.top_logprobs.push(logprobs.map(|lp| {
            let top: Map<String, Value> = lp
                .top
                .iter()
                .map(|&(t, l)| (tokenizer.token_text(t), json!(logprob_value(l))))
                .collect();
            Value::Object(top)
        }));
        self.tokens.push(token);
    }

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// The completion as `text_completion` chunks: the echoed prompt first when asked, one chunk per
/// piece of text (its token's log-probabilities when asked), the finish reason, the usage when
/// asked (a last chunk with no choices), then `[DONE]`.
fn text_chunks(
    running: Running,
    meta: Meta,
    tokenizer: Arc<Tokenizer>,
    (echoed, echoed_logprobs): (String, Option<LegacyLogprobs>),
    include_usage: bool,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    const OBJECT: &str = "text_completion";
    let choice = |text: &str, logprobs: Option<Value>, finish: Option<&str>| json!([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]);
    let mut offset = echoed.chars().count();
    if let Some(scored) = &echoed_logprobs {
        offset = scored.offset;
    }
    let echoed_logprobs = echoed_logprobs.map(LegacyLogprobs::into_json);
    let first = (!echoed.is_empty())
        .then(|| meta.chunk(OBJECT, choice(&echoed, echoed_logprobs, None), None));
    let rest = running.into_steps().filter_map(move |step| {
        let out = match step {
            Step::Token { id, text, logprobs } => {
                let logprobs = id.zip(logprobs).map(|(id, lp)| {
                    let mut one = LegacyLogprobs::new(offset);
                    one.push(&tokenizer, id, Some(&lp));
                    offset = one.offset;
                    one.into_json()
                });
                (!text.is_empty() || logprobs.is_some())
                    .then(|| vec![meta.chunk(OBJECT, choice(&text, logprobs, None), None)])
            }
            Step::Done { reason, stats, .. } => {
                let mut out =
                    vec![meta.chunk(OBJECT, choice("", None, Some(finish_reason(reason))), None)];
                if include_usage {
                    out.push(meta.chunk(OBJECT, json!([]), Some(usage(&stats))));
                }
                Some(out)
            }
            Step::Failed(error) => Some(vec![error.body()]),
        };
        std::future::ready(out)
    });
    sse_with_done(futures_util::stream::iter(first.map(|f| vec![f])).chain(rest))
}
