//! Gemma 3's vision tower and projector against mlx-vlm 0.7.6: a tiny random `gemma3` model written
//! by mlx-vlm (`tests/oracle/tiny_vision.py`), two images' pixel values, and the image features
//! mlx-vlm computes from them; Perch's must match within 1e-4 (float32). Also: every vision weight is
//! read, and the wrong pixel shape is an error.
//!
//! Needs the oracle with mlx-vlm (`PERCH_TEST_PYTHON`, else `target/oracle-venv`, which
//! `scripts/test.sh` creates).

mod common;

use mlx_rs::{Array, Dtype};
use perch_engine::device::Backend;
use perch_engine::models::vision::VisionTower;
use perch_engine::models::LoadContext;
use perch_engine::nn::weights::Weights;

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
