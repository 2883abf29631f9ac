//! Bad model directories and prompts are typed errors with useful messages, never panics.
//! Each case is the test model (SmolLM2) with one thing broken (weights linked, not copied).

mod common;

use std::path::Path;

use perch_engine::api::ErrorKind;
use perch_engine::{models, EngineError, GenerateRequest, Tokenizer};
use serde_json::Value;

/// A copy of the test model whose config.json went through `edit` and whose weights are
/// `weights` (a link to the real file unless given).
fn variant(edit: impl FnOnce(&mut Value), weights: Option<&[u8]>) -> tempfile::TempDir {
    let src = common::model_dir();
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::os::unix::fs::symlink(src.join(f), dir.path().join(f)).unwrap();
    }
    match weights {
        Some(bytes) => std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap(),
        None => std::os::unix::fs::symlink(
            src.join("model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap(),
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    dir
}

fn load_err(dir: &Path) -> EngineError {
    match models::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn truncated_weights() {
    let full = std::fs::read(common::model_dir().join("model.safetensors")).unwrap();
    for cut in [full.len() - 1000, full.len() / 2, 100, 4] {
        let dir = variant(|_| {}, Some(&full[..cut]));
        let err = load_err(dir.path());
        assert!(
            matches!(err, EngineError::CorruptWeights { .. }),
            "cut at {cut}: {err}"
        );
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }
}

#[test]
fn unknown_architecture_lists_the_supported_ones() {
    let dir = variant(|c| c["model_type"] = "gpt_bigcode".into(), None);
    let msg = load_err(dir.path()).to_string();
    assert!(
        msg.contains("gpt_bigcode")
            && msg.contains("llama")
            && msg.contains("qwen2")
            && msg.contains("qwen3"),
        "{msg}"
    );
}

#[test]
fn config_that_disagrees_with_the_weights() {
    let dir = variant(|c| c["hidden_size"] = 640.into(), None);
    assert!(matches!(
        load_err(dir.path()),
        EngineError::ShapeMismatch { .. }
    ));

    let dir = variant(|c| c["num_hidden_layers"] = 31.into(), None);
    let err = load_err(dir.path());
    assert!(
        matches!(&err, EngineError::MissingWeight { name } if name.starts_with("model.layers.30.")),
        "{err}"
    );

    let dir = variant(|c| c["num_hidden_layers"] = 29.into(), None);
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("model.layers.29"), "{msg}");

    let dir = variant(
        |c| drop(c.as_object_mut().unwrap().remove("num_attention_heads")),
        None,
    );
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("num_attention_heads"), "{msg}");

    // Affine weights (float scales) under a config that says mxfp4; a mode MLX has and Perch
    // does not.
    let dir = variant(|c| c["quantization"]["mode"] = "mxfp4".into(), None);
    let msg = load_err(dir.path()).to_string();
    assert!(
        msg.contains("do not fit the config's quantization mode `mxfp4`"),
        "{msg}"
    );
    let dir = variant(|c| c["quantization"]["mode"] = "nvfp4".into(), None);
    let msg = load_err(dir.path()).to_string();
    assert!(msg.contains("\"nvfp4\" is not supported"), "{msg}");
}

#[test]
fn hostile_sizes_are_refused_before_anything_is_built() {
    // Each would otherwise size a pool for 2^31 blocks (0 layers), panic on a capacity overflow
    // (-1), or allocate gigabytes of RoPE tables (a huge head_dim): an error naming the field.
    let cases: [(&str, Value); 9] = [
        ("num_hidden_layers", 0.into()),
        ("num_hidden_layers", (-1).into()),
        ("num_hidden_layers", 100_000.into()),
        ("num_attention_heads", 0.into()),
        ("num_key_value_heads", 4.into()),
        ("head_dim", (1 << 20).into()),
        ("vocab_size", 0.into()),
        ("intermediate_size", (-5).into()),
        ("max_position_embeddings", (1u64 << 40).into()),
    ];
    for (field, value) in cases {
        let dir = variant(|c| c[field] = value.clone(), None);
        let err = load_err(dir.path());
        let msg = err.to_string();
        assert!(
            matches!(err, EngineError::Config { .. }),
            "{field} = {value}: {msg}"
        );
        let named = if field == "max_position_embeddings" {
            "context length"
        } else if field == "num_key_value_heads" {
            "must be a multiple of `num_key_value_heads`"
        } else {
            field
        };
        assert!(msg.contains(named), "{field} = {value}: {msg}");
    }
}

#[test]
fn prompts_that_cannot_run() {
    let dir = variant(|c| c["max_position_embeddings"] = 16.into(), None);
    let model = models::load(dir.path()).unwrap();
    let tokenizer = Tokenizer::load(dir.path()).unwrap();
    let run = |prompt: Vec<u32>| {
        common::generate_alone(model.as_ref(), &tokenizer, &GenerateRequest::new(prompt))
    };
    assert!(matches!(run(vec![]), Err(EngineError::EmptyPrompt)));
    match run(vec![1; 40]) {
        Err(EngineError::PromptTooLong {
            prompt_tokens: 40,
            context_length: 16,
        }) => {}
        other => panic!(
            "expected PromptTooLong, got {:?}",
            other.map(|o| o.token_ids)
        ),
    }
    let vocab = model.info().vocab_size;
    match run(vec![1, 2, vocab as u32]) {
        Err(EngineError::TokenOutOfVocabulary {
            position: 2,
            token,
            vocab_size,
        }) => assert_eq!((token as usize, vocab_size), (vocab, vocab)),
        other => panic!(
            "expected TokenOutOfVocabulary, got {:?}",
            other.map(|o| o.token_ids)
        ),
    }
    // A prompt that fits leaves room for only a few tokens: finish reason `length`, no overflow.
    let out = run(vec![1; 12]).unwrap();
    assert!(out.stats.generation_tokens <= 4);
}

/// Not bad input, but the same fixture: the model split into two shards with an index loads and
/// computes exactly what the single file does.
#[test]
fn sharded_weights_load_like_a_single_file() {
    use mlx_rs::Array;
    use safetensors::SafeTensors;

    let src = common::model_dir();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = file.names().into_iter().map(str::to_string).collect();
    names.sort();
    let dir = variant(|_| {}, None);
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let shard = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = part
            .iter()
            .map(|n| (n.clone(), file.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join(&shard)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), shard.clone().into());
        }
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({ "metadata": {}, "weight_map": weight_map }).to_string(),
    )
    .unwrap();

    let ids = Array::from_slice(&[1u32, 9690, 198, 2683, 359, 253], &[1, 6]);
    let logits = |dir: &Path| {
        let model = models::load(dir).unwrap();
        let out = model
            .forward_sequence(&ids, &mut model.make_cache(None))
            .unwrap();
        out.as_slice::<f32>().to_vec()
    };
    assert_eq!(logits(dir.path()), logits(&src));
}

