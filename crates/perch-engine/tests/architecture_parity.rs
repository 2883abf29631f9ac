//! Tiny random models written by Python mlx_lm 0.32.2 (`tests/oracle/tiny_models.py`): Llama
//! (with Llama 3 RoPE scaling), Phi-3 (fused projections, partial LongRoPE), Qwen2, Qwen3,
//! Qwen3.5 (hybrid Gated DeltaNet and gated attention; dense and mixture-of-experts with a shared
//! expert), Gemma 3 (sliding windows of 8 under an 18-token prompt, text-only and multimodal
//! layouts), Gemma 4 (global heads of their own size with proportional RoPE, KV-shared layers,
//! per-layer inputs, experts beside the MLP, values from the key projection, soft-capped logits;
//! text-only and multimodal layouts), gpt-oss (attention sinks, biases, alternating sliding
//! layers, YaRN, clamped-SwiGLU experts with biases), Qwen3-MoE (8 experts, top 4 and top 2, a dense first layer, Hugging Face's
//! per-expert and mlx-community's stacked layouts), SmolLM3 (layers without RoPE), OLMo 2 (output
//! norms, query / key norms across heads), Ministral 3 (YaRN, Llama 4 query scaling past 8
//! positions, sliding layers listed in `layer_types`) and Mistral 3's multimodal layouts (a
//! Ministral 3 or a Llama text model under `language_model.`) — float32,
//! bfloat16, 4-bit (MoE routers at 8 bits, as mlx_lm converts them), and 8-bit with a per-layer
//! override. Perch's logits must match mlx_lm's within 1e-4 of the largest logit (1e-4
//! absolute below 1) and its greedy ids exactly, through `generate` and through the batch
//! engine (three prompts at once, inserted at different steps), per sequence and, for models
//! without recurrent layers, over slot caches too.
//!
//! Needs the oracle: a Python with `mlx[cpu]==0.32.2` and `mlx-lm==0.32.2` (`PERCH_TEST_PYTHON`,
//! else `target/oracle-venv`, which `scripts/test.sh` creates).

mod common;

use std::path::Path;
use std::process::Command;

use mlx_rs::Array;
use perch_engine::testing::{BatchConfig, BatchGenerator, RowKv, SlotKvCache};
use perch_engine::{
    models, prompt_cache, EngineConfig, EngineHandle, EngineRequest, GenerateRequest, Prompt,
    Tokenizer,
};

#[derive(serde::Deserialize)]
struct Expected {
    prompt_ids: Vec<u32>,
    logits_shape: Vec<usize>,
    logits: Vec<f32>,
    greedy_ids: Vec<u32>,
    /// Models with sliding-window layers: a prompt far longer than the window, and mlx_lm's
    /// greedy ids after it.
    #[serde(default)]
    long_prompt_ids: Vec<u32>,
    #[serde(default)]
    long_greedy_ids: Vec<u32>,
}

