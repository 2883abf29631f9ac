//! Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, or in
//! Anthropic's, `{"type": "error", "error": {"type", "message"}}` (for `/v1/messages`), with the
//! HTTP status each uses for the same failure.

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use perch_engine::api::{ErrorKind, RequestError};
use serde_json::json;

/// An error answer: status, OpenAI error type, message, and the parameter and code when known.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before trying again (sent as `Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 400 `invalid_request_error`, naming the parameter at fault when there is one.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
            retry_after: None,
        }
    }

    /// `value` (or `default` when absent) if within `low..=high`, else the 400 naming `param`.
    pub fn in_range(
        value: Option<f32>,
        default: f32,
        (low, high): (f32, f32),
        param: &'static str,
    ) -> Result<f32, Self> {
        let value = value.unwrap_or(default);
        if (low..=high).contains(&value) {
            Ok(value)
        } else {
            Err(Self::invalid(
                format!("`{param}` must be between {low} and {high}"),
                Some(param),
            ))
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message:
                "missing or wrong API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`"
                    .into(),
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 404 for a `model` this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        Self {
            param: Some("model"),
            code: Some("model_not_found"),
            ..Self::not_found(format!(
                "the model `{asked}` does not exist here; this server serves `{served}`"
            ))
        }
    }

    /// 500 `server_error`: the engine failed.
    pub fn engine(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 503: the app serves the model it has loaded, and none is loaded now.
    pub fn no_model() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: "no model is loaded in Perch; load one in the app and retry".into(),
            param: None,
            code: Some("model_not_loaded"),
            retry_after: None,
        }
    }

    /// 503 with `Retry-After`: the server already has as many requests in the engine as it
    /// admits, so this one is turned away now instead of waiting without bound.
    pub fn overloaded(limit: usize) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            message: format!(
                "the server is busy: {limit} requests are already running or queued; retry shortly"
            ),
            param: None,
            code: Some("overloaded"),
            retry_after: Some(1),
        }
    }

    /// The status, `Retry-After` when set, and `body` as JSON.
    fn respond(&self, body: serde_json::Value) -> Response {
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }

    /// The error object, as a response body or a stream's error event carries it.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// The one place an engine error becomes an HTTP answer: the status, OpenAI's error type and
/// code for its kind (Anthropic's type follows from the status, [`AnthropicError`]).
impl From<&RequestError> for ApiError {
    fn from(error: &RequestError) -> Self {
        let message = error.message.clone();
        match error.kind {
            ErrorKind::ContextLengthExceeded => Self {
                code: Some("context_length_exceeded"),
                ..Self::invalid(message, None)
            },
            ErrorKind::InvalidRequest => Self::invalid(message, None),
            ErrorKind::Overloaded => Self {
                message,
                ..Self::overloaded(0)
            },
            ErrorKind::Cancelled => Self {
                status: StatusCode::from_u16(499).expect("a valid status"),
                kind: "invalid_request_error",
                message,
                param: None,
                code: Some("cancelled"),
                retry_after: None,
            },
            ErrorKind::ModelNotLoaded => Self {
                message,
                ..Self::no_model()
            },
            ErrorKind::Internal => Self::engine(message),
        }
    }
}

/// The same error in Anthropic's shape (<https://docs.anthropic.com/en/api/errors>).
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(error: ApiError) -> Self {
        Self(error)
    }
}

impl AnthropicError {
    /// Anthropic's error type for the status.
    fn kind(&self) -> &'static str {
        match self.0.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// The error object, as a response body or a stream's `error` event carries it.
    pub fn body(&self) -> serde_json::Value {
        json!({"type": "error", "error": {"type": self.kind(), "message": self.0.message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        self.0.respond(self.body())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(self.body())
    }
}