/// Replaces `name` in a [`variant`] directory (a link there) with `bytes`, or with a link to
/// `target`.
fn replace_file(dir: &Path, name: &str, contents: Result<&[u8], &Path>) {
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    match contents {
        Ok(bytes) => std::fs::write(&path, bytes).unwrap(),
        Err(target) => std::os::unix::fs::symlink(target, &path).unwrap(),
    }
}

#[test]
fn huge_json_files_are_refused_before_they_are_read_whole() {
    use perch_engine::limits::{MAX_CONFIG_BYTES, MAX_TOKENIZER_JSON_BYTES};
    let load = |dir: &Path, name: &str| match name {
        "config.json" | "model.safetensors.index.json" => load_err(dir),
        _ => Tokenizer::load(dir).err().expect("refused"),
    };
    let refused = |err: &EngineError, name: &str, limit: u64| {
        assert!(
            matches!(err, EngineError::FileTooLarge { path, limit: l } if path.ends_with(name) && *l == limit),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("larger than"), "{err}");
    };
    // One byte past the cap (sparse files: nothing is written, nothing should be read).
    for (name, limit) in [
        ("config.json", MAX_CONFIG_BYTES),
        ("model.safetensors.index.json", MAX_CONFIG_BYTES),
        ("tokenizer_config.json", MAX_CONFIG_BYTES),
        ("chat_template.jinja", MAX_CONFIG_BYTES),
        ("tokenizer.json", MAX_TOKENIZER_JSON_BYTES),
    ] {
        let dir = variant(|_| {}, None);
        let path = dir.path().join(name);
        let _ = std::fs::remove_file(&path);
        std::fs::File::create(&path)
            .unwrap()
            .set_len(limit + 1)
            .unwrap();
        refused(&load(dir.path(), name), name, limit);
    }
    // Links to an endless device, which reports no size: read up to the cap, then refused.
    for (name, limit) in [
        ("config.json", MAX_CONFIG_BYTES),
        ("tokenizer.json", MAX_TOKENIZER_JSON_BYTES),
    ] {
        let dir = variant(|_| {}, None);
        replace_file(dir.path(), name, Err(Path::new("/dev/zero")));
        refused(&load(dir.path(), name), name, limit);
    }
}