#[test]
fn logits_and_greedy_ids_match_mlx_lm() {
    let out = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/tiny_models.py");
    let status = Command::new(common::oracle_python())
        .arg(&script)
        .arg(out.path())
        .arg(common::model_dir())
        .status()
        .expect("run the mlx_lm oracle");
    assert!(status.success(), "tiny_models.py failed");

    let mut cases: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cases.sort();
    let names: Vec<String> = cases
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "gemma3-4bit",
            "gemma3_text",
            "gemma3_text-6",
            "gemma4-4bit",
            "gemma4_text",
            "gemma4_text-moe-4bit",
            "gpt_oss",
            "gpt_oss-4bit",
            "gpt_oss-mxfp4",
            "llama3-rope",
            "ministral3",
            "mistral3-4bit",
            "mistral3-llama",
            "olmo2",
            "olmo2-4bit",
            "phi3",
            "phi3-4bit",
            "qwen2",
            "qwen2-4bit",
            "qwen2-bf16",
            "qwen3",
            "qwen3-8bit-mixed",
            "qwen3_5",
            "qwen3_5-4bit",
            "qwen3_5-6",
            "qwen3_5_moe",
            "qwen3_5_moe-4bit",
            "qwen3_moe",
            "qwen3_moe-4bit",
            "smollm3",
            "smollm3-4bit"
        ]
    );

    for dir in &cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let expected: Expected =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let model = models::load(dir).unwrap_or_else(|e| panic!("{name}: {e}"));

        // The picker's KV estimate, from config.json alone, is what the loaded model's caches
        // take: bytes per token as the block pool counts them, and each cache layer's window.
        let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let footprint = models::kv_footprint(&config, None).unwrap();
        assert_eq!(
            footprint.bytes_per_token() as usize,
            perch_engine::testing::kv_bytes_per_token(model.as_ref(), None),
            "{name}: KV bytes per token"
        );
        let windows: Vec<Option<u64>> = model
            .make_cache(None)
            .iter()
            .filter(|c| !c.is_recurrent())
            .map(|c| c.window().map(|w| w as u64))
            .collect();
        let estimated: Vec<Option<u64>> = footprint.layers.iter().map(|l| l.window).collect();
        assert_eq!(estimated, windows, "{name}: sliding windows");
        assert_eq!(
            footprint.state_bytes > 0,
            model.has_recurrent_layers(),
            "{name}: recurrent states"
        );

        let n = expected.prompt_ids.len() as i32;
        let mut cache = model.make_cache(None);
        let logits = model
            .forward_sequence(
                &Array::from_slice(&expected.prompt_ids, &[1, n]),
                &mut cache,
            )
            .unwrap();
        assert_eq!(
            logits.shape()[1..]
                .iter()
                .map(|d| *d as usize)
                .collect::<Vec<_>>(),
            expected.logits_shape,
            "{name}"
        );
        let ours = logits.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        let ours = ours.as_slice::<f32>();
        let max_diff = ours
            .iter()
            .zip(&expected.logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let scale = expected
            .logits
            .iter()
            .map(|v| v.abs())
            .fold(0.0f32, f32::max);
        assert!(scale > 0.1, "{name}: degenerate logits");
        // Float32 rounding of two summation orders (Perch's CPU kernel, MLX's): 1e-4 of the
        // largest logit, 1e-4 absolute below 1 (gemma4-4bit's logits reach ~3.8).
        let tolerance = 1e-4 * scale.max(1.0);
        assert!(
            max_diff <= tolerance,
            "{name}: logits differ from mlx_lm by {max_diff} (max |logit| {scale}, tolerance {tolerance})"
        );

        if model.has_recurrent_layers() {
            compiled_recurrence(dir, &name, &expected, ours);
        }
        // Experts' gate and up projections fuse too, quantized ones included.
        if model.has_recurrent_layers() || name.contains("moe") || name.starts_with("gpt_oss") {
            fused_input_projections(dir, &name, &expected);
        }
        // The experts' grouped products (CUDA's default for prompt passes), forced on the CPU.
        if name.contains("moe") || name.starts_with("gpt_oss") {
            grouped_expert_products(dir, &name, &expected, tolerance);
        }

        // Every architecture has prompt caches (mlx_lm's layout for its layers).
        assert_eq!(
            prompt_cache::unsupported_reason(model.as_ref()),
            None,
            "{name}"
        );

        let tokenizer = Tokenizer::load(dir).unwrap();
        let request = unstopped_request(expected.prompt_ids.clone(), expected.greedy_ids.len());
        let result = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
        assert_eq!(result.token_ids, expected.greedy_ids, "{name}: greedy ids");

        // The batch engine: the prompt and two shorter prefixes of it, inserted at steps 0, 1
        // and 3, each as `generate` gives it alone (for the whole prompt: mlx_lm's ids).
        let prompts = [
            expected.prompt_ids.clone(),
            expected.prompt_ids[..11].to_vec(),
            expected.prompt_ids[..5].to_vec(),
        ];
        let schedule: Vec<(usize, GenerateRequest)> = prompts
            .iter()
            .zip([0, 1, 3])
            .map(|(prompt, at)| {
                let mut request = unstopped_request(prompt.clone(), expected.greedy_ids.len());
                // Chunks of 4 (7 for the first prompt, whose chunk 14..21 crosses the block
                // boundary at 16): the prompt's state carries over between prefill chunks.
                request.prefill_step_size = if at == 0 { 7 } else { 4 };
                (at, request)
            })
            .collect();
        let alone: Vec<Vec<u32>> = schedule
            .iter()
            .map(|(_, request)| {
                common::generate_alone(model.as_ref(), &tokenizer, request)
                    .unwrap()
                    .token_ids
            })
            .collect();
        assert_eq!(alone[0], expected.greedy_ids, "{name}: chunked prefill");
        {
            let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
            let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, &name);
            let outputs = common::drive(&mut batch, schedule.clone());
            for (i, ((output, _), alone)) in outputs.iter().zip(&alone).enumerate() {
                assert_eq!(&output.token_ids, alone, "{name}: batched request {i}");
            }
            // The prefix cache: a longer prompt sharing the first one's full block (16 tokens,
            // twice Gemma's sliding window) starts from it and still generates as it would alone.
            let mut longer = expected.prompt_ids.clone();
            longer.extend_from_slice(&expected.greedy_ids[..6]);
            let request = unstopped_request(longer, 8);
            let alone = common::generate_alone(model.as_ref(), &tokenizer, &request)
                .unwrap()
                .token_ids;
            let (output, _) = common::drive(&mut batch, vec![(0, request)]).remove(0);
            assert_eq!(output.token_ids, alone, "{name}: after a prefix-cache hit");
            // Hybrid models too: the first prompt's prefill chunks end on the block boundary,
            // where the block keeps the recurrent layers' states.
            assert!(
                output.stats.cached_prompt_tokens >= 16,
                "{name}: {} prompt tokens came from the prefix cache",
                output.stats.cached_prompt_tokens
            );
            // A conversation that goes on: the second request's prompt (11 tokens) and its
            // first 10 generated tokens, then one more. Its first block (16 tokens) was filled
            // while decoding, so a hybrid model's states there come from that decode step.
            let mut turn = prompts[1].clone();
            turn.extend_from_slice(&outputs[1].0.token_ids[..10]);
            turn.push(expected.prompt_ids[0]);
            let request = unstopped_request(turn, 8);
            let alone = common::generate_alone(model.as_ref(), &tokenizer, &request)
                .unwrap()
                .token_ids;
            let (output, _) = common::drive(&mut batch, vec![(0, request)]).remove(0);
            assert_eq!(
                output.token_ids, alone,
                "{name}: after a block filled in decode"
            );
            assert_eq!(
                output.stats.cached_prompt_tokens, 16,
                "{name}: the block filled in decode came from the prefix cache"
            );
            // A prompt of 34 tokens prefilled in one chunk (to 32, then the rest of the block):
            // its first block holds KV but no recurrent states (they exist after 32 only), so a
            // prompt that shares just that block starts from nothing on a hybrid model; it stops
            // a prefill chunk where it leaves the cached chain (16) and leaves its states in that
            // block, so a third prompt sharing the block starts from it.
            // (A sequence no earlier request began with: the prompt reversed, then its start.)
            let reversed: Vec<u32> = expected.prompt_ids.iter().rev().copied().collect();
            let long: Vec<u32> = [&reversed[..], &expected.prompt_ids[..16]].concat();
            // (34 tokens: without the stop at 16, its one chunk would end at 32.)
            let shares_one_block: Vec<u32> = [&long[..16], &expected.prompt_ids[..]].concat();
            let shares_it_too: Vec<u32> = [&long[..16], &reversed[..7]].concat();
            let mut cached = Vec::new();
            for prompt in [long, shares_one_block, shares_it_too] {
                let request = unstopped_request(prompt, 4);
                let alone = common::generate_alone(model.as_ref(), &tokenizer, &request)
                    .unwrap()
                    .token_ids;
                let (output, _) = common::drive(&mut batch, vec![(0, request)]).remove(0);
                assert_eq!(
                    output.token_ids,
                    alone,
                    "{name}: {} prompt tokens",
                    alone.len()
                );
                cached.push(output.stats.cached_prompt_tokens);
            }
            let shared = if model.has_recurrent_layers() { 0 } else { 16 };
            assert_eq!(
                cached,
                [0, shared, 16],
                "{name}: prompt tokens from the prefix cache"
            );
        }
        if !expected.long_prompt_ids.is_empty() {
            past_the_window(dir, model.as_ref(), &tokenizer, &name, &expected);
        }
        if name == "gemma3_text" {
            long_conversation(dir, &expected.long_prompt_ids);
            rows_publishing_together(dir, &expected.long_prompt_ids);
        }
        if model.has_recurrent_layers() {
            hybrid_prompt_caches(dir, model.as_ref(), &tokenizer, &name, &expected);
            rewound_states(model.as_ref(), &name, &expected);
            draft_rows_go_back(model.as_ref(), &name, &expected);
            hybrid_speculation(dir, model.as_ref(), &tokenizer, &name, &expected);
        }
    }
}

