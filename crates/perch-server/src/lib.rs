//! Perch's local HTTP API: the loaded model served in OpenAI's wire format, so the tools people
//! already use (the official SDKs, editors, agents) reach the engine unchanged. The server is one
//! more client of [`EngineHandle`], like the app and the CLI: requests from every client are
//! batched together by the engine.
//!
//! Endpoints (OpenAI's API reference, "Chat Completions", "Completions" and "Models"):
//! `GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/completions` (streamed as
//! server-sent events when asked). With an API key set,
//! every request must carry `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) or gets
//! 401. Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
//!
//! A client that disconnects cancels its request in the engine (its KV blocks are freed at the
//! next step).

mod anthropic;
mod completions;
mod error;
mod openai;
mod running;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use perch_engine::EngineHandle;
use tokio::net::TcpListener;

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
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    config: Arc<ServerConfig>,
}

/// The API's routes over `engine`, to serve with [`serve`] (or any axum server).
pub fn router(engine: EngineHandle, config: ServerConfig) -> Router {
    let state = AppState {
        engine,
        config: Arc::new(config),
    };
    Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        .with_state(state)
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