#[test]
fn a_hostile_chat_template_fails_its_request_and_the_engine_goes_on() {
    use perch_engine::{
        ChatMessage, EngineConfig, EngineEvent, EngineHandle, EngineRequest, FinishReason, Prompt,
    };
    let dir = variant(|_| {}, None);
    // Loops for 10^10 iterations unless stopped.
    replace_file(
        dir.path(),
        "chat_template.jinja",
        Ok(b"{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"),
    );
    let engine = EngineHandle::load(dir.path(), EngineConfig::default()).unwrap();
    let finish = |prompt: Prompt| {
        let stream = engine
            .submit(EngineRequest {
                prompt,
                params: GenerateRequest::new(Vec::new()),
            })
            .unwrap();
        let mut tokens = 0;
        loop {
            match stream
                .events
                .recv_timeout(std::time::Duration::from_secs(120))
                .expect("an answer, not a hang")
            {
                EngineEvent::Token { .. } => tokens += 1,
                EngineEvent::Admitted { .. } => {}
                EngineEvent::Finished {
                    finish_reason,
                    error,
                    ..
                } => {
                    let kind = error.as_ref().map(|e| e.kind);
                    return (tokens, finish_reason, error.map(|e| e.message), kind);
                }
            }
        }
    };
    let (tokens, reason, error, kind) = finish(Prompt::Chat(vec![ChatMessage::new("user", "hi")]));
    assert_eq!(
        (tokens, reason, kind),
        (0, FinishReason::Error, Some(ErrorKind::InvalidRequest))
    );
    let error = error.unwrap();
    assert!(
        error.contains("chat template") && error.contains("instructions"),
        "{error}"
    );
    // A token id past the vocabulary, through the engine: refused too.
    let (_, reason, error, kind) = finish(Prompt::Tokens(vec![1, 1_000_000]));
    assert_eq!(
        (reason, kind),
        (FinishReason::Error, Some(ErrorKind::InvalidRequest))
    );
    assert!(error.unwrap().contains("outside the vocabulary"));
    // The engine serves the next request.
    let (tokens, reason, error, _) = finish(Prompt::Tokens(vec![1, 504, 2988]));
    assert!(tokens > 0 && error.is_none(), "{reason:?} {error:?}");
    engine.shutdown();
}

#[test]
fn a_conversation_longer_than_the_context_drops_its_oldest_turns() {
    use perch_engine::ChatMessage;
    let tokenizer = Tokenizer::load(&common::model_dir()).unwrap();
    let mut messages = vec![ChatMessage::new("system", "You are terse.")];
    for turn in 0..12 {
        messages.push(ChatMessage::new(
            "user",
            format!("Question {turn}: what is {turn} times seven, and why?"),
        ));
        messages.push(ChatMessage::new(
            "assistant",
            format!("It is {}, because seven {turn}s make that.", turn * 7),
        ));
    }
    messages.push(ChatMessage::new("user", "And twelve times seven?"));
    let whole = tokenizer.encode_chat(&messages).unwrap();
    // Everything fits: nothing dropped.
    let fitted = tokenizer
        .encode_chat_fitting(&messages, whole.len())
        .unwrap();
    assert_eq!((fitted.tokens, fitted.dropped_messages), (whole.clone(), 0));
    // Half the room: whole turns go, oldest first, the system prompt stays, and no earlier
    // start would have fit.
    let room = whole.len() / 2;
    let fitted = tokenizer.encode_chat_fitting(&messages, room).unwrap();
    let (tokens, dropped) = (fitted.tokens, fitted.dropped_messages);
    assert!(dropped > 0 && dropped % 2 == 0, "whole turns: {dropped}");
    assert!(tokens.len() <= room);
    let kept = |dropped: usize| {
        let mut kept = vec![messages[0].clone()];
        kept.extend_from_slice(&messages[1 + dropped..]);
        kept
    };
    assert_eq!(tokens, tokenizer.encode_chat(&kept(dropped)).unwrap());
    assert!(tokenizer.encode_chat(&kept(dropped - 2)).unwrap().len() > room);
    let text = tokenizer.decode(&tokens).unwrap();
    assert!(text.contains("You are terse.") && text.contains("twelve times seven"));
    assert!(!text.contains("Question 0:"));
    // Not even the system prompt and the last question fit: an error naming both sizes.
    match tokenizer.encode_chat_fitting(&messages, 10) {
        Err(EngineError::PromptTooLong {
            context_length: 10,
            prompt_tokens,
        }) => assert!(prompt_tokens > 10),
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
}