/// A hybrid model's rows rewound over slot caches (`SlotKvCache::rewind_rows`): four rows feed
/// 4 tokens each in one recorded step and give back 3, 1, none and 2 of them; the next step's
/// logits are those of rows that fed only the tokens kept (in a step of their own, padded), so
/// every recurrent layer's state went back exactly. Without a record, or by more than the step
/// fed, a rewind is refused.
fn rewound_states(model: &dyn models::Model, name: &str, expected: &Expected) {
    const ROWS: usize = 4;
    let recurrent: Vec<bool> = model
        .make_cache(None)
        .iter()
        .map(|c| c.is_recurrent())
        .collect();
    let layers = model.info().num_layers;
    let make = || {
        let mut slots = SlotKvCache::new(layers, None).with_recurrent_layers(&recurrent);
        for _ in 0..ROWS {
            slots.push(&[], 0, RowKv::Plain).unwrap();
        }
        assert_eq!(slots.rows(), ROWS, "a row bucket of its own");
        slots
    };
    let p = &expected.prompt_ids;
    // Row r's tokens: the prompt from r on.
    let rows = |from: usize, width: usize, counts: [usize; ROWS]| {
        let mut ids = vec![0u32; ROWS * width];
        for (r, &n) in counts.iter().enumerate() {
            ids[r * width..r * width + n].copy_from_slice(&p[r + from..r + from + n]);
        }
        (
            Array::from_slice(&ids, &[ROWS as i32, width as i32]),
            counts.to_vec(),
        )
    };
    let step = |slots: &mut SlotKvCache, (ids, counts): (Array, Vec<usize>)| {
        let logits = model.forward_slots(&ids, slots, &counts).unwrap();
        logits.as_dtype(mlx_rs::Dtype::Float32).unwrap()
    };
    let (mut rewound, mut kept) = (make(), make());
    for slots in [&mut rewound, &mut kept] {
        step(slots, rows(0, 5, [5; ROWS]));
    }
    // Without a record, a recurrent state cannot go back.
    assert!(rewound.rewind_rows(&[(0, 1)]).is_err(), "{name}");
    rewound.record_replay();
    step(&mut rewound, rows(5, 4, [4; ROWS]));
    assert!(
        rewound.rewind_rows(&[(0, 5)]).is_err(),
        "{name}: more than the step fed"
    );
    rewound.record_replay();
    step(&mut rewound, rows(9, 4, [4; ROWS]));
    rewound.rewind_rows(&[(0, 3), (1, 1), (3, 2)]).unwrap();
    step(&mut kept, rows(5, 4, [4; ROWS]));
    step(&mut kept, rows(9, 4, [1, 3, 4, 2]));
    let lengths = |slots: &SlotKvCache| (0..ROWS).map(|r| slots.slot_len(r)).collect::<Vec<_>>();
    assert_eq!(lengths(&rewound), [10, 12, 13, 11], "{name}");
    assert_eq!(lengths(&kept), lengths(&rewound), "{name}");
    let next = |slots: &mut SlotKvCache| {
        let ids: Vec<u32> = (0..ROWS).map(|r| p[r + slots.slot_len(r) % 4]).collect();
        step(
            slots,
            (Array::from_slice(&ids, &[ROWS as i32, 1]), vec![1; ROWS]),
        )
    };
    let (a, b) = (next(&mut rewound), next(&mut kept));
    let diff = a
        .as_slice::<f32>()
        .iter()
        .zip(b.as_slice::<f32>())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff <= 1e-4,
        "{name}: rewound rows' logits differ by {diff}"
    );

    // A one-token step in which rows 1 and 3 feed nothing (a draft's rows that propose nothing
    // in a round) leaves their states as they were: the next step's logits are those of a
    // cache whose rows 1 and 3 sat out a padded step of their own.
    let (mut idle, mut padded) = (make(), make());
    for slots in [&mut idle, &mut padded] {
        step(slots, rows(0, 5, [5; ROWS]));
    }
    step(&mut idle, rows(5, 1, [1, 0, 1, 0]));
    step(&mut padded, rows(5, 2, [1, 0, 1, 0]));
    assert_eq!(lengths(&idle), [6, 5, 6, 5], "{name}");
    let (a, b) = (next(&mut idle), next(&mut padded));
    let diff = largest_difference(a.as_slice::<f32>(), b.as_slice::<f32>());
    assert!(
        diff <= 1e-4,
        "{name}: rows that fed nothing in a one-token step: logits differ by {diff}"
    );

    // Put back over two unrecorded steps (`SlotKvCache::restore_row`, a hybrid draft's rows
    // after rejected proposals): rows 0, 1 and 3 back at 5 tokens with the states they had
    // there, row 2 left at 13; then every row feeds its next 4 tokens, as a cache that never
    // went past does. Restoring the length alone, with the states of later tokens, does not.
    let (mut restored, mut reference, mut lengths_only) = (make(), make(), make());
    let mut saved = Vec::new();
    for slots in [&mut restored, &mut reference, &mut lengths_only] {
        step(slots, rows(0, 5, [5; ROWS]));
    }
    for r in 0..ROWS {
        saved.push(restored.row_states(r).unwrap());
    }
    for slots in [&mut restored, &mut lengths_only] {
        step(slots, rows(5, 4, [4; ROWS]));
        step(slots, rows(9, 4, [4; ROWS]));
    }
    step(&mut reference, rows(5, 4, [0, 0, 4, 0]));
    step(&mut reference, rows(9, 4, [0, 0, 4, 0]));
    assert!(
        restored.restore_row(0, 14, &saved[0]).is_err(),
        "{name}: past the row"
    );
    for r in [0, 1, 3] {
        restored.restore_row(r, 5, &saved[r]).unwrap();
        let later = lengths_only.row_states(r).unwrap();
        lengths_only.restore_row(r, 5, &later).unwrap();
    }
    assert_eq!(lengths(&restored), [5, 5, 13, 5], "{name}");
    assert_eq!(lengths(&reference), lengths(&restored), "{name}");
    let counts = [4, 4, 0, 4];
    let (a, b, c) = (
        step(&mut restored, rows(5, 4, counts)),
        step(&mut reference, rows(5, 4, counts)),
        step(&mut lengths_only, rows(5, 4, counts)),
    );
    let rows_diff = |x: &Array, y: &Array| {
        // Rows 0, 1 and 3 only (row 2 fed nothing: its logits are padding's).
        let (x, y) = (x.as_slice::<f32>(), y.as_slice::<f32>());
        let per_row = x.len() / ROWS;
        [0, 1, 3]
            .iter()
            .flat_map(|&r| (r * per_row..(r + 1) * per_row).map(|i| (x[i] - y[i]).abs()))
            .fold(0.0f32, f32::max)
    };
    let diff = rows_diff(&a, &b);
    assert!(
        diff <= 1e-4,
        "{name}: restored rows' logits differ by {diff}"
    );
    let wrong = rows_diff(&c, &b);
    assert!(
        wrong > 1e-3,
        "{name}: later states gave the same logits ({wrong})"
    );
}

