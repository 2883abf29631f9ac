//! Gemma 3 with images against mlx-vlm 0.7.6: a tiny random `gemma3` model written by mlx-vlm
//! (`tests/oracle/tiny_vision.py`), two images' pixel values, the image features mlx-vlm computes
//! from them and its next-token log-probabilities and greedy ids for prompts with one and with two
//! images; Perch's must match within 1e-4 (float32) and exactly. Also: every vision weight is read,
//! the prefix cache is keyed by the image, and bad requests and configs are refused.
//!
//! Needs the oracle with mlx-vlm (`PERCH_TEST_PYTHON`, else `target/oracle-venv`, which
//! `scripts/test.sh` creates).

mod common;

use mlx_rs::{Array, Dtype};
use perch_engine::device::Backend;
use perch_engine::models::vision::VisionTower;
use perch_engine::models::LoadContext;
use perch_engine::nn::weights::Weights;
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{
    ChatMessage, ContentPart, EngineConfig, EngineHandle, EngineRequest, GenerateRequest,
    ImageInput, ImageProcessor, Prompt,
};

/// Writes the oracle's gemma3 and its references into `out`.
fn oracle(out: &std::path::Path) {
    let tokenizer = common::model_dir();
    common::run_oracle(
        "tiny_vision.py",
        &[out.to_str().unwrap(), tokenizer.to_str().unwrap()],
    );
}

/// Gemma 3's image token in the oracle's model.
const IMAGE: u32 = 49153;

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
    oracle(out.path());
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
    assert_eq!(
        tower.resize(),
        perch_engine::image_processor::Resize::Square {
            side: 32,
            tokens: 16
        }
    );
    assert_eq!(tower.tokens([32, 32, 3]).unwrap(), (16, None));
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

/// Qwen3.5's vision tower against mlx-vlm's on three images of different shapes (`[tokens,
/// text hidden]` each; the position grid interpolated down and up), float32, within 1e-4; every
/// vision weight read; pixels of a shape the tower cannot patch refused with a sentence.
#[test]
fn qwen3_5_image_features_match_mlx_vlm() {
    use perch_engine::models::qwen_vision::QwenVisionTower;
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_qwen_vision.py", &[out.path().to_str().unwrap()]);
    let dir = out.path().join("qwen3_5");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut weights = Weights::load(&dir, Backend::current()).unwrap();
    let config_path = dir.join("config.json");
    let mut cx = LoadContext {
        config: &config,
        config_path: &config_path,
        weights: &mut weights,
    };
    let tower = QwenVisionTower::load(&mut cx).unwrap();
    // The picker's judgement: the config and the tower's weights (the file's header here, a
    // weight index below); a conversion without the tower takes no images.
    assert!(perch_engine::models::takes_images(&config, &dir));
    let indexed = out.path().join("indexed");
    std::fs::create_dir(&indexed).unwrap();
    let index = |names: &[&str]| {
        let map: serde_json::Map<String, serde_json::Value> = names
            .iter()
            .map(|n| (n.to_string(), serde_json::json!("model.safetensors")))
            .collect();
        let index = serde_json::json!({ "weight_map": map });
        std::fs::write(
            indexed.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
    };
    index(&["language_model.model.embed_tokens.weight"]);
    assert!(!perch_engine::models::takes_images(&config, &indexed));
    index(&["vision_tower.patch_embed.proj.weight"]);
    assert!(perch_engine::models::takes_images(&config, &indexed));
    let mut text_only = config.clone();
    text_only.as_object_mut().unwrap().remove("vision_config");
    assert!(!perch_engine::models::takes_images(&text_only, &dir));
    let mut scaled = config.clone();
    *scaled
        .pointer_mut("/text_config/rope_parameters/type")
        .unwrap() = serde_json::json!("yarn");
    assert!(
        !perch_engine::models::takes_images(&scaled, &dir),
        "a scaled RoPE"
    );
    let left: Vec<String> = weights
        .remaining()
        .into_iter()
        .filter(|name| !name.starts_with("language_model."))
        .collect();
    assert!(left.is_empty(), "vision weights not read: {left:?}");

    let expected =
        Array::load_safetensors(out.path().join("qwen3_5-expected.safetensors")).unwrap();
    let mut all = Vec::new();
    for i in 0..3 {
        let pixels = &expected[&format!("pixels_{i}")];
        let grid: Vec<i32> = expected[&format!("grid_{i}")].as_slice::<i32>().to_vec();
        let (height, width) = (pixels.shape()[0], pixels.shape()[1]);
        assert_eq!((grid[1] * 16, grid[2] * 16), (height, width));
        assert_eq!(
            tower.grid(&[height as usize, width as usize, 3]),
            Some((grid[1] as usize / 2, grid[2] as usize / 2)),
            "image {i}"
        );
        let ours = tower.encode(pixels).unwrap();
        let theirs = &expected[&format!("features_{i}")];
        assert_eq!(ours.shape(), theirs.shape(), "image {i}");
        assert_eq!(ours.dtype(), Dtype::Float32);
        let largest = largest_abs(theirs);
        let error = largest_abs(&mlx_rs::ops::subtract(&ours, theirs).unwrap());
        assert!(
            largest > 0.1,
            "image {i}: the reference features are not trivial"
        );
        assert!(
            error <= 1e-4 * largest.max(1.0),
            "image {i}: largest difference {error} (largest value {largest})"
        );
        all.push(ours);
    }
    // mlx-vlm's tower over the three at once attends within each image only: the same features.
    let together = mlx_rs::ops::concatenate(&all, 0).unwrap();
    let theirs = &expected["features_all"];
    let error = largest_abs(&mlx_rs::ops::subtract(&together, theirs).unwrap());
    assert!(
        error <= 1e-4 * largest_abs(theirs).max(1.0),
        "three images at once: {error}"
    );

    for shape in [[48, 64, 3], [64, 64, 4], [0, 64, 3]] {
        let wrong = mlx_rs::ops::zeros::<f32>(&shape).unwrap();
        let message = tower.encode(&wrong).err().unwrap().to_string();
        assert!(message.contains("multiples of 32"), "{shape:?}: {message}");
    }
}

/// Qwen3.5's multimodal RoPE positions of prompts with one and two images (and one ending in an
/// image's end token) equal mlx-vlm's `get_rope_index`, delta included; a misplaced image is
/// refused.
#[test]
fn qwen3_5_image_positions_match_mlx_vlm() {
    use perch_engine::models::qwen_vision::{mrope_positions, ImagePlace};
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_qwen_vision.py", &[out.path().to_str().unwrap()]);
    let cases: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(out.path().join("qwen3_5-positions.json")).unwrap())
            .unwrap();
    let expected =
        Array::load_safetensors(out.path().join("qwen3_5-expected.safetensors")).unwrap();
    const PAD: u64 = 49153;
    for case in &cases {
        let ids: Vec<u64> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        let images: Vec<usize> = serde_json::from_value(case["images"].clone()).unwrap();
        // Each run of image tokens is the next image's.
        let mut places = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            if ids[i] != PAD {
                i += 1;
                continue;
            }
            let grid = expected[&format!("grid_{}", images[places.len()])]
                .as_slice::<i32>()
                .to_vec();
            let (rows, cols) = (grid[1] as usize / 2, grid[2] as usize / 2);
            places.push(ImagePlace {
                start: i,
                rows,
                cols,
            });
            i += rows * cols;
        }
        assert_eq!(places.len(), images.len());
        let (positions, delta) = mrope_positions(ids.len(), &places).unwrap();
        let theirs: Vec<Vec<i32>> = serde_json::from_value(case["positions"].clone()).unwrap();
        assert_eq!(positions.to_vec(), theirs, "{ids:?}");
        assert_eq!(delta, case["delta"].as_i64().unwrap() as i32, "{ids:?}");
    }
    let place = |start, rows, cols| ImagePlace { start, rows, cols };
    assert!(
        mrope_positions(10, &[place(4, 2, 4)]).is_err(),
        "past the end"
    );
    assert!(
        mrope_positions(20, &[place(4, 2, 2), place(6, 1, 1)]).is_err(),
        "overlapping"
    );
    assert!(mrope_positions(20, &[place(4, 0, 2)]).is_err(), "empty");
    let (text_only, delta) = mrope_positions(5, &[]).unwrap();
    assert_eq!((text_only[1].clone(), delta), (vec![0, 1, 2, 3, 4], 0));
}

