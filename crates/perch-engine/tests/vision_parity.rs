//! Gemma 3 with images against mlx-vlm 0.7.6: a tiny random `gemma3` model written by mlx-vlm
//! (`tests/oracle/tiny_vision.py`), two images' pixel values, the image features mlx-vlm computes
//! from them and its next-token log-probabilities and greedy ids for prompts with one and with two
//! images; Perch's must match within 1e-4 (float32) and exactly. Also: every vision weight is read,
//! the prefix cache is keyed by the image, and bad requests and configs are refused.
//!
//! Needs the oracle with mlx-vlm (`PERCH_TEST_PYTHON`, else `target/oracle-venv`, which
//! `scripts/test.sh` creates).

mod common;

use std::ops::ControlFlow;

use mlx_rs::{Array, Dtype};
use perch_engine::device::Backend;
use perch_engine::models::vision::VisionTower;
use perch_engine::models::LoadContext;
use perch_engine::nn::weights::Weights;
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{generate, GenerateRequest, ImageInput};

/// The largest |value| of `a`.
fn largest_abs(a: &Array) -> f32 {
    mlx_rs::ops::abs(a)
        .unwrap()
        .max(None)
        .unwrap()
        .item_exact::<f32>()
}

#[test]
fn gemma3_image_features_match_mlx_vlm() {
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_vision.py", &[out.path().to_str().unwrap()]);
    let dir = out.path().join("gemma3");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut weights = Weights::load(&dir, Backend::current()).unwrap();
    let config_path = dir.join("config.json");
    let mut cx = LoadContext {
        config: &config,
        config_path: &config_path,
        weights: &mut weights,
    };
    let tower = VisionTower::load_gemma3(&mut cx).unwrap();
    assert_eq!((tower.image_size(), tower.tokens_per_image()), (32, 16));
    let left: Vec<String> = weights
        .remaining()
        .into_iter()
        .filter(|name| !name.starts_with("language_model."))
        .collect();
    assert!(left.is_empty(), "vision weights not read: {left:?}");

    let inputs = Array::load_safetensors(out.path().join("gemma3-inputs.safetensors")).unwrap();
    let expected = Array::load_safetensors(out.path().join("gemma3-expected.safetensors")).unwrap();
    // The processor's [images, channels, height, width] as the tower's channels-last layout.
    let pixels = inputs["pixel_values"]
        .transpose_axes(&[0, 2, 3, 1])
        .unwrap();
    let ours = tower.encode(&pixels).unwrap();
    let theirs = &expected["image_features"];
    assert_eq!(ours.shape(), theirs.shape());
    assert_eq!(ours.dtype(), Dtype::Float32);
    let largest = largest_abs(theirs);
    let error = largest_abs(&mlx_rs::ops::subtract(&ours, theirs).unwrap());
    assert!(largest > 0.1, "the reference features are not trivial");
    assert!(
        error <= 1e-4 * largest.max(1.0),
        "largest difference {error} (largest value {largest})"
    );

    // The second image's features are its own (not the first's, not a batch mix).
    let alone = tower
        .encode(&pixels.take_axis(Array::from_slice(&[1], &[1]), 0).unwrap())
        .unwrap();
    let second = theirs.take_axis(Array::from_slice(&[1], &[1]), 0).unwrap();
    let error = largest_abs(&mlx_rs::ops::subtract(&alone, &second).unwrap());
    assert!(error <= 1e-4 * largest.max(1.0), "one image alone: {error}");

    // Pixels of another size are refused with a sentence, not a reshape failure.
    let wrong = mlx_rs::ops::zeros::<f32>(&[1, 16, 16, 3]).unwrap();
    let message = tower.encode(&wrong).err().unwrap().to_string();
    assert!(message.contains("[images, 32, 32, 3]"), "{message}");
}

#[test]
fn hostile_vision_configs_are_refused() {
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_vision.py", &[out.path().to_str().unwrap()]);
    let dir = out.path().join("gemma3");
    let base: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let cases = [
        (
            "/vision_config/patch_size",
            serde_json::json!(5),
            "multiple of patch_size",
        ),
        (
            "/vision_config/num_attention_heads",
            serde_json::json!(3),
            "multiple of num_attention_heads",
        ),
        (
            "/vision_config/image_size",
            serde_json::json!(1_000_000),
            "image_size must be between",
        ),
        (
            "/vision_config/hidden_size",
            serde_json::json!(-4),
            "hidden_size must be between",
        ),
        (
            "/mm_tokens_per_image",
            serde_json::json!(15),
            "square number",
        ),
        (
            "/mm_tokens_per_image",
            serde_json::json!(9),
            "do not pool evenly",
        ),
        (
            "/vision_config/layer_norm_eps",
            serde_json::json!(0.0),
            "layer_norm_eps",
        ),
        (
            "/vision_config/patch_size",
            serde_json::json!("four"),
            "patch_size",
        ),
    ];
    for (pointer, value, expected) in cases {
        let mut config = base.clone();
        *config.pointer_mut(pointer).unwrap() = value;
        let mut weights = Weights::load(&dir, Backend::current()).unwrap();
        let config_path = dir.join("config.json");
        let mut cx = LoadContext {
            config: &config,
            config_path: &config_path,
            weights: &mut weights,
        };
        let message = VisionTower::load_gemma3(&mut cx).err().unwrap().to_string();
        assert!(message.contains(expected), "{pointer}: {message}");
    }
}