/// A hybrid model as a draft (`DraftRunner`), its steps uncompiled and compiled, each round's
/// first step as wide as its rows or padded to the verify steps' width (as on GPUs): a row that
/// proposed 3 tokens, of which the model took none or one and then its own token, is put back
/// (`DraftRunner::settle`) so that it proposes next what a fresh draft proposes from the same
/// tokens; and a row that proposes nothing in a round (another row's steps run without it)
/// keeps its states, so that it proposes next what a fresh draft proposes.
fn draft_rows_go_back(model: &dyn models::Model, name: &str, expected: &Expected) {
    use perch_engine::testing::{DraftRow, DraftRunner};
    const K: usize = 3;
    let prompt = &expected.prompt_ids[..8];
    let vocab = model.info().vocab_size as u32;
    // Each row's K proposals, in the order of `rows` (sequence id, its tokens).
    let propose = |draft: &mut DraftRunner<'_>, rows: &[(u64, &[u32])]| -> Vec<Vec<u32>> {
        let fed = rows
            .iter()
            .map(|&(id, tokens)| DraftRow {
                id,
                tokens,
                k: K,
                sampler: None,
            })
            .collect();
        let proposed = draft.propose(fed).unwrap();
        proposed.tokens.eval().unwrap();
        let width = proposed.tokens.shape()[1] as usize;
        let all = proposed.tokens.as_slice::<u32>();
        proposed
            .columns
            .iter()
            .map(|&column| (0..K).map(|i| all[i * width + column]).collect())
            .collect()
    };
    for (compiled, padded) in [(false, false), (true, false), (false, true), (true, true)] {
        let new = || {
            DraftRunner::new(model, Default::default(), compiled, (64, 32), 8)
                .with_padded_first_steps(padded)
        };
        let way = format!("compiled {compiled}, padded {padded}");
        for accepted in [0, 1] {
            let mut draft = new();
            let first = propose(&mut draft, &[(1, prompt)]).remove(0);
            let mut tokens = prompt.to_vec();
            tokens.extend(&first[..accepted]);
            // The model's token where it rejected the draft's.
            tokens.push((first[accepted] + 1) % vocab);
            draft.settle(1, prompt.len() + accepted).unwrap();
            assert_eq!(
                propose(&mut draft, &[(1, &tokens)]),
                propose(&mut new(), &[(1, &tokens)]),
                "{name}: proposals after {accepted} of {K} were accepted ({way})"
            );
        }
        // Two rows take every proposal, then only the first proposes; the second's next
        // proposals are a fresh draft's.
        // After warm-up (scratch caches: the rows below see none of it), which meets the steps
        // with rows that feed nothing too.
        let mut draft = new();
        assert_eq!(
            draft.warm_up(4).unwrap(),
            3 * 2 + 2,
            "{name}: warm-up shapes: row buckets 1, 2 and 4 a one- and a four-token step each, \
             and 2 and 4 with rows that feed nothing"
        );
        let other = &expected.prompt_ids[3..11];
        let first = propose(&mut draft, &[(1, prompt), (2, other)]);
        let taken = |tokens: &[u32], proposals: &[u32]| -> Vec<u32> {
            let mut all = [tokens, proposals].concat();
            all.push((proposals[K - 1] + 1) % vocab);
            all
        };
        let (one, two) = (taken(prompt, &first[0]), taken(other, &first[1]));
        draft.settle(1, prompt.len() + K).unwrap();
        draft.settle(2, other.len() + K).unwrap();
        let second = propose(&mut draft, &[(1, &one)]).remove(0);
        draft.settle(1, one.len() + K).unwrap();
        assert_eq!(
            propose(&mut draft, &[(2, &two)]),
            propose(&mut new(), &[(2, &two)]),
            "{name}: a row's proposals after a round without it ({way}; the other row's {second:?})"
        );
        // The compiled way ran compiled steps (not a fallback).
        assert_eq!(
            draft.compiled_decode_steps() > 0,
            compiled,
            "{name}: compiled steps ({way})"
        );
    }
}

/// A request for exactly `max_tokens` tokens after `prompt` (end-of-sequence tokens ignored).
fn unstopped_request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt);
    request.max_tokens = max_tokens;
    request.ignore_eos = true;
    request
}

/// Speculative decoding in the batch on a hybrid model, whose recurrent states go back over a
/// verify step's rejected proposals by computing them again from the step's record: prompt
/// lookup on prompts that repeat themselves, then the tiny Qwen3 (no recurrent layers, the same
/// tokenizer) as a draft model; every greedy request's ids are those it gets alone and a sampled
/// row beside them keeps its draws, while verify steps give back rejected proposals.
fn hybrid_speculation(
    dir: &Path,
    model: &dyn models::Model,
    tokenizer: &Tokenizer,
    name: &str,
    expected: &Expected,
) {
    let prompt = &expected.prompt_ids;
    let request = unstopped_request;
    let mut sampled = request(prompt[..9].to_vec(), 48);
    sampled.sampling.temperature = 0.8;
    sampled.sampling.seed = Some(7);
    let requests = [
        request(prompt.clone(), 48),
        request([&prompt[..11], &prompt[..11], &prompt[..11]].concat(), 48),
        request(prompt[..5].to_vec(), 32),
        sampled,
    ];
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| {
            common::generate_alone(model, tokenizer, r)
                .unwrap()
                .token_ids
        })
        .collect();
    let lookup = perch_engine::PromptLookup {
        num_draft_tokens: 4,
        min_ngram: 1,
        max_ngram: 4,
        max_rows: 8,
        adaptive: false,
    };
    // Drafts: the tiny Qwen3 (attention only), another hybrid (its recurrent states put back
    // after rejected proposals, `DraftRunner::settle`) and the model itself.
    let plain = models::load(&dir.with_file_name("qwen3")).unwrap();
    let other = match name {
        "qwen3_5" => "qwen3_5_moe",
        _ => "qwen3_5",
    };
    let hybrid = models::load(&dir.with_file_name(other)).unwrap();
    let drafts: [(&str, Option<&dyn models::Model>); 4] = [
        ("prompt lookup", None),
        ("qwen3", Some(plain.as_ref())),
        (other, Some(hybrid.as_ref())),
        ("itself", Some(model)),
    ];
    for (label, draft) in drafts {
        let drafting = draft.is_some();
        let config = BatchConfig {
            prompt_lookup: (!drafting).then_some(lookup),
            ..BatchConfig::for_budget(model, 64 << 20, 16, None)
        };
        let mut batch = BatchGenerator::new(model, tokenizer, config, name);
        if let Some(draft) = draft {
            batch = batch.with_draft(draft, 3);
            assert!(batch.drafts(), "{name}: {label} proposes in the batch");
        }
        let schedule = requests
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, mut r)| {
                if drafting && i < 3 {
                    r.num_draft_tokens = Some(3);
                }
                (i.min(2), r)
            })
            .collect();
        let outputs = common::drive(&mut batch, schedule);
        for (i, ((output, _), alone)) in outputs.iter().zip(&alone).enumerate() {
            assert_eq!(&output.token_ids, alone, "{name}: request {i}, {label}");
        }
        // Verify steps ran and rejected proposals (a random model repeats itself only by
        // chance, and a random draft agrees with it only by chance: rows give back some or all
        // of their proposals; `rewound_states` gives back parts of steps). The model drafting
        // for itself has its proposals taken: its draft rows follow their sequences.
        let times = batch.step_times();
        assert!(times.verify_steps > 0, "{name}, {label}: {times:?}");
        let (proposed, accepted) = (times.draft_tokens, times.accepted_draft_tokens);
        if label == "itself" {
            assert!(
                accepted * 20 >= proposed * 19,
                "{name}: {accepted} of {proposed}"
            );
        } else {
            assert!(accepted < proposed, "{name}, {label}: {times:?}");
        }
        assert_eq!(batch.kv_stats().blocks_used, 0, "{name}");
    }
}

