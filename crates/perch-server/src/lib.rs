//! Perch's local HTTP API: the loaded model served in OpenAI's wire format, so the tools people
//! already use (the official SDKs, editors, agents) reach the engine unchanged. The server is one
//! more client of [`EngineHandle`], like the app and the CLI: requests from every client are
//! batched together by the engine.
//!
//! Endpoints: OpenAI's (API reference, "Chat Completions", "Completions" and "Models")
//! `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions`; Anthropic's
//! `POST /v1/messages` and `POST /v1/messages/count_tokens`; streamed as server-sent events when
//! asked. With an API key set, every request must carry `Authorization: Bearer KEY` (OpenAI) or
//! `x-api-key: KEY` (Anthropic) or gets 401. Errors use OpenAI's shape,
//! `{"error": {"message", "type", "param", "code"}}`, and Anthropic's on its endpoints.
//!
//! A client that disconnects cancels its request in the engine (its KV blocks are freed at the
//! next step). At most [`ServerConfig::max_requests`] requests are in the engine at once; more
//! get 503 with `Retry-After` rather than an unbounded wait. Browsers may call it only from the
//! origins in [`ServerConfig::cors_origins`] (none by default).

mod anthropic;
mod completions;
mod error;
mod logprobs;
mod openai;
mod running;
mod tools;

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use axum::extract::{DefaultBodyLimit, FromRequestParts, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::http::{HeaderName, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use perch_engine::EngineHandle;
use tokio::net::TcpListener;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// The type of [`ServerConfig::cors_origins`].
pub use axum::http::HeaderValue;
pub use error::{AnthropicError, ApiError};
pub use openai::PENALTY_WINDOW;

/// What the server serves and who may ask.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// When set, requests without this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) get
    /// 401.
    pub api_key: Option<String>,
    /// Most requests this server keeps in the engine (running or queued) at once; more get 503
    /// with `Retry-After`.
    pub max_requests: usize,
    /// Origins a browser may call from (CORS); `*` allows any. Empty: no CORS headers at all.
    pub cors_origins: Vec<HeaderValue>,
    /// The live counts, shared with whoever shows them (the app's dashboard).
    pub activity: ServerActivity,
    /// Other names a request's `model` may give the served model (coding agents send their
    /// vendor's names, `claude-…`, `gpt-…`); `GET /v1/models` lists them beside its id.
    pub model_aliases: Vec<String>,
    /// Any `model` names the served model (a server with one model, for clients that insist on
    /// their own names).
    pub any_model_name: bool,
    /// Tokens a draft model proposes per step, when the engine has one
    /// ([`EngineHandle::has_draft_model`]) and a request does not say (its `num_draft_tokens`,
    /// mlx_lm's server extension; 0 turns speculative decoding off for it).
    pub num_draft_tokens: usize,
    /// The log's line for a prompt that diverged from its client's previous one shows a few
    /// tokens of text of each side there (off by default: no prompt text goes to the log).
    pub log_prompt_text: bool,
}

impl ServerConfig {
    /// Requests in the engine at once unless told otherwise: enough for agents and editors in
    /// parallel, bounded so a runaway client cannot queue without end.
    pub const DEFAULT_MAX_REQUESTS: usize = 256;

    /// No key, the default request limit and no CORS.
    pub fn new() -> Self {
        Self {
            api_key: None,
            max_requests: Self::DEFAULT_MAX_REQUESTS,
            cors_origins: Vec::new(),
            activity: ServerActivity::default(),
            model_aliases: Vec::new(),
            any_model_name: false,
            num_draft_tokens: perch_engine::Draft::DEFAULT_NUM_DRAFT_TOKENS,
            log_prompt_text: false,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The model a server serves: one engine for its whole life (`perch serve`), or whichever the
/// app has loaded, replaced as the user loads another ([`ServedModel::replace`]). While none
/// is loaded, `GET /v1/models` lists nothing and requests for a model get 503.
#[derive(Clone, Default)]
pub struct ServedModel(Arc<RwLock<Option<Served>>>);

/// An engine and the id clients name it by (`model` in requests, `GET /v1/models`).
#[derive(Clone)]
pub struct Served {
    pub engine: EngineHandle,
    pub model_id: String,
}

impl ServedModel {
    /// Serves `engine` as `model_id`.
    pub fn new(engine: EngineHandle, model_id: impl Into<String>) -> Self {
        let served = Self::default();
        served.replace(Some(Served {
            engine,
            model_id: model_id.into(),
        }));
        served
    }

    /// Serves `model` from now on (`None`: nothing); requests already running finish on the
    /// engine they started on.
    pub fn replace(&self, model: Option<Served>) {
        // A poisoned lock only means a writer panicked; the value is still whole.
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = model;
    }

    /// What is served now.
    pub fn current(&self) -> Option<Served> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Live counts of a server, cheap to clone and read from any thread.
#[derive(Clone, Debug, Default)]
pub struct ServerActivity {
    in_flight: Arc<AtomicUsize>,
    served: Arc<AtomicU64>,
}

impl ServerActivity {
    /// Requests in the engine now (running or queued).
    pub fn requests(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests admitted since the server started.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// Counts a request in while it lives, or the 503 when `limit` are in already.
    fn admit(&self, limit: usize) -> Result<Admitted, ApiError> {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| ApiError::overloaded(limit))?;
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(Admitted(self.clone()))
    }
}

/// One admitted request; counted out when dropped.
pub(crate) struct Admitted(ServerActivity);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The router's state: what is served and how.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) served: ServedModel,
    config: Arc<ServerConfig>,
}

/// What one request works with: the engine served when it arrived (it keeps that engine to its
/// end, even if the app loads another meanwhile).
#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    model_id: String,
    config: Arc<ServerConfig>,
    /// The lane the request's [`PRIORITY_HEADER`] asks for, if it names one.
    lane: Option<perch_engine::Priority>,
    /// Who sent it ([`client_of`]).
    client: String,
}

/// Names the sender of a request, to compare its prompt with the same client's previous one
/// (a prefix-cache miss explained, [`perch_engine::GenerateRequest::client`]): its
/// `User-Agent` (at most 64 characters) and, when it carries a key, the key's fingerprint (the
/// first 8 hex digits of its SHA-256; never the key).
fn client_of(headers: &axum::http::HeaderMap) -> String {
    use sha2::{Digest, Sha256};
    let agent = headers
        .get(axum::http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.chars().take(64).collect::<String>())
        .unwrap_or_else(|| "a client without User-Agent".to_owned());
    let key = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim_start_matches("Bearer ").trim())
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    match key.filter(|k| !k.is_empty()) {
        Some(key) => {
            let digest = Sha256::digest(key.as_bytes());
            let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
            format!("{agent} (key {hex})")
        }
        None => agent,
    }
}

/// The response header that says what a request's prompt read from the prefix cache:
/// `cached=N; prompt=M`, then `; miss=REASON` (and `; at=TOKEN` where the hit stopped) when
/// fewer tokens came from the cache than could have ([`perch_engine::CacheMiss`]).
pub const PROMPT_CACHE_HEADER: &str = "x-perch-prompt-cache";

/// The header that puts a request in a lane (`high`, `normal`, `low`; see
/// [`perch_engine::Priority`]) unless its body's `priority` asks for high or low: how an agent
/// whose requests the user cannot edit (Claude Code's `ANTHROPIC_CUSTOM_HEADERS`) is sent to the
/// background.
pub const PRIORITY_HEADER: &str = "x-perch-priority";

impl AppState {
    fn admit(&self) -> Result<Admitted, ApiError> {
        self.config.activity.admit(self.config.max_requests)
    }

    /// The names requests may give the served model.
    fn served_name(&self) -> ServedName<'_> {
        ServedName {
            id: &self.model_id,
            aliases: &self.config.model_aliases,
            any: self.config.any_model_name,
        }
    }
}

/// The served model's id and the other names a request's `model` may give it
/// ([`ServerConfig::model_aliases`], [`ServerConfig::any_model_name`]).
#[derive(Clone, Copy)]
pub(crate) struct ServedName<'a> {
    pub(crate) id: &'a str,
    aliases: &'a [String],
    any: bool,
}

