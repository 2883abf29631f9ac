//! A request running in the engine as the wire formats see it: its events moved into async code,
//! refusals turned into 400s, and a cancel in the engine when the client goes away.

use futures_util::stream::{self, Stream};
use perch_engine::RequestId;
use perch_engine::{
    CacheMiss, EngineEvent, EngineHandle, EngineRequest, FinishReason, GenerationStats,
    PromptCacheReport, TokenLogprobs,
};
use tokio::sync::mpsc;

use axum::http::HeaderValue;
use axum::response::Response;

use crate::error::ApiError;
use crate::{Admitted, AppState, PROMPT_CACHE_HEADER};

/// `response` with `header` as its [`PROMPT_CACHE_HEADER`], when there is one.
pub(crate) fn with_header(mut response: Response, header: Option<HeaderValue>) -> Response {
    if let Some(value) = header {
        response.headers_mut().insert(PROMPT_CACHE_HEADER, value);
    }
    response
}

/// The [`PROMPT_CACHE_HEADER`]'s value for `report`.
fn header_value(report: &PromptCacheReport) -> String {
    let mut value = format!(
        "cached={}; prompt={}",
        report.cached_tokens, report.prompt_tokens
    );
    if let Some(miss) = &report.miss {
        value.push_str(&format!("; miss={}", miss.name()));
        if let Some(at) = miss.at_token() {
            value.push_str(&format!("; at={at}"));
        }
    }
    value
}

/// `perch serve`'s log line for a request's prompt-cache lookup: the client, the tokens read
/// and, for a miss, why (with a few tokens of text of both sides where the prompt diverged,
/// only when [`crate::ServerConfig::log_prompt_text`] is on).
fn log_prompt_cache(state: &AppState, report: &PromptCacheReport) {
    let client = &state.client;
    let (cached, prompt) = (report.cached_tokens, report.prompt_tokens);
    let Some(miss) = &report.miss else {
        tracing::info!("{client}: {cached} of {prompt} prompt tokens from the prefix cache");
        return;
    };
    let mut line =
        format!("{client}: {cached} of {prompt} prompt tokens from the prefix cache; {miss}");
    if let CacheMiss::Diverged {
        tokens,
        previous_tokens,
        ..
    } = miss
    {
        if state.config.log_prompt_text {
            let tokenizer = state.engine.tokenizer();
            let text = |ids: &[u32]| tokenizer.decode(ids).unwrap_or_default();
            line.push_str(&format!(
                " (now {:?}, before {:?})",
                text(tokens),
                text(previous_tokens)
            ));
        }
    }
    tracing::info!("{line}");
}

/// What a running request produces next, as every wire format needs it.
pub(crate) enum Step {
    /// Generated text (possibly empty), with the token it came from (`None` for text held back
    /// until the end) and the token's log-probabilities when asked.
    Token {
        id: Option<u32>,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended normally (stop, length, cancelled); `stop_string` is the request's
    /// stop string that ended it, when one did.
    Done {
        reason: FinishReason,
        stats: GenerationStats,
        stop_string: Option<String>,
        /// A next-token-logprobs call's answer.
        next_token_logprobs: Option<Vec<f32>>,
    },
    /// The engine failed while running the request (a 500 before a stream starts, an error
    /// event within one).
    Failed(ApiError),
}

/// A whole completion, gathered by [`Running::collect`].
pub(crate) struct Generated {
    pub text: String,
    /// Each generated token with its log-probabilities (when asked).
    pub tokens: Vec<(u32, Option<TokenLogprobs>)>,
    pub reason: FinishReason,
    pub stop_string: Option<String>,
    pub stats: GenerationStats,
    pub next_token_logprobs: Option<Vec<f32>>,
}

/// A request in the engine, its events forwarded to async code; cancelled in the engine when
/// dropped before its end (the client went away).
pub(crate) struct Running {
    pub id: RequestId,
    engine: EngineHandle,
    events: mpsc::UnboundedReceiver<EngineEvent>,
    /// An event read ahead by [`Running::start`], handed out first.
    peeked: Option<EngineEvent>,
    finished: bool,
    /// [`Running::step`] has handed out the end.
    ended: bool,
    /// What its prompt read from the prefix cache, once the batch admitted it.
    pub prompt_cache: Option<PromptCacheReport>,
    /// Counts this request among the server's until it is dropped.
    _admitted: Admitted,
}

impl Running {
    /// Submits `request` and waits for its first event: a request the engine refuses (a prompt
    /// longer than the context, …) is the client's error, a 400 with the engine's message (which
    /// names what is wrong, e.g. both lengths) before any stream starts. A 503 when the server
    /// already has as many requests in the engine as it admits.
    pub async fn start(state: &AppState, mut request: EngineRequest) -> Result<Self, ApiError> {
        let admitted = state.admit()?;
        let engine = &state.engine;
        // The header's lane, unless the body asked for another.
        if let Some(lane) = state.lane {
            if request.params.priority == perch_engine::Priority::Normal {
                request.params.priority = lane;
            }
        }
        if request.params.client.is_none() {
            request.params.client = Some(state.client.clone());
        }
        // A `prompt_cache_key` is the client's own: two clients choosing the same key do not
        // replace each other's pins.
        for pin in &mut request.params.cache_pins {
            if let Some(key) = &mut pin.key {
                *key = format!("{}\n{key}", state.client);
            }
        }
        request.params.num_draft_tokens = draft_tokens(
            &request,
            engine.has_draft_model(),
            state.config.num_draft_tokens,
        );
        // Other clients of the engine (the app's chat) fill its queue too: 503, as the server's
        // own limit.
        let stream = engine
            .submit(request)
            .map_err(|e| ApiError::from(&e.to_request_error()))?;
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
        let mut running = Self {
            id: stream.id,
            engine: engine.clone(),
            events,
            peeked: None,
            finished: false,
            ended: false,
            prompt_cache: None,
            _admitted: admitted,
        };
        let first = running.event().await;
        // A request that fails before anything streamed is answered with its error's status.
        if let Some(EngineEvent::Finished {
            error: Some(error), ..
        }) = &first
        {
            return Err(ApiError::from(error));
        }
        running.peeked = first;
        if let Some(report) = &running.prompt_cache {
            log_prompt_cache(state, report);
        }
        Ok(running)
    }