/// A hybrid model with its linear layers' recurrence compiled by MLX (the GPU default; forced
/// here on CPU): the prompt's logits as uncompiled (`uncompiled`, which equal mlx_lm's), and
/// mlx_lm's greedy ids through `generate`, whose decode steps run the compiled step at one row.
fn compiled_recurrence(dir: &Path, name: &str, expected: &Expected, uncompiled: &[f32]) {
    let mut model = models::load(dir).unwrap();
    model.compile_recurrence(true);
    let diff = largest_difference(
        &common::prompt_logits(model.as_ref(), &expected.prompt_ids),
        uncompiled,
    );
    assert!(
        diff <= 1e-5,
        "{name}: compiled recurrence changed logits by {diff}"
    );
    let tokenizer = Tokenizer::load(dir).unwrap();
    let request = unstopped_request(expected.prompt_ids.clone(), expected.greedy_ids.len());
    let result = common::generate_alone(model.as_ref(), &tokenizer, &request).unwrap();
    assert_eq!(
        result.token_ids, expected.greedy_ids,
        "{name}: greedy ids with the compiled recurrence"
    );
}

/// A hybrid or mixture-of-experts model with its projections fused at load (the GPU default,
/// forced here: each Gated DeltaNet layer's four input projections in one matmul, attention's
/// q/k/v in another, the experts' gate and up projections in one gather) computes mlx_lm's
/// logits too. Quantized tiny models keep Perch's CPU kernel for their dense projections, which
/// is never fused; their experts (MLX's `gather_qmm`) fuse.
fn fused_input_projections(dir: &Path, name: &str, expected: &Expected) {
    let diff = logits_loaded_with(dir, "PERCH_FUSED_PROJECTIONS", expected);
    assert!(
        diff <= 1e-4,
        "{name}: with fused projections, logits differ from mlx_lm by {diff}"
    );
}

/// The prompt's logits with the experts' products of its pass grouped (`PERCH_MOE_GROUPED=1`:
/// each stack dequantized, MLX's `gather_mm` over the pairs sorted by expert) are mlx_lm's. The
/// 18-token prompt gives every case of 4 experts at 2 a token or 8 at 4 the 8 pairs an expert
/// from which passes group.
fn grouped_expert_products(dir: &Path, name: &str, expected: &Expected, tolerance: f32) {
    let diff = logits_loaded_with(dir, "PERCH_MOE_GROUPED", expected);
    assert!(
        diff <= tolerance,
        "{name}: with grouped expert products, logits differ from mlx_lm by {diff}"
    );
}

/// The largest difference of the prompt's logits from mlx_lm's, the model loaded with the
/// switch `var` set to 1 (this test is the binary's only one, so the setting reaches no other).
fn logits_loaded_with(dir: &Path, var: &str, expected: &Expected) -> f32 {
    std::env::set_var(var, "1");
    let model = models::load(dir);
    std::env::remove_var(var);
    largest_difference(
        &common::prompt_logits(model.unwrap().as_ref(), &expected.prompt_ids),
        &expected.logits,
    )
}

/// The largest |a - b| over two equally long lists.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logits of different shapes");
    a.iter()
        .zip(b)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

/// Prompt caches of a hybrid model, both ways with mlx_lm: linear-attention layers are
/// `ArraysCache` entries (the convolution's and the recurrence's states), attention layers
/// `KVCache`. A file whose states fall at the end of a block (32 tokens, the engine's default
/// block size) fills the prefix cache; one whose states fall inside a block is refused there
/// and continues requests privately.
fn hybrid_prompt_caches(
    dir: &Path,
    model: &dyn models::Model,
    tokenizer: &Tokenizer,
    name: &str,
    expected: &Expected,
) {
    let whole: Vec<u32> = [&expected.prompt_ids[..], &expected.greedy_ids[..]].concat();
    let request = unstopped_request(whole.clone(), 8);
    let alone = common::generate_alone(model, tokenizer, &request)
        .unwrap()
        .token_ids;
    let json = |ids: &[u32]| serde_json::to_string(ids).unwrap();
    let files = tempfile::tempdir().unwrap();
    let file = |name: &str| files.path().join(name);
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let classes = |file: &Path| {
        let (_, metadata) = Array::load_safetensors_with_metadata(file).unwrap();
        (0..model.info().num_layers)
            .map(|i| metadata[&format!("1.{i}")].clone())
            .collect::<Vec<_>>()
    };
    let expected_classes: Vec<&str> = model
        .make_cache(None)
        .iter()
        .map(|c| match c.is_recurrent() {
            true => "ArraysCache",
            false => "KVCache",
        })
        .collect();
    let run = |engine: &EngineHandle, prompt: Prompt| {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = alone.len();
        params.ignore_eos = true;
        let done = common::finish(&engine.submit(EngineRequest { prompt, params }).unwrap());
        assert_eq!(done.error, None, "{name}");
        (done.ids, done.stats.cached_prompt_tokens)
    };
    let after = |cache_file: &Path, cached: usize| Prompt::AfterCache {
        cache_file: cache_file.to_path_buf(),
        tokens: whole[cached..].to_vec(),
    };

    // mlx_lm's file of the first 32 tokens, continued by Perch.
    let theirs = file("mlx_lm.safetensors");
    common::served_oracle(
        "prompt_cache.py",
        &["save", &path(dir), &json(&whole[..32]), &path(&theirs)],
    );
    assert_eq!(classes(&theirs), expected_classes, "{name}: mlx_lm's file");
    let engine = EngineHandle::load(dir, EngineConfig::default()).unwrap();
    assert_eq!(
        run(&engine, after(&theirs, 32)),
        (alone.clone(), 32),
        "{name}: Perch continuing mlx_lm's cache"
    );
    // Perch's files: at a block's end (32 tokens) and inside one (18).
    let (ours, ours_18) = (file("perch.safetensors"), file("perch-18.safetensors"));
    for (file, len) in [(&ours, 32), (&ours_18, 18)] {
        engine
            .save_prompt_cache(Prompt::Tokens(whole[..len].to_vec()), file)
            .unwrap();
        assert_eq!(classes(file), expected_classes, "{name}: Perch's file");
        let out = common::served_oracle(
            "prompt_cache.py",
            &[
                "continue",
                &path(dir),
                &path(file),
                &json(&whole[len..]),
                &alone.len().to_string(),
            ],
        );
        let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(
            ids, alone,
            "{name}: mlx_lm continuing Perch's {len}-token cache"
        );
    }
    engine.shutdown();

    let engine = EngineHandle::load(dir, EngineConfig::default()).unwrap();
    let err = engine.load_prompt_cache(&ours_18).unwrap_err();
    assert!(
        err.to_string()
            .contains("not at the end of a 32-token block"),
        "{name}: {err}"
    );
    assert_eq!(
        run(&engine, after(&ours_18, 18)),
        (alone.clone(), 18),
        "{name}: Perch continuing its 18-token cache"
    );
    assert_eq!(engine.load_prompt_cache(&ours).unwrap(), 32, "{name}");
    assert_eq!(
        run(&engine, Prompt::Tokens(whole.clone())),
        (alone.clone(), 32),
        "{name}: after an imported prefix"
    );
    engine.shutdown();
}

