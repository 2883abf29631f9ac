//! Shared test fixtures: the project's `shared/` directory (real model, reference outputs).
#![allow(dead_code)]

use std::path::PathBuf;

/// `../shared` beside the repository, or `PERCH_SHARED_DIR`.
pub fn shared_dir() -> PathBuf {
    let dir = std::env::var_os("PERCH_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    assert!(
        dir.join("models").is_dir(),
        "shared/ not found at {} (set PERCH_SHARED_DIR)",
        dir.display()
    );
    dir
}

/// Runs `tests/oracle/{script}` with `PERCH_TEST_PYTHON` (a Python with mlx_lm 0.32.2) and
/// returns its stdout; panics with its stderr when it fails.
pub fn run_oracle(script: &str, args: &[&str]) -> String {
    let python =
        std::env::var("PERCH_TEST_PYTHON").expect("set PERCH_TEST_PYTHON (scripts/test.sh does)");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(script);
    let out = std::process::Command::new(python)
        .arg(path)
        .args(args)
        .output()
        .expect("run the mlx_lm oracle");
    assert!(
        out.status.success(),
        "{script} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("oracle output is UTF-8")
}

pub fn smollm_dir() -> PathBuf {
    shared_dir().join("models/SmolLM2-135M-Instruct-4bit")
}

/// One case of `reference/smollm2-135m-4bit-greedy.json`.
#[derive(serde::Deserialize, Clone)]
pub struct ReferenceCase {
    pub id: String,
    pub messages: Option<Vec<perch_engine::ChatMessage>>,
    pub text: Option<String>,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_text: String,
}

pub fn reference_cases() -> Vec<ReferenceCase> {
    #[derive(serde::Deserialize)]
    struct File {
        max_tokens: usize,
        cases: Vec<ReferenceCase>,
    }
    let path = shared_dir().join("reference/smollm2-135m-4bit-greedy.json");
    let file: File = serde_json::from_str(&std::fs::read_to_string(&path).expect("reference file"))
        .expect("reference json");
    assert_eq!(file.max_tokens, 32);
    file.cases
}

/// The ids a reference case's output must have: its greedy ids, minus the stop token when the
/// request stopped on one.
pub fn expected_ids(case: &ReferenceCase, reason: perch_engine::FinishReason) -> &[u32] {
    match reason {
        perch_engine::FinishReason::Stop => &case.greedy_ids[..case.greedy_ids.len() - 1],
        _ => &case.greedy_ids[..],
    }
}

/// Runs `batch` until every request of `schedule` (inserted at its step) has finished; returns
/// each request's output and the text it streamed, in schedule order.
pub fn drive(
    batch: &mut perch_engine::batch::BatchGenerator<'_>,
    schedule: Vec<(usize, perch_engine::GenerateRequest)>,
) -> Vec<(perch_engine::GenerateOutput, String)> {
    use perch_engine::batch::BatchEvent;
    use std::collections::HashMap;
    let mut pending: Vec<Option<(usize, perch_engine::GenerateRequest)>> =
        schedule.into_iter().map(Some).collect();
    let mut index_of = HashMap::new();
    let mut streamed: HashMap<u64, String> = HashMap::new();
    let mut outputs: Vec<Option<(perch_engine::GenerateOutput, String)>> =
        (0..pending.len()).map(|_| None).collect();
    let mut step = 0;
    while outputs.iter().any(Option::is_none) {
        for (i, slot) in pending.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|(at, _)| *at <= step) {
                let (_, request) = slot.take().expect("checked");
                index_of.insert(batch.insert(request).expect("request accepted"), i);
            }
        }
        for event in batch.step().expect("step") {
            match event {
                BatchEvent::Token { request, event } => {
                    streamed.entry(request).or_default().push_str(&event.text)
                }
                BatchEvent::Finished { request, output } => {
                    let text = streamed.remove(&request).unwrap_or_default();
                    outputs[index_of[&request]] = Some((output, text));
                }
            }
        }
        step += 1;
        assert!(step < 5000, "the batch does not finish");
    }
    outputs
        .into_iter()
        .map(|o| o.expect("all finished"))
        .collect()
}