#[derive(serde::Deserialize)]
struct PromptCase {
    prompt_ids: Vec<u32>,
    images: Vec<usize>,
    logprobs: Vec<f32>,
    greedy_ids: Vec<u32>,
}

/// The oracle's gemma3 as a model directory Perch loads (the test model's tokenizer beside it),
/// its two images as the engine takes them, and mlx-vlm's prompt cases.
fn gemma3_model() -> (
    tempfile::TempDir,
    Box<dyn perch_engine::models::Model>,
    perch_engine::Tokenizer,
    Vec<ImageInput>,
    Vec<PromptCase>,
) {
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_vision.py", &[out.path().to_str().unwrap()]);
    let dir = out.path().join("gemma3");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(common::model_dir().join(file), dir.join(file)).unwrap();
    }
    let model = perch_engine::models::load(&dir).unwrap();
    let tokenizer = perch_engine::Tokenizer::load(&dir).unwrap();
    let inputs = Array::load_safetensors(out.path().join("gemma3-inputs.safetensors")).unwrap();
    // [images, channels, height, width] → each image channels last.
    let pixels = inputs["pixel_values"]
        .transpose_axes(&[0, 2, 3, 1])
        .unwrap();
    let images = (0..2)
        .map(|i| {
            let one = pixels
                .take_axis(Array::from_slice(&[i], &[1]), 0)
                .unwrap()
                .reshape(&[-1])
                .unwrap();
            ImageInput::new(one.as_slice::<f32>().to_vec(), [32, 32, 3]).unwrap()
        })
        .collect();
    let cases =
        serde_json::from_slice(&std::fs::read(out.path().join("gemma3-prompts.json")).unwrap())
            .unwrap();
    (out, model, tokenizer, images, cases)
}

fn request(prompt: &[u32], images: Vec<ImageInput>, max_tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt.to_vec());
    request.images = images;
    request.max_tokens = max_tokens;
    request.ignore_eos = true;
    request
}

/// Prompts with one and with two images through the batch engine: the next token's
/// log-probabilities within 1e-4 of mlx-vlm's and its greedy ids, alone and in one batch with a
/// text-only request; prompt chunks that cut an image in two; the prefix cache keyed by the
/// image (the same image again is a hit, another image with the same tokens is not).
#[test]
fn gemma3_prompts_with_images_match_mlx_vlm() {
    let (_dir, model, tokenizer, images, cases) = gemma3_model();
    assert!(
        model.vision().is_some(),
        "the gemma3 checkpoint's vision tower loads"
    );
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "vision");
    let images_of = |case: &PromptCase| -> Vec<ImageInput> {
        case.images.iter().map(|&i| images[i].clone()).collect()
    };
    for (n, case) in cases.iter().enumerate() {
        let mut scored = request(&case.prompt_ids, images_of(case), 1);
        scored.next_token_logprobs = true;
        let (output, _) = common::drive(&mut batch, vec![(0, scored)]).remove(0);
        let ours = output.next_token_logprobs.expect("log-probabilities");
        let error = ours
            .iter()
            .zip(&case.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            error <= 1e-4,
            "case {n}: log-probabilities differ by {error}"
        );
    }
    // All at once, with a text-only request between them; chunks of 5 cut the images.
    let text: Vec<u32> = (40..70).collect();
    let alone_text = common::drive(&mut batch, vec![(0, request(&text, vec![], 8))])
        .remove(0)
        .0
        .token_ids;
    let schedule = vec![
        (0, request(&cases[0].prompt_ids, images_of(&cases[0]), 8)),
        (0, request(&text, vec![], 8)),
        (1, request(&cases[1].prompt_ids, images_of(&cases[1]), 8)),
    ];
    let schedule = schedule
        .into_iter()
        .map(|(at, mut r)| {
            r.prefill_step_size = 5;
            (at, r)
        })
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    assert_eq!(outputs[0].0.token_ids, cases[0].greedy_ids, "one image");
    assert_eq!(
        outputs[1].0.token_ids, alone_text,
        "the text-only request beside them"
    );
    assert_eq!(outputs[2].0.token_ids, cases[1].greedy_ids, "two images");

    // A follow-up turn about the first case's image starts from its cached blocks; the same
    // tokens about the other image must not.
    let mut follow = cases[0].prompt_ids.clone();
    follow.extend_from_slice(&cases[0].greedy_ids);
    follow.extend_from_slice(&[23, 24, 25]);
    let fresh = |image: usize| {
        let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
        let mut fresh = BatchGenerator::new(model.as_ref(), &tokenizer, config, "fresh");
        common::drive(
            &mut fresh,
            vec![(0, request(&follow, vec![images[image].clone()], 8))],
        )
        .remove(0)
        .0
        .token_ids
    };
    let (same, _) = common::drive(
        &mut batch,
        vec![(0, request(&follow, images_of(&cases[0]), 8))],
    )
    .remove(0);
    assert!(
        same.stats.cached_prompt_tokens >= 16,
        "the same image again: {} prompt tokens cached",
        same.stats.cached_prompt_tokens
    );
    assert_eq!(
        same.token_ids,
        fresh(0),
        "from the cache as computed afresh"
    );
    let other = images[1 - cases[0].images[0]].clone();
    let (different, _) =
        common::drive(&mut batch, vec![(0, request(&follow, vec![other], 8))]).remove(0);
    // Only the block before the image (its first 4 tokens cannot fill one) could be shared.
    assert_eq!(
        different.stats.cached_prompt_tokens, 0,
        "another image must not reuse the first one's blocks"
    );
    assert_eq!(different.token_ids, fresh(1 - cases[0].images[0]));
    // The image matters: its next token's log-probabilities are not the first image's.
    let scored = |image: &ImageInput| {
        let mut r = request(&follow, vec![image.clone()], 1);
        r.next_token_logprobs = true;
        let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
        let mut fresh = BatchGenerator::new(model.as_ref(), &tokenizer, config, "scored");
        common::drive(&mut fresh, vec![(0, r)])
            .remove(0)
            .0
            .next_token_logprobs
            .unwrap()
    };
    let (a, b) = (scored(&images[0]), scored(&images[1]));
    let apart = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        apart > 1e-3,
        "two images give log-probabilities {apart} apart"
    );
}