impl ServedName<'_> {
    /// `Ok` when `asked` names the served model, else the 404 naming it.
    pub(crate) fn check(&self, asked: &str) -> Result<(), ApiError> {
        match self.any || asked == self.id || self.aliases.iter().any(|a| a == asked) {
            true => Ok(()),
            false => Err(ApiError::unknown_model(asked, self.id)),
        }
    }
}

impl FromRequestParts<Shared> for AppState {
    type Rejection = Response;

    /// 503 in the endpoint's error shape while no model is loaded.
    async fn from_request_parts(parts: &mut Parts, shared: &Shared) -> Result<Self, Response> {
        let lane = match parts.headers.get(PRIORITY_HEADER) {
            None => None,
            Some(value) => {
                let lane = value
                    .to_str()
                    .ok()
                    .and_then(perch_engine::Priority::from_name);
                let Some(lane) = lane else {
                    let message = format!(
                        "the {PRIORITY_HEADER} header must be high, normal or low, not {value:?}"
                    );
                    return Err(in_shape_of(
                        parts.uri.path(),
                        ApiError::invalid(message, None),
                    ));
                };
                Some(lane)
            }
        };
        match shared.served.current() {
            Some(Served { engine, model_id }) => Ok(AppState {
                engine,
                model_id,
                config: Arc::clone(&shared.config),
                lane,
                client: client_of(&parts.headers),
            }),
            None => Err(in_shape_of(parts.uri.path(), ApiError::no_model())),
        }
    }
}

