//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP
//! status OpenAI uses for the same failure.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An error answer: status, OpenAI error type, message, and the parameter and code when known.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
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
        }
    }

    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            message: "missing or wrong API key: send `Authorization: Bearer KEY`".into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
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
        }
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