/// Requests whose images do not fit their prompt or their model are refused with a sentence.
#[test]
fn bad_image_requests_are_refused() {
    let (_dir, model, tokenizer, images, cases) = gemma3_model();
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "bad");
    let one = &cases[0].prompt_ids;
    let refused = |batch: &mut BatchGenerator<'_>, r: GenerateRequest| {
        batch.insert(r).expect_err("refused").to_string()
    };
    let message = refused(&mut batch, request(one, images.clone(), 4));
    assert!(message.contains("the request has 2"), "{message}");
    let cut: Vec<u32> = one
        .iter()
        .copied()
        .filter(|&t| t != 500)
        .chain([500; 9])
        .collect();
    let message = refused(&mut batch, request(&cut, images[..1].to_vec(), 4));
    assert!(message.contains("run of 9 image tokens"), "{message}");
    let ends: Vec<u32> = one
        .iter()
        .copied()
        .take_while(|&t| t != 500)
        .chain([500; 16])
        .collect();
    let message = refused(&mut batch, request(&ends, images[..1].to_vec(), 4));
    assert!(message.contains("ends inside an image"), "{message}");
    let small = ImageInput::new(vec![0.0; 16 * 16 * 3], [16, 16, 3]).unwrap();
    let message = refused(&mut batch, request(one, vec![small], 4));
    assert!(message.contains("takes [32, 32, 3]"), "{message}");
    assert!(ImageInput::new(vec![0.0; 5], [2, 2, 3]).is_err());
    assert!(ImageInput::new(vec![f32::NAN; 12], [2, 2, 3]).is_err());
    // generate() runs no images.
    let message = generate(
        model.as_ref(),
        &tokenizer,
        &request(one, images[..1].to_vec(), 4),
        |_| ControlFlow::Continue(()),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(message.contains("batch engine"), "{message}");
    // A text-only model says it takes no images; the batch goes on.
    let text_model = perch_engine::models::load(&common::model_dir()).unwrap();
    let text_tokenizer = perch_engine::Tokenizer::load(&common::model_dir()).unwrap();
    let config = BatchConfig::for_budget(text_model.as_ref(), 64 << 20, 16, None);
    let mut text_batch = BatchGenerator::new(text_model.as_ref(), &text_tokenizer, config, "text");
    let message = refused(
        &mut text_batch,
        request(&[1, 2, 3], images[..1].to_vec(), 4),
    );
    assert!(message.contains("takes no images"), "{message}");
    let outputs = common::drive(&mut batch, vec![(0, request(one, images[..1].to_vec(), 8))]);
    assert_eq!(
        outputs[0].0.token_ids, cases[0].greedy_ids,
        "the batch goes on"
    );
}