/// `request`'s ids through `generate`, alone.
fn ids_alone(
    model: &dyn models::Model,
    tokenizer: &Tokenizer,
    request: &GenerateRequest,
) -> Vec<u32> {
    common::generate_alone(model, tokenizer, request)
        .unwrap()
        .token_ids
}

/// Rows of a sliding-window model decoding side by side fill blocks in the same steps, and
/// those blocks are copied out of their slots together (one gather a layer part for all rows):
/// each row's next turn hits its own blocks, those filled while decoding included, and gives
/// `generate`'s ids.
fn rows_publishing_together(dir: &Path, prompt: &[u32]) {
    let model = models::load(dir).unwrap();
    let tokenizer = Tokenizer::load(dir).unwrap();
    let model = model.as_ref();
    let request = |prompt: Vec<u32>| unstopped_request(prompt, 40);
    let alone = |prompt: &[u32]| ids_alone(model, &tokenizer, &request(prompt.to_vec()));
    let every_layer = perch_engine::testing::kv_bytes_per_token(model, None);
    let config = BatchConfig {
        compile_decode: false,
        ..BatchConfig::for_budget(model, 4000 * every_layer, 16, None)
    };
    let mut batch = BatchGenerator::new(model, &tokenizer, config, "rows");
    // Three prompts of one length, prefilled in one pass: their rows reach each block's end
    // in the same decode step (positions 112 and 128 in blocks of 16).
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            prompt
                .iter()
                .cycle()
                .skip(7 * i)
                .take(100)
                .copied()
                .collect()
        })
        .collect();
    let schedule = prompts.iter().map(|p| (0, request(p.clone()))).collect();
    let outputs = common::drive(&mut batch, schedule);
    let turns: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&outputs)
        .map(|(p, (output, _))| {
            assert_eq!(output.token_ids, alone(p), "a first turn");
            [&p[..], &output.token_ids, &prompt[..5]].concat()
        })
        .collect();
    let schedule = turns.iter().map(|t| (0, request(t.clone()))).collect();
    for (turn, (output, _)) in turns.iter().zip(common::drive(&mut batch, schedule)) {
        assert_eq!(output.token_ids, alone(turn), "the next turn");
        // The prompt's 6 blocks and the 2 filled while decoding (139 positions computed).
        let cached = output.stats.cached_prompt_tokens;
        assert!(cached >= 128, "the next turn found {cached} tokens cached");
    }
}

/// A conversation far past the sliding layers' bound in the batch engine, under a KV budget
/// that holds 5,000 tokens in every layer: its blocks cost the global layers only (a running
/// sequence's sliding layers a window), so a 6,000-token turn runs, gives `generate`'s ids, and
/// the next turn starts after all of it (the prefix cache kept the sliding KV of the newest
/// blocks within the pool), the cache within the budget. Then admissions under a pool with no
/// room to spare keep each other's hits (pins).
fn long_conversation(dir: &Path, prompt: &[u32]) {
    // The tiny model with a context long enough for the conversation.
    let long = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, long.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = long.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["max_position_embeddings"] = 8192.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = models::load(long.path()).unwrap();
    let tokenizer = Tokenizer::load(long.path()).unwrap();
    let model = model.as_ref();
    assert!(model.has_sliding_window_layers());

    let request = |prompt: Vec<u32>| {
        let mut request = unstopped_request(prompt, 8);
        request.prefill_step_size = 256;
        request
    };
    let alone = |prompt: &[u32]| ids_alone(model, &tokenizer, &request(prompt.to_vec()));
    let every_layer = perch_engine::testing::kv_bytes_per_token(model, None);
    let config = BatchConfig {
        compile_decode: false,
        // A sliding model's rows never verify proposals: its steps and warm-up stay one token
        // a row (a wider step at a long position is one its rings refuse).
        prompt_lookup: Some(perch_engine::PromptLookup::default()),
        ..BatchConfig::for_budget(model, 5000 * every_layer, 16, None)
    };
    let mut batch = BatchGenerator::new(model, &tokenizer, config, "long");
    batch.queue_idle_warm_up();
    while batch.idle_warm_ups_left() > 0 {
        batch.warm_up_idle().expect("every idle warm-up pass runs");
    }
    let turn1: Vec<u32> = prompt.iter().cycle().take(6000).copied().collect();
    let outputs = common::drive(&mut batch, vec![(0, request(turn1.clone()))]);
    let answer = &outputs[0].0.token_ids;
    assert_eq!(answer, &alone(&turn1), "a 6,000-token turn");
    let mut turn2 = [&turn1[..], answer].concat();
    turn2.extend_from_slice(&prompt[..20]);
    let outputs = common::drive(&mut batch, vec![(0, request(turn2.clone()))]);
    assert_eq!(outputs[0].0.token_ids, alone(&turn2), "the next turn");
    let cached = outputs[0].0.stats.cached_prompt_tokens;
    assert!(cached >= 6000, "the next turn found {cached} tokens cached");
    // Every layer of its 376 blocks would be 6,016 tokens' worth: the cache dropped the oldest
    // blocks' sliding KV to stay within the budget (and a partial block kept whole).
    let stats = batch.kv_stats();
    assert!(
        stats.prefix_cache_bytes <= (5000 + 16) * every_layer,
        "the prefix cache holds {} bytes, {} tokens' worth in every layer",
        stats.prefix_cache_bytes,
        stats.prefix_cache_bytes / every_layer
    );

    // Two requests sharing 12 cached blocks, arriving together, under a pool that holds them
    // both at admission and nothing else: the second's allocation must drop every unpinned
    // sliding block the cache holds, the last prefix block's included, unless the first
    // admission pinned what its hit reads. Both start after the prefix.
    let cost = perch_engine::testing::kv_budget_for_model(model, None, 0)
        .window_cost()
        .expect("a sliding model's window cost");
    let need = |tokens: usize| tokens.div_ceil(16) + cost.blocks_for(tokens, 16);
    let shared = prompt[..200].to_vec();
    let ask = |suffix: u32| [&shared[..], &[suffix; 4]].concat();
    let config = BatchConfig {
        compile_decode: false,
        num_blocks: 2 * need(204) - 12,
        ..BatchConfig::for_budget(model, 1 << 30, 16, None)
    };
    let mut batch = BatchGenerator::new(model, &tokenizer, config, "pins");
    common::drive(&mut batch, vec![(0, request(shared.clone()))]);
    let outputs = common::drive(&mut batch, vec![(0, request(ask(7))), (0, request(ask(9)))]);
    for ((output, _), suffix) in outputs.iter().zip([7, 9]) {
        assert_eq!(output.token_ids, alone(&ask(suffix)), "suffix {suffix}");
        let cached = output.stats.cached_prompt_tokens;
        assert!(cached >= 192, "suffix {suffix}: {cached} tokens cached");
    }

    // In the slot caches a decoding sequence's sliding layers hold a ring, not a prefill chunk
    // more: under a pool one block short of both requests' admission charge, the second is
    // admitted once the first decodes and gives back what its ring does not need, so the two
    // run at once (they used to take turns), and both give `generate`'s ids.
    let first: Vec<u32> = prompt.iter().cycle().take(700).copied().collect();
    let second: Vec<u32> = first.iter().rev().copied().collect();
    let config = BatchConfig {
        compile_decode: false,
        num_blocks: 2 * need(700) - 1,
        ..BatchConfig::for_budget(model, 1 << 30, 16, None)
    };
    let mut batch = BatchGenerator::new(model, &tokenizer, config, "rings");
    batch.insert(request(first.clone())).unwrap();
    batch.insert(request(second.clone())).unwrap();
    let (mut outputs, mut most_running) = (Vec::new(), 0);
    while !batch.is_empty() {
        for event in batch.step().unwrap() {
            if let perch_engine::testing::BatchEvent::Finished { output, .. } = event {
                outputs.push(output.token_ids);
            }
        }
        most_running = most_running.max(batch.num_running());
    }
    assert_eq!(most_running, 2, "the second request ran beside the first");
    outputs.sort();
    let mut expected = vec![alone(&first), alone(&second)];
    expected.sort();
    assert_eq!(outputs, expected);
}