    /// The [`PROMPT_CACHE_HEADER`] of this request, when the batch admitted it.
    pub fn cache_header(&self) -> Option<HeaderValue> {
        let value = header_value(self.prompt_cache.as_ref()?);
        HeaderValue::from_str(&value).ok()
    }

    /// The next token or end ([`EngineEvent::Admitted`] is kept in `prompt_cache`).
    async fn event(&mut self) -> Option<EngineEvent> {
        if let Some(event) = self.peeked.take() {
            return Some(event);
        }
        loop {
            let event = self.events.recv().await;
            match event {
                Some(EngineEvent::Admitted { prompt_cache }) => {
                    self.prompt_cache = Some(prompt_cache);
                    continue;
                }
                Some(EngineEvent::Finished { .. }) | None => self.finished = true,
                Some(EngineEvent::Token { .. }) => {}
            }
            return event;
        }
    }

    /// The next step; `None` once the request has ended.
    pub async fn step(&mut self) -> Option<Step> {
        if self.ended {
            return None;
        }
        let step = match self.event().await {
            Some(EngineEvent::Token { id, text, logprobs }) => Step::Token { id, text, logprobs },
            Some(EngineEvent::Admitted { .. }) => unreachable!("kept by `event`"),
            Some(EngineEvent::Finished {
                finish_reason: FinishReason::Error,
                error,
                ..
            }) => Step::Failed(match &error {
                Some(error) => ApiError::from(error),
                None => ApiError::engine("generation failed"),
            }),
            Some(EngineEvent::Finished {
                finish_reason,
                stats,
                stop_string,
                next_token_logprobs,
                ..
            }) => Step::Done {
                reason: finish_reason,
                stats,
                stop_string,
                next_token_logprobs,
            },
            None => Step::Failed(ApiError::engine(
                "the engine stopped before the request ended",
            )),
        };
        self.ended = !matches!(step, Step::Token { .. });
        Some(step)
    }

    /// The steps as a stream, ending after the request's end; dropping it cancels the request.
    pub fn into_steps(self) -> impl Stream<Item = Step> + Send + 'static {
        stream::unfold(self, |mut running| async move {
            running.step().await.map(|step| (step, running))
        })
    }

    /// Waits for the whole completion.
    pub async fn collect(mut self) -> Result<Generated, ApiError> {
        let mut text = String::new();
        let mut tokens = Vec::new();
        while let Some(step) = self.step().await {
            match step {
                Step::Token {
                    id,
                    text: piece,
                    logprobs,
                } => {
                    text.push_str(&piece);
                    tokens.extend(id.map(|id| (id, logprobs)));
                }
                Step::Done {
                    reason,
                    stats,
                    stop_string,
                    next_token_logprobs,
                } => {
                    return Ok(Generated {
                        text,
                        tokens,
                        reason,
                        stop_string,
                        stats,
                        next_token_logprobs,
                    })
                }
                Step::Failed(error) => return Err(error),
            }
        }
        Err(ApiError::engine(
            "the engine stopped before the request ended",
        ))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            self.engine.cancel(self.id);
        }
    }
}

/// How many tokens a draft proposes for `request`: what it asked (`Some(0)`: none), else the
/// server's default when the engine has a draft; none for what speculative decoding does not
/// run (a response format, next-token log-probabilities, images, a prompt cache) unless asked
/// for.
fn draft_tokens(request: &EngineRequest, has_draft: bool, default: usize) -> Option<usize> {
    let params = &request.params;
    match params.num_draft_tokens {
        Some(0) => None,
        Some(n) => Some(n),
        None if !has_draft || default == 0 => None,
        None => {
            let speculative = params.grammar.is_none()
                && !params.next_token_logprobs
                && params.images.is_empty()
                && !matches!(request.prompt, perch_engine::Prompt::AfterCache { .. });
            speculative.then_some(default)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use perch_engine::{GenerateRequest, Prompt};

    #[test]
    fn requests_speculate_by_default_when_a_draft_is_loaded() {
        let request = |n: Option<usize>, scoring: bool| {
            let mut params = GenerateRequest::new(Vec::new());
            params.num_draft_tokens = n;
            params.next_token_logprobs = scoring;
            EngineRequest {
                prompt: Prompt::Tokens(vec![1]),
                params,
            }
        };
        assert_eq!(draft_tokens(&request(None, false), true, 3), Some(3));
        assert_eq!(draft_tokens(&request(None, false), false, 3), None);
        assert_eq!(draft_tokens(&request(Some(5), false), true, 3), Some(5));
        assert_eq!(draft_tokens(&request(Some(0), false), true, 3), None);
        assert_eq!(draft_tokens(&request(None, true), true, 3), None);
        // Asked without a draft: the engine refuses it with its reason.
        assert_eq!(draft_tokens(&request(Some(2), false), false, 3), Some(2));
        // A request with images runs in the batch, without the draft.
        let mut with_image = request(None, false);
        with_image.params.images =
            vec![perch_engine::ImageInput::new(vec![0.0; 12], [2, 2, 3]).unwrap()];
        assert_eq!(draft_tokens(&with_image, true, 3), None);
    }
}
