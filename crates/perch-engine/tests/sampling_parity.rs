//! Perch's sampler draws the tokens mlx_lm 0.32.2 draws: the same logits, sampler settings and
//! seed give the same token at every step (temperature, top-p, min-p, XTC with its special
//! tokens, top-k), XTC's uniform draw and the categorical taken from one key stream in
//! mlx_lm's order; and XTC spares the special tokens mlx_lm's `generate` names for the test
//! model's tokenizer.

mod common;

use mlx_rs::{ops, Array};
use perch_engine::sample::sampler::{Sampler, SamplingParams};
use perch_engine::Tokenizer;
use serde_json::{json, Value};

/// Logits `[1, 32]` with several likely tokens (XTC has top choices to exclude).
fn logits(shift: f32) -> Vec<f32> {
    (0..32)
        .map(|i| {
            let i = i as f32;
            3.0 - 0.35 * i + (i * 1.7 + shift).sin()
        })
        .collect()
}

struct Case {
    logits: Vec<f32>,
    params: SamplingParams,
    protected: Vec<u32>,
    draws: usize,
}

impl Case {
    /// make_sampler's keyword arguments for these settings.
    fn mlx_lm_params(&self) -> Value {
        let p = &self.params;
        json!({
            "temp": p.temperature, "top_p": p.top_p, "min_p": p.min_p, "top_k": p.top_k,
            "xtc_probability": p.xtc_probability, "xtc_threshold": p.xtc_threshold,
            "xtc_special_tokens": self.protected,
        })
    }

    fn perch_tokens(&self) -> Vec<u32> {
        let row = Array::from_slice(&self.logits, &[1, self.logits.len() as i32]);
        let logprobs = ops::subtract(&row, row.logsumexp_axis(-1, true).unwrap()).unwrap();
        let mut sampler = Sampler::new(self.params.clone())
            .unwrap()
            .protecting(&self.protected);
        (0..self.draws)
            .map(|_| sampler.sample(&logprobs).unwrap().as_slice::<u32>()[0])
            .collect()
    }
}

#[test]
fn seeded_draws_match_mlx_lm_step_for_step() {
    let seeded = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..Default::default()
    };
    let cases = [
        // The plain categorical stream.
        Case {
            logits: logits(0.0),
            params: seeded(11),
            protected: vec![],
            draws: 64,
        },
        // XTC half the time, the most likely token protected.
        Case {
            logits: logits(0.5),
            params: SamplingParams {
                xtc_probability: 0.5,
                xtc_threshold: 0.1,
                ..seeded(12)
            },
            protected: vec![0],
            draws: 96,
        },
        // Every sampler in mlx_lm's chain: top-p, min-p, XTC every time, top-k.
        Case {
            logits: logits(1.0),
            params: SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                min_p: 0.02,
                top_k: 12,
                xtc_probability: 1.0,
                xtc_threshold: 0.05,
                ..seeded(13)
            },
            protected: vec![],
            draws: 64,
        },
    ];
    let input = tempfile::NamedTempFile::new().unwrap();
    let request: Vec<Value> = cases
        .iter()
        .map(|c| {
            json!({"logits": [c.logits], "params": c.mlx_lm_params(),
                   "seed": c.params.seed, "draws": c.draws})
        })
        .collect();
    std::fs::write(input.path(), serde_json::to_vec(&request).unwrap()).unwrap();
    let dir = common::model_dir();
    let answer: Value = serde_json::from_str(&common::run_oracle(
        "sampler.py",
        &[input.path().to_str().unwrap(), dir.to_str().unwrap()],
    ))
    .unwrap();
    for (i, case) in cases.iter().enumerate() {
        let expected: Vec<u32> = serde_json::from_value(answer["tokens"][i].clone()).unwrap();
        let ours = case.perch_tokens();
        assert_eq!(ours, expected, "case {i}: {:?}", case.params);
        // The draws are not degenerate: several tokens come up.
        let distinct: std::collections::BTreeSet<_> = ours.iter().collect();
        assert!(distinct.len() >= 3, "case {i}: {distinct:?}");
    }
    // XTC changes what is drawn: case 1 without it draws otherwise, and when it applies the
    // most likely tokens (but the protected one) are never drawn.
    let without = Case {
        params: SamplingParams {
            xtc_probability: 0.0,
            ..cases[1].params.clone()
        },
        ..Case {
            logits: cases[1].logits.clone(),
            params: SamplingParams::default(),
            protected: vec![0],
            draws: 96,
        }
    };
    assert_ne!(without.perch_tokens(), cases[1].perch_tokens());

    let tokenizer = Tokenizer::load(&dir).unwrap();
    let special: Vec<u32> = serde_json::from_value(answer["xtc_special_tokens"].clone()).unwrap();
    assert!(!special.is_empty());
    assert_eq!(tokenizer.xtc_special_tokens(), special);
}

/// With XTC on every step and a threshold that two or more tokens pass, the likeliest tokens
/// are never drawn, except the protected one and the least likely above the threshold.
#[test]
fn xtc_excludes_the_top_choices_but_the_last_and_the_protected() {
    // Probabilities 0.4, 0.3, 0.2, 0.1 (threshold 0.15: tokens 0, 1 and 2 are top choices).
    let probs = [0.4f32, 0.3, 0.2, 0.1];
    let row = Array::from_slice(&probs.map(f32::ln), &[1, 4]);
    let draw = |protected: &[u32]| {
        let mut sampler = Sampler::new(SamplingParams {
            temperature: 1.0,
            xtc_probability: 1.0,
            xtc_threshold: 0.15,
            seed: Some(3),
            ..Default::default()
        })
        .unwrap()
        .protecting(protected);
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[sampler.sample(&row).unwrap().as_slice::<u32>()[0] as usize] += 1;
        }
        seen
    };
    let seen = draw(&[]);
    assert_eq!((seen[0], seen[1]), (0, 0), "{seen:?}");
    assert!(seen[2] > 0 && seen[3] > 0, "{seen:?}");
    let seen = draw(&[0]);
    assert_eq!(seen[1], 0, "{seen:?}");
    assert!(seen[0] > 0 && seen[2] > 0, "{seen:?}");
    // Ids outside the vocabulary change nothing.
    assert_eq!(draw(&[1000]), draw(&[]));
}

#[test]
fn xtc_settings_out_of_range_are_rejected() {
    for (probability, threshold, field) in
        [(1.5, 0.1, "xtc_probability"), (0.5, 0.6, "xtc_threshold")]
    {
        let params = SamplingParams {
            xtc_probability: probability,
            xtc_threshold: threshold,
            ..Default::default()
        };
        let error = params.validate(32).unwrap_err().to_string();
        assert!(error.contains(field), "{error}");
    }
}