/// Image files as mlx-vlm's Qwen3-VL processor prepares them for Qwen3.5: sizes rounded to
/// multiples of 32, scaled down to the pixel bound or up to the least area (bicubic: within two
/// steps of 255 of PIL's), exact where the size stays; a run of `<|image_pad|>` per image, of
/// the image's token count.
#[test]
fn qwen3_5_image_files_are_prepared_as_mlx_vlm_does() {
    let out = tempfile::tempdir().unwrap();
    common::run_oracle("tiny_qwen_vision.py", &[out.path().to_str().unwrap()]);
    let processor = ImageProcessor::load_qwen(&out.path().join("qwen3_5"), 32).unwrap();
    let resized = Array::load_safetensors(out.path().join("qwen3_5-resized.safetensors")).unwrap();
    let largest_difference = |ours: &ImageInput, theirs: &Array| {
        assert_eq!(
            ours.shape().map(|d| d as i32).to_vec(),
            theirs.shape().to_vec()
        );
        ours.pixels()
            .iter()
            .zip(theirs.as_slice::<f32>())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    };
    let mut prepared = Vec::new();
    for i in 0..3 {
        let png = std::fs::read(out.path().join(format!("qwen3_5-resized-{i}.png"))).unwrap();
        let ours = processor.process(&png).unwrap();
        let error = largest_difference(&ours, &resized[&format!("resized_{i}")]);
        assert!(
            error <= 2.0 * 2.0 / 255.0 + 1e-6,
            "image {i}: pixels differ by {error}"
        );
        prepared.push(ours);
    }
    let expected =
        Array::load_safetensors(out.path().join("qwen3_5-expected.safetensors")).unwrap();
    let png = std::fs::read(out.path().join("qwen3_5-image-0.png")).unwrap();
    let kept = processor.process(&png).unwrap();
    assert_eq!(largest_difference(&kept, &expected["pixels_0"]), 0.0);

    // 64 × 64 is 4 tokens, 288 × 192 is 54.
    let counts: Vec<usize> = prepared.iter().map(|im| processor.tokens(im)).collect();
    assert_eq!(counts, [4, 54, 6]);
    let one = "<|vision_start|><|image_pad|><|vision_end|>";
    let text = format!("a {one} b {one} c");
    let expanded = processor.expand(&text, &prepared[..2]).unwrap();
    let pads = |n: usize| "<|image_pad|>".repeat(n);
    assert_eq!(
        expanded,
        format!(
            "a <|vision_start|>{}<|vision_end|> b <|vision_start|>{}<|vision_end|> c",
            pads(4),
            pads(54)
        )
    );
    let message = processor
        .expand(&text, &prepared)
        .err()
        .unwrap()
        .to_string();
    assert!(message.contains("wrote 2 image(s)"), "{message}");

    // `processor_config.json`'s `image_processor` takes precedence over
    // `preprocessor_config.json`: a 4,096-pixel bound sizes the 300 × 200 image to 64 × 32.
    let dir = out.path().join("qwen3_5");
    std::fs::write(
        dir.join("processor_config.json"),
        r#"{"image_processor": {"max_pixels": 4096}}"#,
    )
    .unwrap();
    let bounded = ImageProcessor::load_qwen(&dir, 32).unwrap();
    let png = std::fs::read(out.path().join("qwen3_5-resized-1.png")).unwrap();
    assert_eq!(bounded.process(&png).unwrap().shape(), [64, 32, 3]);
    // A bound above MAX_IMAGE_TOKENS is lowered to it: a 4,000 × 3,000 image becomes at most
    // 1,280 tokens, not Qwen3-VL's 16,384.
    std::fs::write(
        dir.join("processor_config.json"),
        r#"{"image_processor": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}}}"#,
    )
    .unwrap();
    let large = ImageProcessor::load_qwen(&dir, 32).unwrap();
    let photo = image::RgbImage::from_fn(4000, 3000, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let mut encoded = std::io::Cursor::new(Vec::new());
    photo
        .write_to(&mut encoded, image::ImageFormat::Png)
        .unwrap();
    let prepared = large.process(encoded.get_ref()).unwrap();
    let tokens = large.tokens(&prepared);
    assert!(
        (1000..=perch_engine::image_processor::MAX_IMAGE_TOKENS as usize).contains(&tokens),
        "{tokens} tokens, shape {:?}",
        prepared.shape()
    );
}

/// Qwen3.5 with images through the batch engine against mlx-vlm: prompts with one and two images
/// (positions by Qwen's multimodal RoPE, decode steps shifted by its delta): the next token's
/// log-probabilities within 1e-4 and 8 greedy ids; all three at once beside a text-only request
/// in chunks of 5 that cut the images; a follow-up turn from the cached blocks as computed afresh.
#[test]
fn qwen3_5_prompts_with_images_match_mlx_vlm() {
    let out = tempfile::tempdir().unwrap();
    let tokenizer_dir = common::model_dir();
    common::run_oracle(
        "tiny_qwen_vision.py",
        &[
            out.path().to_str().unwrap(),
            tokenizer_dir.to_str().unwrap(),
        ],
    );
    let dir = out.path().join("qwen3_5");
    let model = perch_engine::models::load(&dir).unwrap();
    assert!(
        model.vision().is_some(),
        "the qwen3_5 checkpoint's vision tower loads"
    );
    let tokenizer = perch_engine::Tokenizer::load(&dir).unwrap();
    let expected =
        Array::load_safetensors(out.path().join("qwen3_5-expected.safetensors")).unwrap();
    let images: Vec<ImageInput> = (0..3)
        .map(|i| {
            let pixels = &expected[&format!("pixels_{i}")];
            let shape = pixels
                .shape()
                .iter()
                .map(|&d| d as usize)
                .collect::<Vec<_>>();
            ImageInput::new(
                pixels.as_slice::<f32>().to_vec(),
                [shape[0], shape[1], shape[2]],
            )
            .unwrap()
        })
        .collect();
    let cases: Vec<PromptCase> =
        serde_json::from_slice(&std::fs::read(out.path().join("qwen3_5-positions.json")).unwrap())
            .unwrap();
    let images_of = |case: &PromptCase| -> Vec<ImageInput> {
        case.images.iter().map(|&i| images[i].clone()).collect()
    };
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "qwen vision");
    assert_cases_alone(&mut batch, &cases, images_of, true, "qwen");
    let text: Vec<u32> = (40..70).collect();
    let alone_text = common::drive(&mut batch, vec![(0, request(&text, vec![], 8))])
        .remove(0)
        .0
        .token_ids;
    let mut schedule = vec![(0, request(&text, vec![], 8))];
    for case in &cases {
        schedule.push((0, request(&case.prompt_ids, images_of(case), 8)));
    }
    let schedule = schedule
        .into_iter()
        .map(|(at, mut r)| {
            r.prefill_step_size = 5;
            (at, r)
        })
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    assert_eq!(
        outputs[0].0.token_ids, alone_text,
        "the text-only request beside them"
    );
    for (n, case) in cases.iter().enumerate() {
        assert_eq!(
            outputs[n + 1].0.token_ids,
            case.greedy_ids,
            "case {n} in one batch"
        );
    }
    // Three prompts prefilling at once in a fresh batch (nothing cached): one pass of 4 rows
    // (the row bucket), one of them padding.
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut three = BatchGenerator::new(model.as_ref(), &tokenizer, config, "three");
    let outputs = common::drive(&mut three, all_at_once(&cases, images_of, None));
    assert!(outputs
        .iter()
        .all(|(o, _)| o.stats.cached_prompt_tokens == 0));
    for (n, case) in cases.iter().enumerate() {
        assert_eq!(
            outputs[n].0.token_ids, case.greedy_ids,
            "case {n}, three at once"
        );
    }

    // A follow-up turn about the second case's images starts from its cached blocks and
    // answers as computed afresh.
    let case = &cases[1];
    let mut follow = case.prompt_ids.clone();
    follow.extend_from_slice(&case.greedy_ids);
    follow.extend_from_slice(&[23, 24, 25]);
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut fresh = BatchGenerator::new(model.as_ref(), &tokenizer, config, "fresh");
    let afresh = common::drive(&mut fresh, vec![(0, request(&follow, images_of(case), 8))])
        .remove(0)
        .0;
    let tower = model.vision().unwrap();
    let passes = tower.passes();
    let (again, _) =
        common::drive(&mut batch, vec![(0, request(&follow, images_of(case), 8))]).remove(0);
    assert!(
        again.stats.cached_prompt_tokens >= 16,
        "{} prompt tokens cached",
        again.stats.cached_prompt_tokens
    );
    // Both images' tokens came from the cache (the prompt's first 16 of them, in full blocks):
    // the tower did not run again.
    assert_eq!(
        tower.passes(),
        passes,
        "cached images are not encoded again"
    );
    assert_eq!(
        again.token_ids, afresh.token_ids,
        "from the cache as computed afresh"
    );

    // The mixture-of-experts variant (Qwen3.5-MoE, Qwen3.6-A3B): a tower of the same shape,
    // the same prompts and images.
    let moe_dir = out.path().join("qwen3_5_moe");
    let moe = perch_engine::models::load(&moe_dir).unwrap();
    assert!(
        moe.vision().is_some(),
        "the qwen3_5_moe checkpoint's tower loads"
    );
    let moe_tokenizer = perch_engine::Tokenizer::load(&moe_dir).unwrap();
    let moe_cases: Vec<PromptCase> = serde_json::from_slice(
        &std::fs::read(out.path().join("qwen3_5_moe-prompts.json")).unwrap(),
    )
    .unwrap();
    let config = BatchConfig::for_budget(moe.as_ref(), 64 << 20, 16, None);
    let mut moe_batch = BatchGenerator::new(moe.as_ref(), &moe_tokenizer, config, "qwen moe");
    assert_cases_alone(&mut moe_batch, &moe_cases, images_of, false, "MoE");
    let outputs = common::drive(&mut moe_batch, all_at_once(&moe_cases, images_of, None));
    for (n, case) in moe_cases.iter().enumerate() {
        assert_eq!(outputs[n].0.token_ids, case.greedy_ids, "MoE case {n}");
    }
}