/// A prompt far longer than the sliding window: `generate` and the batch engine (per sequence
/// and batched, with a prefix-cache hit that loads only the window of the sliding layers) give
/// mlx_lm's greedy ids, and the sliding layers' caches hold about a window of positions while
/// the global layers' hold them all, with logits equal to caches that keep every position.
/// Prompt caches past the window move between Perch and mlx_lm both ways.
fn past_the_window(
    dir: &Path,
    model: &dyn models::Model,
    tokenizer: &Tokenizer,
    name: &str,
    expected: &Expected,
) {
    let prompt = &expected.long_prompt_ids;
    let long_request = |prompt: Vec<u32>, max_tokens: usize| GenerateRequest {
        prefill_step_size: 64,
        ..unstopped_request(prompt, max_tokens)
    };
    let request = long_request(prompt.clone(), expected.long_greedy_ids.len());
    let alone = common::generate_alone(model, tokenizer, &request)
        .unwrap()
        .token_ids;
    assert_eq!(
        alone, expected.long_greedy_ids,
        "{name}: greedy ids past the window"
    );

    // Caches that drop what the window left against caches that keep everything.
    let mut bounded = model.make_cache(None);
    bounded.iter_mut().for_each(|c| c.release_before(i32::MAX));
    let mut full = model.make_cache(None);
    let (mut last_bounded, mut last_full) = (None, None);
    for chunk in prompt.chunks(64) {
        let ids = Array::from_slice(chunk, &[1, chunk.len() as i32]);
        last_bounded = Some(model.forward_sequence(&ids, &mut bounded).unwrap());
        last_full = Some(model.forward_sequence(&ids, &mut full).unwrap());
    }
    let (a, b) = (last_bounded.unwrap(), last_full.unwrap());
    let diff = a
        .as_slice::<f32>()
        .iter()
        .zip(b.as_slice::<f32>())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        diff <= 1e-6,
        "{name}: dropping out-of-window positions changed logits by {diff}"
    );
    let n = prompt.len() as i32;
    let mut sliding = 0;
    for (i, (b, f)) in bounded.iter().zip(&full).enumerate() {
        assert_eq!(b.offset(), n, "{name}: layer {i}");
        match b.window() {
            Some(window) => {
                sliding += 1;
                assert!(
                    b.first_position() > 0 && b.first_position() <= n - window,
                    "{name}: sliding layer {i} holds from {}",
                    b.first_position()
                );
                assert!(
                    b.nbytes() < f.nbytes(),
                    "{name}: sliding layer {i} holds {} bytes, as many as all positions ({})",
                    b.nbytes(),
                    f.nbytes()
                );
            }
            None => assert_eq!(b.first_position(), 0, "{name}: global layer {i}"),
        }
    }
    assert_eq!(sliding > 0, model.has_sliding_window_layers(), "{name}");

    // The batch engine: the long prompt, then (inserted later) one extending it past its
    // cached blocks, each as `generate` gives it alone.
    let mut extended = prompt.clone();
    extended.extend_from_slice(&expected.long_greedy_ids[..5]);
    let extended_alone =
        common::generate_alone(model, tokenizer, &long_request(extended.clone(), 8))
            .unwrap()
            .token_ids;
    let half = prompt[..200].to_vec();
    // Four tokens: the sequence ends before its thirteenth block fills.
    let half_alone = common::generate_alone(model, tokenizer, &long_request(half.clone(), 4))
        .unwrap()
        .token_ids;
    // In slots, and in slots with compiled decode steps (the GPU default; its traced step takes
    // the rings' arrays too).
    for compile_decode in [false, true] {
        let config = BatchConfig {
            compile_decode,
            // Prefill chunks of 64: the prefill slots' rings of
            // sliding layers are then 256 positions (window 8 + chunk 64 + a block of 16,
            // bucketed), as are the decode slots', so the 400-token prompt wraps both.
            prefill_token_budget: 64,
            ..BatchConfig::for_budget(model, 256 << 20, 16, None)
        };
        let mut batch = BatchGenerator::new(model, tokenizer, config.clone(), name);
        // The request's own step size is wider than the budget: each row's chunk still stays
        // within the budget the rings were made for (a wider chunk failed in slots).
        let mut wide = long_request(prompt.clone(), expected.long_greedy_ids.len());
        wide.prefill_step_size = 512;
        let outputs = common::drive(&mut batch, vec![(0, wide)]);
        assert_eq!(
            outputs[0].0.token_ids, alone,
            "{name}: long prompt (compiled {compile_decode})"
        );
        assert_eq!(
            batch.compiled_decode_steps() > 0,
            compile_decode,
            "{name}: compiled decode steps"
        );
        let outputs = common::drive(&mut batch, vec![(0, long_request(extended.clone(), 8))]);
        let (output, _) = &outputs[0];
        assert_eq!(
            output.token_ids, extended_alone,
            "{name}: after a long prefix hit (compiled {compile_decode})"
        );
        assert!(
            output.stats.cached_prompt_tokens >= prompt.len(),
            "{name}: {} prompt tokens came from the prefix cache",
            output.stats.cached_prompt_tokens
        );
        if compile_decode || !model.has_sliding_window_layers() {
            continue;
        }
        // A prefix cache that keeps the sliding layers' KV of one block only (the newest, the
        // 15th of a 240-token prompt): a hit on the prompt's first 200 tokens finds its 12
        // blocks but not the sliding KV its window reads, so it starts from nothing; recomputing those blocks gives them their
        // sliding KV back, and the same prompt then starts after all 12.
        let tight = BatchConfig {
            bounded_layer_bytes: 1,
            ..config
        };
        let mut tight = BatchGenerator::new(model, tokenizer, tight, name);
        common::drive(
            &mut tight,
            vec![(0, long_request(prompt[..240].to_vec(), 4))],
        );
        // At most the rest of the prompt from the partial block after the hit (tail cache).
        for cached in [0..=0, 192..=199] {
            let outputs = common::drive(&mut tight, vec![(0, long_request(half.clone(), 4))]);
            let (output, _) = &outputs[0];
            assert_eq!(
                output.token_ids, half_alone,
                "{name}: a hit cut to its held window"
            );
            let found = output.stats.cached_prompt_tokens;
            assert!(
                cached.contains(&found),
                "{name}: {found} prompt tokens came from the prefix cache, expected {cached:?}"
            );
        }
    }

    // Prompt caches past the window, both ways with mlx_lm, whose sliding layers are
    // `RotatingKVCache`s: mlx_lm's file is a wrapped ring (its last 3 ids decoded one at a
    // time), Perch's holds every position the prefix computed. Each engine continues the
    // other's file with the ids of the whole prompt.
    let (prefix, rest) = prompt.split_at(prompt.len() - 5);
    let json = |ids: &[u32]| serde_json::to_string(ids).unwrap();
    let files = tempfile::tempdir().unwrap();
    let (theirs, ours) = (
        files.path().join("mlx_lm.safetensors"),
        files.path().join("perch.safetensors"),
    );
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    common::served_oracle(
        "prompt_cache.py",
        &["save", &path(dir), &json(prefix), &path(&theirs), "3"],
    );
    let classes = |file: &Path| {
        let (_, metadata) = Array::load_safetensors_with_metadata(file).unwrap();
        (0..model.info().num_layers)
            .map(|i| metadata[&format!("1.{i}")].clone())
            .collect::<Vec<_>>()
    };
    let expected_classes: Vec<&str> = model
        .make_cache(None)
        .iter()
        .map(|c| match c.window() {
            Some(_) => "RotatingKVCache",
            None => "KVCache",
        })
        .collect();
    assert_eq!(classes(&theirs), expected_classes, "{name}: mlx_lm's file");
    let run = |engine: &EngineHandle, prompt: Prompt| {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = alone.len();
        params.ignore_eos = true;
        let done = common::finish(&engine.submit(EngineRequest { prompt, params }).unwrap());
        assert_eq!(done.error, None, "{name}");
        (done.ids, done.stats.cached_prompt_tokens)
    };
    {
        let engine = EngineHandle::load(dir, EngineConfig::default()).unwrap();
        let after_theirs = Prompt::AfterCache {
            cache_file: theirs.clone(),
            tokens: rest.to_vec(),
        };
        assert_eq!(
            run(&engine, after_theirs),
            (alone.clone(), prefix.len()),
            "{name}: Perch continuing mlx_lm's wrapped cache"
        );
        {
            engine
                .save_prompt_cache(Prompt::Tokens(prefix.to_vec()), &ours)
                .unwrap();
            // mlx_lm's file with the prefix's token ids added: where sliding layers hold only
            // their window, it continues requests privately and cannot fill the prefix cache
            // (a model whose layers are all global, as mlx_lm runs mistral3-4bit, can).
            let (arrays, mut metadata) = Array::load_safetensors_with_metadata(&theirs).unwrap();
            metadata.insert("0.perch_tokens".into(), json(prefix));
            let tagged = files.path().join("mlx_lm-tagged.safetensors");
            Array::save_safetensors(
                arrays.iter().map(|(k, v)| (k.as_str(), v)),
                &metadata,
                &tagged,
            )
            .unwrap();
            // Tokens a request continuing it finds cached: the whole private prefix, or the
            // prefix cache's full blocks.
            let cached = match engine.load_prompt_cache(&tagged) {
                Err(err) => {
                    assert!(
                        model.has_sliding_window_layers()
                            && err.to_string().contains("hold only their last positions"),
                        "{name}: {err}"
                    );
                    prefix.len()
                }
                Ok(imported) => {
                    assert!(
                        !model.has_sliding_window_layers() && imported > prefix.len() / 2,
                        "{name}: {imported} tokens imported"
                    );
                    imported
                }
            };
            let after_tagged = Prompt::AfterCache {
                cache_file: tagged,
                tokens: rest.to_vec(),
            };
            assert_eq!(
                run(&engine, after_tagged),
                (alone.clone(), cached),
                "{name}: Perch continuing mlx_lm's wrapped cache with token ids"
            );
        }
        engine.shutdown();
    }
    assert_eq!(classes(&ours), expected_classes, "{name}: Perch's file");
    let out = common::served_oracle(
        "prompt_cache.py",
        &[
            "continue",
            &path(dir),
            &path(&ours),
            &json(rest),
            &alone.len().to_string(),
        ],
    );
    let ids: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(ids, alone, "{name}: mlx_lm continuing Perch's cache");
    // Perch's own file fills another engine's prefix cache (its sliding layers hold every
    // position, as blocks must).
    let engine = EngineHandle::load(dir, EngineConfig::default()).unwrap();
    let imported = engine.load_prompt_cache(&ours).unwrap();
    assert!(
        imported > prefix.len() / 2 && imported <= prefix.len(),
        "{name}: {imported} tokens imported"
    );
    let (ids, cached) = run(&engine, Prompt::Tokens(prompt.clone()));
    assert_eq!(ids, alone, "{name}: after an imported prefix");
    assert!(cached >= imported, "{name}: {cached} cached tokens");
    engine.shutdown();
}
