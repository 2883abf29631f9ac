//! Sampling defaults for chats: the model's own (`generation_config.json`, as transformers reads
//! it) or, when the model names none, Perch's.
//!
//! Greedy decoding (mlx_lm's default, kept by `perch generate` and the engine's
//! [`SamplingParams::default`]) makes small models repeat themselves in open-ended chats, so the
//! app answers with these instead. Fields read from `generation_config.json`: `temperature`,
//! `top_p`, `top_k`, `min_p`, `repetition_penalty`, and `do_sample` (when `false`, transformers
//! decodes greedily and ignores the others; so does this: the model then names no sampling).
//! A model that names some of the five gets those, and the rest off (temperature 1 when it names
//! no temperature, as transformers).

use serde::Serialize;
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::sample::sampler::SamplingParams;

/// Perch's chat defaults, for models whose `generation_config.json` names no sampling: in the
/// range LM Studio and Ollama use (temperature 0.8, top-k 40, top-p 0.95 or 0.9, min-p 0.05,
/// repetition penalty 1.1 over the last 64 tokens).
pub const PERCH_TEMPERATURE: f32 = 0.8;
pub const PERCH_TOP_P: f32 = 0.95;
pub const PERCH_TOP_K: usize = 40;
pub const PERCH_MIN_P: f32 = 0.05;
pub const PERCH_REPETITION_PENALTY: f32 = 1.1;
pub const PERCH_REPETITION_CONTEXT_SIZE: usize = 64;

/// Where a chat's sampling values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SamplingDefaultsSource {
    /// The model's `generation_config.json`.
    Model,
    /// Perch's defaults ([`PERCH_TEMPERATURE`] …): the model names none.
    Perch,
}

/// The sampling values a chat uses unless the user sets its own.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    pub repetition_context_size: usize,
    pub source: SamplingDefaultsSource,
}

impl Default for SamplingDefaults {
    /// Perch's defaults.
    fn default() -> Self {
        Self {
            temperature: PERCH_TEMPERATURE,
            top_p: PERCH_TOP_P,
            top_k: PERCH_TOP_K,
            min_p: PERCH_MIN_P,
            repetition_penalty: PERCH_REPETITION_PENALTY,
            repetition_context_size: PERCH_REPETITION_CONTEXT_SIZE,
            source: SamplingDefaultsSource::Perch,
        }
    }
}