#[test]
fn hostile_vision_configs_are_refused() {
    let out = tempfile::tempdir().unwrap();
    oracle(out.path());
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

/// The oracle's gemma3 as a model directory Perch loads (the test model's tokenizer in it),
/// its two images as the engine takes them, and mlx-vlm's prompt cases.
fn gemma3_model() -> (
    tempfile::TempDir,
    Box<dyn perch_engine::models::Model>,
    perch_engine::Tokenizer,
    Vec<ImageInput>,
    Vec<PromptCase>,
) {
    let out = tempfile::tempdir().unwrap();
    oracle(out.path());
    let dir = out.path().join("gemma3");
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

/// The largest difference between the batch's next-token log-probabilities for `case`'s prompt
/// with `images` and mlx-vlm's.
fn logprob_error(
    batch: &mut BatchGenerator<'_>,
    case: &PromptCase,
    images: Vec<ImageInput>,
) -> f32 {
    let mut scored = request(&case.prompt_ids, images, 1);
    scored.next_token_logprobs = true;
    let (output, _) = common::drive(batch, vec![(0, scored)]).remove(0);
    let ours = output.next_token_logprobs.expect("log-probabilities");
    ours.iter()
        .zip(&case.logprobs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// Each case's next-token log-probabilities within 1e-4 of mlx-vlm's and, with `greedy`, its 8
/// greedy ids, one request at a time.
fn assert_cases_alone(
    batch: &mut BatchGenerator<'_>,
    cases: &[PromptCase],
    images_of: impl Fn(&PromptCase) -> Vec<ImageInput>,
    greedy: bool,
    label: &str,
) {
    for (n, case) in cases.iter().enumerate() {
        let error = logprob_error(batch, case, images_of(case));
        assert!(
            error <= 1e-4,
            "{label} case {n}: log-probabilities differ by {error}"
        );
        if greedy {
            let one = vec![(0, request(&case.prompt_ids, images_of(case), 8))];
            let (output, _) = common::drive(batch, one).remove(0);
            assert_eq!(
                output.token_ids, case.greedy_ids,
                "{label} case {n}: greedy ids"
            );
        }
    }
}

/// Every case's request at once, 8 tokens each, in chunks of `step` prompt tokens when given.
fn all_at_once(
    cases: &[PromptCase],
    images_of: impl Fn(&PromptCase) -> Vec<ImageInput>,
    step: Option<usize>,
) -> Vec<(usize, GenerateRequest)> {
    cases
        .iter()
        .map(|case| {
            let mut r = request(&case.prompt_ids, images_of(case), 8);
            if let Some(step) = step {
                r.prefill_step_size = step;
            }
            (0, r)
        })
        .collect()
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
    assert_cases_alone(&mut batch, &cases, images_of, false, "gemma3");
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
        .filter(|&t| t != IMAGE)
        .chain([IMAGE; 9])
        .collect();
    let message = refused(&mut batch, request(&cut, images[..1].to_vec(), 4));
    assert!(message.contains("run of 9 image tokens"), "{message}");
    let ends: Vec<u32> = one
        .iter()
        .copied()
        .take_while(|&t| t != IMAGE)
        .chain([IMAGE; 16])
        .collect();
    let message = refused(&mut batch, request(&ends, images[..1].to_vec(), 4));
    assert!(message.contains("ends inside an image"), "{message}");
    let small = ImageInput::new(vec![0.0; 16 * 16 * 3], [16, 16, 3]).unwrap();
    let message = refused(&mut batch, request(one, vec![small], 4));
    assert!(message.contains("takes [32, 32, 3]"), "{message}");
    assert!(ImageInput::new(vec![0.0; 5], [2, 2, 3]).is_err());
    assert!(ImageInput::new(vec![f32::NAN; 12], [2, 2, 3]).is_err());
    // generate() runs no images.
    let message = common::generate_alone(
        model.as_ref(),
        &tokenizer,
        &request(one, images[..1].to_vec(), 4),
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

/// CRC-32 (ISO 3309, as PNG's chunks carry it).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// `bytes` as a data URL of `kind` (`image/png`).
fn data_url(kind: &str, bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!(
        "data:{kind};base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A `side × side` image of varied pixels, encoded as `format`.
fn encoded(side: u32, format: image::ImageFormat) -> Vec<u8> {
    let image = image::RgbImage::from_fn(side, side, |x, y| {
        image::Rgb([(x * 7 + y) as u8, (y * 13) as u8, (x * y) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    image.write_to(&mut out, format).unwrap();
    out.into_inner()
}

/// Image files as transformers' Gemma3ImageProcessor prepares them: a 48 × 40 PNG resized to the
/// tower's 32 × 32 (bilinear, antialiased: within two steps of 255 of PIL's), and a 32 × 32 one
/// not resized (exactly `(v / 255 − 0.5) / 0.5`); the four formats read; bad files refused with
/// a sentence.
#[test]
fn image_files_are_prepared_as_transformers_does() {
    let out = tempfile::tempdir().unwrap();
    oracle(out.path());
    let processor = ImageProcessor::load(&out.path().join("gemma3"), 32, 16).unwrap();
    assert_eq!(
        processor.resize(),
        perch_engine::image_processor::Resize::Square {
            side: 32,
            tokens: 16
        }
    );
    let png = std::fs::read(out.path().join("gemma3-image.png")).unwrap();
    let ours = processor.process(&png).unwrap();
    assert_eq!(ours.shape(), [32, 32, 3]);
    let theirs = Array::load_safetensors(out.path().join("gemma3-image-pixels.safetensors"))
        .unwrap()["pixel_values"]
        .transpose_axes(&[0, 2, 3, 1])
        .unwrap()
        .reshape(&[-1])
        .unwrap();
    let theirs = theirs.as_slice::<f32>();
    let error = ours
        .pixels()
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        error <= 2.0 * 2.0 / 255.0 + 1e-6,
        "resized pixels differ by {error}"
    );

    let square =
        image::RgbImage::from_fn(32, 32, |x, y| image::Rgb([x as u8 * 8, y as u8 * 8, 200]));
    let mut png = std::io::Cursor::new(Vec::new());
    square.write_to(&mut png, image::ImageFormat::Png).unwrap();
    let exact = processor.process(png.get_ref()).unwrap();
    let expected: Vec<f32> = square
        .pixels()
        .flat_map(|p| p.0.map(|v| (f32::from(v) / 255.0 - 0.5) / 0.5))
        .collect();
    let error = exact
        .pixels()
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(error <= 1e-6, "an image of the tower's size: {error}");

    for format in [
        image::ImageFormat::Png,
        image::ImageFormat::Jpeg,
        image::ImageFormat::WebP,
        image::ImageFormat::Gif,
    ] {
        let image = processor.process(&encoded(40, format)).unwrap();
        assert_eq!(image.shape(), [32, 32, 3], "{format:?}");
    }
    let url = data_url("image/png", png.get_ref());
    assert_eq!(
        processor.process_url(&url).unwrap().digest(),
        exact.digest()
    );

    let png = encoded(40, image::ImageFormat::Png);
    let refused = |bytes: &[u8]| processor.process(bytes).unwrap_err().to_string();
    assert!(refused(&png[..png.len() / 2]).contains("damaged"));
    assert!(refused(b"hello, not an image").contains("not an image"));
    assert!(
        refused(b"BM\x00\x00\x00\x00\x00\x00\x00\x00\x36\x00\x00\x00").contains("not supported")
    );
    // A PNG whose header claims 60,000 × 60,000 pixels: refused before anything is decoded.
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend_from_slice(&60_000u32.to_be_bytes());
    ihdr.extend_from_slice(&60_000u32.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut huge = b"\x89PNG\r\n\x1a\n".to_vec();
    huge.extend_from_slice(&13u32.to_be_bytes());
    huge.extend_from_slice(&ihdr);
    huge.extend_from_slice(&crc32(&ihdr).to_be_bytes());
    for chunk in [&b"IDAT"[..], &b"IEND"[..]] {
        huge.extend_from_slice(&0u32.to_be_bytes());
        huge.extend_from_slice(chunk);
        huge.extend_from_slice(&crc32(chunk).to_be_bytes());
    }
    assert!(
        refused(&huge).contains("60000 × 60000"),
        "{}",
        refused(&huge)
    );
    let url = |u: &str| processor.process_url(u).unwrap_err().to_string();
    assert!(url("https://example.com/cat.png").contains("does not fetch"));
    assert!(url("data:image/png,rawbytes").contains("base64"));
    assert!(url("data:image/png;base64,@@@@").contains("base64"));
}

/// The digest of the PNG `png` as `tokenizer`'s processor prepares it.
fn images_digest(png: &[u8], tokenizer: &perch_engine::Tokenizer) -> [u8; 32] {
    *tokenizer
        .image_processor()
        .unwrap()
        .process(png)
        .unwrap()
        .digest()
}

/// A chat whose user message holds an image, through the engine's handle: the prompt the
/// template and the processor make (each image a run of 16 image tokens between Gemma 3's
/// markers), answered as the batch answers those tokens and pixels; the same chat to a text-only
/// model, with too many images, or a remote URL is a request error.
#[test]
fn chats_with_images_through_the_engine() {
    let out = tempfile::tempdir().unwrap();
    oracle(out.path());
    let dir = out.path().join("gemma3");
    let engine = EngineHandle::load(&dir, EngineConfig::default()).unwrap();
    let tokenizer = engine.tokenizer();
    let square = encoded(32, image::ImageFormat::Png);
    let messages = vec![ChatMessage::from_parts(
        "user",
        vec![
            ContentPart::Image(data_url("image/png", &square)),
            ContentPart::Text("What is this?".into()),
        ],
    )];
    let (ids, images) = tokenizer.encode_chat_with_images(&messages, None).unwrap();
    let expected_text = format!(
        "<|im_start|><start_of_turn>user\n\n\n<start_of_image>{}<end_of_image>\n\nWhat is \
         this?<end_of_turn>\n<start_of_turn>model\n",
        "<image_soft_token>".repeat(16)
    );
    assert_eq!(ids, tokenizer.encode(&expected_text, false).unwrap());
    assert_eq!(ids.iter().filter(|&&t| t == IMAGE).count(), 16);
    assert_eq!(images.len(), 1);

    let mut params = GenerateRequest::new(Vec::new());
    params.max_tokens = 6;
    params.ignore_eos = true;
    let stream = engine
        .submit(EngineRequest {
            prompt: Prompt::Chat(messages.clone()),
            params: params.clone(),
        })
        .unwrap();
    let answer = common::finish(&stream);
    let model = perch_engine::models::load(&dir).unwrap();
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), tokenizer, config, "direct");
    let direct = common::drive(&mut batch, vec![(0, request(&ids, images, 6))]);
    assert_eq!(answer.ids, direct[0].0.token_ids);

    let refusal = |engine: &EngineHandle, messages: Vec<ChatMessage>| {
        let stream = engine
            .submit(EngineRequest {
                prompt: Prompt::Chat(messages),
                params: params.clone(),
            })
            .unwrap();
        common::finish(&stream).error.expect("refused")
    };
    let many = vec![ChatMessage::from_parts(
        "user",
        vec![ContentPart::Image(data_url("image/png", &square)); 17],
    )];
    assert!(refusal(&engine, many.clone()).contains("17 images"));
    // A conversation holding 17 images (an app's history) keeps its latest 16, in order.
    let mut history = vec![ChatMessage::from_parts(
        "user",
        vec![ContentPart::Image(data_url(
            "image/png",
            &encoded(40, image::ImageFormat::Png),
        ))],
    )];
    history.push(ChatMessage::new("assistant", "A pattern."));
    history.push(ChatMessage::from_parts(
        "user",
        vec![ContentPart::Image(data_url("image/png", &square)); 16],
    ));
    let fitted = tokenizer.encode_chat_fitting(&history, 4096).unwrap();
    assert_eq!(fitted.dropped_messages, 0);
    assert_eq!(fitted.images.len(), 16);
    assert!(fitted
        .images
        .iter()
        .all(|i| *i.digest() == images_digest(&square, tokenizer)));
    assert_eq!(
        fitted.tokens.iter().filter(|&&t| t == IMAGE).count(),
        16 * 16
    );
    let remote = vec![ChatMessage::from_parts(
        "user",
        vec![ContentPart::Image("https://example.com/a.png".into())],
    )];
    assert!(refusal(&engine, remote).contains("does not fetch"));
    let text = EngineHandle::load(&common::model_dir(), EngineConfig::default()).unwrap();
    assert!(refusal(&text, messages).contains("takes no images"));
}

/// Gemma 4 with images against mlx-vlm (`tests/oracle/tiny_gemma4_vision.py`: per-layer inputs
/// and KV-shared layers in the text model, a tower that standardizes): every tower weight read;
/// each image's features within 1e-4 of `encode_image`'s; image files prepared as its processor
/// does (kept sizes exactly, resized ones within two steps of 255) and written into prompts as
/// `<|image>` + soft tokens + `<image|>`; prompts with one and with two images through the batch
/// engine: next-token log-probabilities within 1e-4 and 8 greedy ids, alone, beside a text-only
/// request in chunks of 5, and again from the prefix cache. The same model with its image tokens
/// attending to each other both ways (`use_bidirectional_attention: "vision"`): its own
/// log-probabilities (unlike the causal ones) within 1e-4 and greedy ids, alone and in chunks of
/// 5 that must keep each image whole; an image longer than the prefill budget refused.
#[test]
fn gemma4_images_match_mlx_vlm() {
    let out = tempfile::tempdir().unwrap();
    let tokenizer_dir = common::model_dir();
    common::run_oracle(
        "tiny_gemma4_vision.py",
        &[
            out.path().to_str().unwrap(),
            tokenizer_dir.to_str().unwrap(),
        ],
    );
    let dir = out.path().join("gemma4");
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert!(perch_engine::models::takes_images(&config, &dir));
    let mut weights = Weights::load(&dir, Backend::current()).unwrap();
    let config_path = dir.join("config.json");
    let mut cx = LoadContext {
        config: &config,
        config_path: &config_path,
        weights: &mut weights,
    };
    let tower = VisionTower::load_gemma4(&mut cx).unwrap();
    let left: Vec<String> = weights
        .remaining()
        .into_iter()
        .filter(|name| !name.starts_with("language_model."))
        .collect();
    assert!(left.is_empty(), "vision weights not read: {left:?}");

    let expected = Array::load_safetensors(out.path().join("gemma4-expected.safetensors")).unwrap();
    let image_of = |pixels: &Array| {
        let s: Vec<usize> = pixels.shape().iter().map(|&d| d as usize).collect();
        ImageInput::new(pixels.as_slice::<f32>().to_vec(), [s[0], s[1], s[2]]).unwrap()
    };
    let images: Vec<ImageInput> = (0..2)
        .map(|i| image_of(&expected[&format!("pixels_{i}")]))
        .collect();
    for (i, image) in images.iter().enumerate() {
        assert_eq!(tower.tokens(image.shape()).unwrap(), (6, None), "image {i}");
        let s = image.shape().map(|d| d as i32);
        let ours = tower.embed(&Array::from_slice(image.pixels(), &s)).unwrap();
        let theirs = &expected[&format!("features_{i}")];
        assert_eq!(ours.shape(), theirs.shape(), "image {i}");
        let largest = largest_abs(theirs);
        let error = largest_abs(&mlx_rs::ops::subtract(&ours, theirs).unwrap());
        assert!(largest > 0.1, "image {i}: the reference is not trivial");
        assert!(
            error <= 1e-4 * largest.max(1.0),
            "image {i}: features differ by {error} (largest value {largest})"
        );
    }
    let message = tower.tokens([100, 48, 3]).err().unwrap().to_string();
    assert!(message.contains("multiples of 48"), "{message}");

    // The processor: sizes it keeps exactly, sizes it changes (96 × 96 is 4 soft tokens,
    // 48 × 288 is 6) within two steps of 255.
    let processor = ImageProcessor::load_gemma4(&dir, 16, 3, 280).unwrap();
    for (i, image) in images.iter().enumerate() {
        let png = std::fs::read(out.path().join(format!("gemma4-image-{i}.png"))).unwrap();
        let kept = processor.process(&png).unwrap();
        assert_eq!(kept.shape(), image.shape());
        assert_eq!(kept.pixels(), image.pixels(), "image {i}: kept pixels");
    }
    let mut resized = Vec::new();
    for i in 0..2 {
        let png = std::fs::read(out.path().join(format!("gemma4-resized-{i}.png"))).unwrap();
        let ours = processor.process(&png).unwrap();
        let theirs = &expected[&format!("resized_{i}")];
        assert_eq!(
            ours.shape().map(|d| d as i32).to_vec(),
            theirs.shape().to_vec()
        );
        let error = ours
            .pixels()
            .iter()
            .zip(theirs.as_slice::<f32>())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(error <= 2.0 / 255.0 + 1e-6, "resized {i}: {error}");
        resized.push(ours);
    }
    let counts: Vec<usize> = resized.iter().map(|im| processor.tokens(im)).collect();
    assert_eq!(counts, [4, 6]);
    let expanded = processor.expand("a <|image|> b", &resized[..1]).unwrap();
    assert_eq!(
        expanded,
        format!("a <|image>{}<image|> b", "<|image|>".repeat(4))
    );

    // Prompts with images through the batch engine.
    let model = perch_engine::models::load(&dir).unwrap();
    assert!(model.vision().is_some(), "the gemma4 tower loads");
    let tokenizer = perch_engine::Tokenizer::load(&dir).unwrap();
    let cases: Vec<PromptCase> =
        serde_json::from_slice(&std::fs::read(out.path().join("gemma4-prompts.json")).unwrap())
            .unwrap();
    let images_of = |case: &PromptCase| -> Vec<ImageInput> {
        case.images.iter().map(|&i| images[i].clone()).collect()
    };
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "gemma4 vision");
    assert_cases_alone(&mut batch, &cases, images_of, true, "gemma4");
    let text: Vec<u32> = (40..70).collect();
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut fresh = BatchGenerator::new(model.as_ref(), &tokenizer, config, "fresh");
    let alone_text = common::drive(&mut fresh, vec![(0, request(&text, vec![], 8))])
        .remove(0)
        .0
        .token_ids;
    let mut schedule = vec![(0, request(&text, vec![], 8))];
    for case in &cases {
        schedule.push((0, request(&case.prompt_ids, images_of(case), 8)));
    }
    let schedule = schedule
        .into_iter()
        .map(|(at, mut r)| {
            r.prefill_step_size = 5;
            (at, r)
        })
        .collect();
    let outputs = common::drive(&mut fresh, schedule);
    assert_eq!(outputs[0].0.token_ids, alone_text, "the text-only request");
    for (n, case) in cases.iter().enumerate() {
        assert_eq!(
            outputs[n + 1].0.token_ids,
            case.greedy_ids,
            "case {n} in one batch, in chunks of 5"
        );
    }
    // A follow-up turn about the second case's images, twice: the second time both images'
    // tokens (positions 2 to 19) come from cached blocks, and the tower does not run.
    let case = &cases[1];
    let mut follow = case.prompt_ids.clone();
    follow.extend_from_slice(&case.greedy_ids);
    follow.extend_from_slice(&[23, 24, 25]);
    let tower = model.vision().unwrap();
    let (first, _) =
        common::drive(&mut batch, vec![(0, request(&follow, images_of(case), 8))]).remove(0);
    let passes = tower.passes();
    let (again, _) =
        common::drive(&mut batch, vec![(0, request(&follow, images_of(case), 8))]).remove(0);
    assert!(
        again.stats.cached_prompt_tokens >= 32,
        "{} prompt tokens cached",
        again.stats.cached_prompt_tokens
    );
    assert_eq!(
        tower.passes(),
        passes,
        "cached images are not encoded again"
    );
    assert_eq!(
        again.token_ids, first.token_ids,
        "from the cache as computed before"
    );

    // Image tokens attending to each other both ways (the 26B-A4B's and 31B's configs).
    let dir = out.path().join("gemma4_both_ways");
    let both_config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert!(perch_engine::models::takes_images(&both_config, &dir));
    let model = perch_engine::models::load(&dir).unwrap();
    assert!(model.vision().unwrap().attends_both_ways());
    let both: Vec<PromptCase> = serde_json::from_slice(
        &std::fs::read(out.path().join("gemma4_both_ways-prompts.json")).unwrap(),
    )
    .unwrap();
    for (n, (b, c)) in both.iter().zip(&cases).enumerate() {
        let apart = b
            .logprobs
            .iter()
            .zip(&c.logprobs)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            apart > 1e-3,
            "case {n}: both ways changes the answer ({apart})"
        );
    }
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer, config, "both ways");
    assert_cases_alone(&mut batch, &both, images_of, false, "both ways");
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut chunked = BatchGenerator::new(model.as_ref(), &tokenizer, config, "both ways, chunks");
    let outputs = common::drive(&mut chunked, all_at_once(&both, images_of, Some(5)));
    for (n, case) in both.iter().enumerate() {
        assert_eq!(
            outputs[n].0.token_ids, case.greedy_ids,
            "both ways, case {n}, in chunks of 5"
        );
    }
    // Chunks of 16: the second prompt's first chunk (images at 3..9 and 13..19) stops before its
    // second image; the same prompt again starts from the cached block 0..16, inside that image.
    let config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    let mut wide = BatchGenerator::new(model.as_ref(), &tokenizer, config, "both ways, 16");
    let outputs = common::drive(&mut wide, all_at_once(&both, images_of, Some(16)));
    for (n, case) in both.iter().enumerate() {
        assert_eq!(
            outputs[n].0.token_ids, case.greedy_ids,
            "both ways, case {n}, chunks of 16"
        );
    }
    let (again, _) =
        common::drive(&mut wide, all_at_once(&both[1..], images_of, Some(16))).remove(0);
    assert_eq!(
        again.stats.cached_prompt_tokens, 16,
        "a hit ending inside an image"
    );
    assert_eq!(
        again.token_ids, both[1].greedy_ids,
        "both ways, from the cache"
    );
    // A bounded KV cache does not keep what the image's tokens attend to.
    let mut bounded = request(&both[0].prompt_ids, images_of(&both[0]), 8);
    bounded.max_kv_size = Some(10);
    let message = wide.insert(bounded).err().unwrap().to_string();
    assert!(message.contains("max_kv_size"), "{message}");
    // An image of 6 tokens with a prefill budget of 4 cannot be computed in one pass.
    let mut config = BatchConfig::for_budget(model.as_ref(), 64 << 20, 16, None);
    config.prefill_token_budget = 4;
    let mut narrow = BatchGenerator::new(model.as_ref(), &tokenizer, config, "narrow");
    let message = narrow
        .insert(request(&both[0].prompt_ids, images_of(&both[0]), 8))
        .err()
        .unwrap()
        .to_string();
    assert!(message.contains("at most 4"), "{message}");
    // Through the engine, such a model's budget takes its processor's largest image (6 tokens
    // here), however low the one configured: the request is answered, not refused.
    let config = EngineConfig {
        prefill_token_budget: 4,
        ..EngineConfig::default()
    };
    let engine = EngineHandle::load(&dir, config).unwrap();
    let stream = engine
        .submit(EngineRequest {
            prompt: Prompt::Tokens(both[0].prompt_ids.clone()),
            params: request(&both[0].prompt_ids, images_of(&both[0]), 8),
        })
        .unwrap();
    let finished = common::finish(&stream);
    assert_eq!(finished.error, None);
    assert_eq!(finished.ids, both[0].greedy_ids, "both ways, budget raised");
    engine.shutdown();
}
