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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
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
    /// The model's id: what `GET /v1/models` lists and requests must name in `model`.
    pub model_id: String,
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
}

impl ServerConfig {
    /// Requests in the engine at once unless told otherwise: enough for agents and editors in
    /// parallel, bounded so a runaway client cannot queue without end.
    pub const DEFAULT_MAX_REQUESTS: usize = 256;

    /// Serves `model_id` with no key, the default request limit and no CORS.
    pub fn new(model_id: impl Into<String>) -> Self {
        Self {
            model_id: model_id.into(),
            api_key: None,
            max_requests: Self::DEFAULT_MAX_REQUESTS,
            cors_origins: Vec::new(),
            activity: ServerActivity::default(),
        }
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

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    config: Arc<ServerConfig>,
}

impl AppState {
    fn admit(&self) -> Result<Admitted, ApiError> {
        self.config.activity.admit(self.config.max_requests)
    }
}

/// The API's routes over `engine`, to serve with [`serve`] (or any axum server).
pub fn router(engine: EngineHandle, config: ServerConfig) -> Router {
    let cors = cors(&config.cors_origins);
    let state = AppState {
        engine,
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
            ]),
    )
}

/// Serves `router` on `listener` until the process ends or the listener fails.
pub async fn serve(listener: TcpListener, router: Router) -> std::io::Result<()> {
    axum::serve(listener, router).await
}

/// Rejects requests without the configured API key.
async fn authorize(State(state): State<AppState>, request: Request, next: Next) -> Response {
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
            let error = ApiError::unauthorized();
            return if request.uri().path().starts_with("/v1/messages") {
                AnthropicError(error).into_response()
            } else {
                error.into_response()
            };
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
