//! Fused projections (a layer's q/k/v projections in one matmul, its MLP's gate/up in another:
//! the default on GPUs, `layers::fused_projections`) compute what the separate projections
//! compute. CI has no GPU, so the test forces them on the CPU, with the test model's weights
//! dequantized at load (`PERCH_WEIGHTS=dense`: Perch's CPU kernel keeps quantized projections
//! separate): logits of a prompt within 1e-4, then the greedy ids of every short reference case
//! through `generate` and through the batch engine with batched attention (slot caches). One test
//! function, because it sets process environment variables between loads.

mod common;

use mlx_rs::{ops, Array};
use perch_engine::models;
use perch_engine::models::Model;
use perch_engine::testing::{BatchConfig, BatchGenerator};
use perch_engine::{GenerateRequest, Tokenizer};

fn load(fused: bool) -> Box<dyn Model> {
    std::env::set_var("PERCH_WEIGHTS", "dense");
    std::env::set_var("PERCH_FUSED_PROJECTIONS", if fused { "1" } else { "0" });
    models::load(&common::model_dir()).expect("load the test model")
}

fn greedy(prompt: &[u32]) -> GenerateRequest {
    let mut request = GenerateRequest::new(prompt.to_vec());
    request.max_tokens = 12;
    request.ignore_eos = true;
    request
}

#[test]
fn fused_projections_compute_what_separate_ones_do() {
    let separate = load(false);
    let fused = load(true);
    let tokenizer = Tokenizer::load(&common::model_dir()).unwrap();
    let cases = common::short_reference_cases();

    let prompt = &cases[0].prompt_ids;
    let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
    let logits = |model: &dyn Model| {
        let mut cache = model.make_cache(None);
        model.forward_sequence(&ids, &mut cache).unwrap()
    };
    let (a, b) = (logits(separate.as_ref()), logits(fused.as_ref()));
    assert_eq!(a.shape(), b.shape());
    let diff = ops::abs(ops::subtract(&a, &b).unwrap()).unwrap();
    let largest = ops::max(&diff, None).unwrap().item_exact::<f32>();
    // float32 rounding of other summation orders, relative to the logits' size (as
    // architecture_parity compares with mlx_lm): an absolute 1e-4 failed once at 1.1e-4.
    let scale = ops::max(ops::abs(&a).unwrap(), None)
        .unwrap()
        .item_exact::<f32>();
    assert!(
        largest <= 1e-5 * scale.max(1.0),
        "fused logits differ by {largest} (largest |logit| {scale})"
    );

    let alone = |model: &dyn Model, prompt: &[u32]| {
        common::generate_alone(model, &tokenizer, &greedy(prompt))
            .unwrap()
            .token_ids
    };
    let expected: Vec<Vec<u32>> = cases
        .iter()
        .map(|c| alone(separate.as_ref(), &c.prompt_ids))
        .collect();
    for (case, want) in cases.iter().zip(&expected) {
        assert_eq!(
            &alone(fused.as_ref(), &case.prompt_ids),
            want,
            "{}",
            case.id
        );
    }

    let mut config = BatchConfig::for_budget(fused.as_ref(), 64 << 20, 16, None);
    config.prefill_batch_size = 4;
    let mut batch = BatchGenerator::new(fused.as_ref(), &tokenizer, config, "fused");
    let schedule = cases
        .iter()
        .enumerate()
        .map(|(i, c)| (i, greedy(&c.prompt_ids)))
        .collect();
    let outputs = common::drive(&mut batch, schedule);
    for ((case, want), (output, _)) in cases.iter().zip(&expected).zip(&outputs) {
        assert_eq!(&output.token_ids, want, "{} in the batch", case.id);
    }
}