impl SamplingDefaults {
    /// Reads the sampling fields of a parsed `generation_config.json` (`None`: there is no
    /// such file). Errors: [`EngineError::Config`] naming `path` and the field, for a value of
    /// the wrong type or outside its domain (a negative or non-finite temperature, a `top_p` or
    /// `min_p` outside 0..=1, a negative `top_k`, a repetition penalty that is negative or not
    /// finite).
    pub fn from_generation_config(config: Option<&Value>, path: &std::path::Path) -> Result<Self> {
        let Some(config) = config else {
            return Ok(Self::default());
        };
        let invalid = |field: &str, why: &str| EngineError::Config {
            path: path.to_path_buf(),
            message: format!("`{field}` {why}"),
        };
        let float = |field: &str, max: Option<f32>| -> Result<Option<f32>> {
            match config.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => {
                    let x = v
                        .as_f64()
                        .ok_or_else(|| invalid(field, "must be a number"))?
                        as f32;
                    if !x.is_finite() || x < 0.0 || max.is_some_and(|m| x > m) {
                        let range = max.map_or("a finite number of at least 0".to_string(), |m| {
                            format!("between 0 and {m}")
                        });
                        return Err(invalid(field, &format!("must be {range}, got {v}")));
                    }
                    Ok(Some(x))
                }
            }
        };
        let temperature = float("temperature", None)?;
        let top_p = float("top_p", Some(1.0))?;
        let min_p = float("min_p", Some(1.0))?;
        let repetition_penalty = float("repetition_penalty", None)?;
        let top_k = match config.get("top_k") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|k| usize::try_from(k).ok())
                    .ok_or_else(|| {
                        invalid(
                            "top_k",
                            &format!("must be a whole number of at least 0, got {v}"),
                        )
                    })?,
            ),
        };
        let do_sample = match config.get("do_sample") {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => {
                return Err(invalid(
                    "do_sample",
                    &format!("must be true or false, got {v}"),
                ))
            }
        };
        let named = temperature.is_some()
            || top_p.is_some()
            || top_k.is_some()
            || min_p.is_some()
            || repetition_penalty.is_some();
        if !named || do_sample == Some(false) {
            return Ok(Self::default());
        }
        Ok(Self {
            temperature: temperature.unwrap_or(1.0),
            top_p: top_p.unwrap_or(0.0),
            top_k: top_k.unwrap_or(0),
            min_p: min_p.unwrap_or(0.0),
            repetition_penalty: repetition_penalty.unwrap_or(0.0),
            repetition_context_size: PERCH_REPETITION_CONTEXT_SIZE,
            source: SamplingDefaultsSource::Model,
        })
    }

    /// `base` with these values in place of its temperature, top-p, top-k, min-p and
    /// repetition penalty (and its window); the rest (seed, other penalties, logit bias) kept.
    pub fn apply_to(&self, base: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            repetition_context_size: self.repetition_context_size,
            ..base.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn read(config: Value) -> Result<SamplingDefaults> {
        SamplingDefaults::from_generation_config(Some(&config), Path::new("generation_config.json"))
    }

    #[test]
    fn a_model_without_sampling_fields_gets_perch_defaults() {
        let perch = SamplingDefaults::default();
        assert_eq!(perch.source, SamplingDefaultsSource::Perch);
        assert!(perch.temperature > 0.0 && perch.repetition_penalty > 1.0);
        // SmolLM2-135M-Instruct's generation_config.json.
        let smollm2 = json!({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
            "transformers_version": "4.42.3"});
        assert_eq!(read(smollm2).unwrap(), perch);
        assert_eq!(
            SamplingDefaults::from_generation_config(None, Path::new("x")).unwrap(),
            perch
        );
        // do_sample false: transformers decodes greedily and ignores the values.
        assert_eq!(
            read(json!({"do_sample": false, "temperature": 0.6})).unwrap(),
            perch
        );
    }

    #[test]
    fn a_model_naming_its_sampling_gets_it_and_the_rest_off() {
        // Qwen3's generation_config.json.
        let qwen3 = read(json!({"do_sample": true, "eos_token_id": [151645, 151643],
            "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
        .unwrap();
        assert_eq!(
            qwen3,
            SamplingDefaults {
                temperature: 0.6,
                top_p: 0.95,
                top_k: 20,
                min_p: 0.0,
                repetition_penalty: 0.0,
                repetition_context_size: PERCH_REPETITION_CONTEXT_SIZE,
                source: SamplingDefaultsSource::Model,
            }
        );
        // No temperature: transformers' 1.0.
        let top_p_only = read(json!({"top_p": 0.9})).unwrap();
        assert_eq!((top_p_only.temperature, top_p_only.top_p), (1.0, 0.9));
        let base = SamplingParams {
            seed: Some(7),
            presence_penalty: 0.5,
            ..SamplingParams::default()
        };
        let applied = qwen3.apply_to(&base);
        assert_eq!(
            (applied.temperature, applied.top_k, applied.seed),
            (0.6, 20, Some(7))
        );
        assert_eq!(applied.presence_penalty, 0.5);
    }

    #[test]
    fn values_outside_their_domain_are_errors_naming_the_field() {
        for (config, field) in [
            (json!({"temperature": -1}), "`temperature`"),
            (json!({"temperature": "hot"}), "`temperature`"),
            (json!({"top_p": 1.5}), "`top_p`"),
            (json!({"min_p": -0.1}), "`min_p`"),
            (json!({"top_k": -3}), "`top_k`"),
            (json!({"top_k": 2.5}), "`top_k`"),
            (json!({"repetition_penalty": -1.0}), "`repetition_penalty`"),
            (json!({"do_sample": "yes", "top_p": 0.9}), "`do_sample`"),
        ] {
            let err = read(config.clone())
                .expect_err(&config.to_string())
                .to_string();
            assert!(
                err.contains(field) && err.contains("generation_config.json"),
                "{config}: {err}"
            );
        }
    }
}
