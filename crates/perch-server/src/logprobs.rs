//! `POST /v1/next_token_logprobs`: the model's next-token distribution after each of several
//! token sequences (genlm's `next_token_logprobs`, over HTTP). Not an OpenAI endpoint; its
//! errors use OpenAI's shape like the rest.
//!
//! Request: `{"token_ids": [[id, …], …], "top_k": K?, "model": ID?}`. Answer without `top_k`:
//! `{"object": "next_token_logprobs", "model", "shape": [n, vocab], "dtype": "float32",
//! "encoding": "base64", "data"}` where `data` is the base64 of the `[n, vocab]` natural-log
//! probabilities as little-endian float32, row by row. With `top_k`: `"top_logprobs"`, for
//! each sequence the `K` most likely tokens as `{"token_id", "token", "logprob"}`, most likely
//! first.

use axum::extract::rejection::JsonRejection;
use axum::Json;
use base64::Engine as _;
use futures_util::future::try_join_all;
use perch_engine::EngineHandle;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::openai::logprob_value;
use crate::running::Running;
use crate::AppState;

#[derive(Debug, Deserialize)]
pub(crate) struct NextTokenLogprobsRequest {
    token_ids: Vec<Vec<u32>>,
    top_k: Option<usize>,
    model: Option<String>,
}

/// Most sequences one request may score (each answer is `vocab` floats).
const MAX_SEQUENCES: usize = 256;

pub(crate) async fn next_token_logprobs(
    state: AppState,
    body: Result<Json<NextTokenLogprobsRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let Json(request) = body.map_err(|e| ApiError::invalid(e.body_text(), None))?;
    if let Some(model) = request.model.as_deref() {
        state.served_name().check(model)?;
    }
    let served = &state.model_id;
    if request.token_ids.is_empty() || request.token_ids.len() > MAX_SEQUENCES {
        return Err(ApiError::invalid(
            format!("`token_ids` must hold 1 to {MAX_SEQUENCES} token sequences"),
            Some("token_ids"),
        ));
    }
    // Every sequence is in the engine at once, so they share its steps.
    let started = try_join_all(
        request
            .token_ids
            .iter()
            .map(|ids| Running::start(&state, EngineHandle::scoring_request(ids.clone()))),
    )
    .await?;
    let answers = try_join_all(started.into_iter().map(Running::collect)).await?;
    let rows: Vec<Vec<f32>> = answers
        .into_iter()
        .map(|done| {
            done.next_token_logprobs
                .ok_or_else(|| ApiError::engine("the engine returned no distribution"))
        })
        .collect::<Result<_, _>>()?;
    let vocab = rows.first().map_or(0, Vec::len);
    if let Some(k) = request.top_k {
        let tokenizer = state.engine.tokenizer();
        let top: Vec<Value> = rows
            .iter()
            .map(|row| {
                top_k(row, k)
                    .into_iter()
                    .map(|id| {
                        json!({"token_id": id, "token": tokenizer.token_text(id as u32),
                               "logprob": logprob_value(row[id])})
                    })
                    .collect()
            })
            .collect();
        return Ok(Json(json!({
            "object": "next_token_logprobs",
            "model": served,
            "top_logprobs": top,
        })));
    }
    let bytes: Vec<u8> = rows
        .iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    Ok(Json(json!({
        "object": "next_token_logprobs",
        "model": served,
        "shape": [rows.len(), vocab],
        "dtype": "float32",
        "encoding": "base64",
        "data": base64::engine::general_purpose::STANDARD.encode(bytes),
    })))
}

/// The ids of the `k` largest values of `row`, largest first (ties: lower id first).
pub(crate) fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let by_value = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    let mut order: Vec<usize> = (0..row.len()).collect();
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_value);
    }
    order.truncate(k);
    order.sort_by(by_value);
    order
}