/// `error` as the endpoint at `path` reports errors: Anthropic's shape on `/v1/messages*`,
/// OpenAI's elsewhere.
fn in_shape_of(path: &str, error: ApiError) -> Response {
    if path.starts_with("/v1/messages") {
        AnthropicError(error).into_response()
    } else {
        error.into_response()
    }
}

/// The largest request body read, in bytes: room for a few images at their largest (20 MB
/// each, a third more as base64) beside the text; axum's default (2 MB) would refuse a phone's
/// photo.
pub const MAX_BODY_BYTES: usize = 96 << 20;

/// The API's routes over `served`, to serve with [`serve`] (or any axum server).
pub fn router(served: ServedModel, config: ServerConfig) -> Router {
    let cors = cors(&config.cors_origins);
    let state = Shared {
        served,
        config: Arc::new(config),
    };
    let routes = Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route(
            "/v1/next_token_logprobs",
            post(logprobs::next_token_logprobs),
        )
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state);
    // Outermost, so a browser's preflight (which carries no key) is answered here.
    match cors {
        Some(cors) => routes.layer(cors),
        None => routes,
    }
}

/// The CORS layer for `origins`, or none when there are none.
fn cors(origins: &[HeaderValue]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().cloned())
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers([
                AUTHORIZATION,
                CONTENT_TYPE,
                HeaderName::from_static("x-api-key"),
                HeaderName::from_static("anthropic-version"),
                HeaderName::from_static(PRIORITY_HEADER),
            ])
            .expose_headers([HeaderName::from_static(PROMPT_CACHE_HEADER)]),
    )
}

/// Serves `router` on `listener` until the process ends or the listener fails.
pub async fn serve(listener: TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).await
}

/// [`serve`] until `shutdown` completes; then new connections are refused and the call returns
/// once open requests have ended (a streamed one ends as its client reads it out or goes away).
pub async fn serve_until(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Rejects requests without the configured API key.
async fn authorize(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let header = |name| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let bearer = header(AUTHORIZATION.as_str())
            .and_then(|v| v.strip_prefix("Bearer ").map(str::to_owned));
        let presented = [bearer, header("x-api-key")];
        if !presented.iter().flatten().any(|p| same_key(p, key)) {
            return in_shape_of(request.uri().path(), ApiError::unauthorized());
        }
    }
    next.run(request).await
}

/// Compares keys in time that depends on their lengths only.
fn same_key(presented: &str, key: &str) -> bool {
    presented.len() == key.len()
        && presented
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}
