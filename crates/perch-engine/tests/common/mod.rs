//! What the engine's tests share: the test model and mlx_lm's references (from
//! `perch-test-support`), the oracle, and a driver for the batch.
#![allow(dead_code)]

use std::path::PathBuf;

#[allow(unused_imports)]
pub use perch_test_support::{
    model_dir, oracle_python, reference, reference_cases, run_oracle, ReferenceCase,
};

/// `generate` on `request` alone, nothing done with its tokens as they come: the single-stream
/// run the batch engine's rows and other paths are compared with.
pub fn generate_alone(
    model: &dyn perch_engine::models::Model,
    tokenizer: &perch_engine::Tokenizer,
    request: &perch_engine::GenerateRequest,
) -> perch_engine::Result<perch_engine::GenerateOutput> {
    perch_engine::generate(model, tokenizer, request, |_| {
        std::ops::ControlFlow::Continue(())
    })
}

/// Like [`run_oracle`], on one process of `script` kept for the test binary (`script serve`:
/// a JSON list of arguments a line in, what the command printed as a JSON string a line out),
/// so that the oracle's Python, mlx_lm and a model load once, not once a call. Calls from
/// several tests take turns.
#[allow(dead_code)]
pub fn served_oracle(script: &str, args: &[&str]) -> String {
    use std::collections::HashMap;
    use std::io::{BufRead, Write};
    use std::sync::Mutex;
    struct Served {
        stdin: std::process::ChildStdin,
        stdout: std::io::BufReader<std::process::ChildStdout>,
        /// Kept for the test process's life: the oracle ends when its stdin closes.
        _child: std::process::Child,
    }
    static SERVED: Mutex<Option<HashMap<String, Served>>> = Mutex::new(None);
    let mut served = SERVED.lock().unwrap_or_else(|e| e.into_inner());
    let server = served
        .get_or_insert_with(HashMap::new)
        .entry(script.to_owned())
        .or_insert_with(|| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/oracle")
                .join(script);
            // Its stderr is the test's: a traceback shows there.
            let mut child = std::process::Command::new(oracle_python())
                .arg(path)
                .arg("serve")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("run the mlx_lm oracle");
            Served {
                stdin: child.stdin.take().unwrap(),
                stdout: std::io::BufReader::new(child.stdout.take().unwrap()),
                _child: child,
            }
        });
    let line = serde_json::to_string(args).unwrap();
    let mut answer = String::new();
    let sent = writeln!(server.stdin, "{line}").and_then(|()| server.stdout.read_line(&mut answer));
    if sent.is_err() || !answer.ends_with('\n') {
        // Gone: the next call starts a new one.
        served.as_mut().unwrap().remove(script);
        panic!("{script} serve ended on {args:?} (its stderr is above)");
    }
    match serde_json::from_str(&answer).expect("the oracle answers JSON") {
        serde_json::Value::String(printed) => printed,
        failed => panic!(
            "{script} {args:?} failed: {}",
            failed["error"].as_str().unwrap_or_default()
        ),
    }
}

/// A reference case's chat as the engine's messages.
pub fn chat_messages(case: &ReferenceCase) -> Option<Vec<perch_engine::ChatMessage>> {
    let messages = case.messages.as_ref()?;
    Some(
        messages
            .iter()
            .map(|m| perch_engine::ChatMessage::new(&m.role, &m.content))
            .collect(),
    )
}

/// `max_running` for a batch test of `requests` requests at once: the row bucket that holds them
/// (`perch_sched::shapes::row_bucket`). `BatchGenerator::warm_up` steps every row bucket up to
/// `max_running`; on the CPU each is a forward pass of that many rows, and a compiled one
/// multiplies with MLX's `quantized_matmul` (Perch's kernel cannot be traced), many times slower
/// than Perch's CPU kernel, so room beyond the test's requests only costs time.
pub fn room_for(requests: usize) -> usize {
    perch_sched::shapes::row_bucket(requests)
}

/// The reference cases whose prompt fits in one prefill chunk (every case but the long one), for
/// tests whose pools or schedules are sized for short prompts.
pub fn short_reference_cases() -> Vec<ReferenceCase> {
    let chunk = reference().prefill_step_size;
    reference_cases()
        .into_iter()
        .filter(|c| c.prompt_ids.len() < chunk)
        .collect()
}

/// The ids a case's output must have (see [`ReferenceCase::expected_ids`]).
pub fn expected_ids(case: &ReferenceCase, reason: perch_engine::FinishReason) -> &[u32] {
    case.expected_ids(reason == perch_engine::FinishReason::Stop)
}

/// The reference cases named `ids`, in that order.
pub fn cases(ids: &[&str]) -> Vec<ReferenceCase> {
    ids.iter().map(|id| reference().case(id).clone()).collect()
}

/// The ids Perch outputs for `case` with `max_tokens` `n`: mlx_lm's greedy ids up to its EOS
/// (which Perch does not output: it reports `stop`), cut to `n`. For tests that ask fewer
/// tokens than the reference's `max_tokens` and still check every one against mlx_lm (with
/// [`expected_finish`] for how the request ends).
pub fn expected_prefix(case: &ReferenceCase, n: usize) -> &[u32] {
    let ids = case.expected_ids(case.ends_with_eos);
    assert!(
        n <= ids.len() || case.ends_with_eos,
        "case {}: mlx_lm's reference has {} tokens, not {n}",
        case.id,
        ids.len()
    );
    &ids[..n.min(ids.len())]
}

/// How a request for `case` with `max_tokens` `n` ends: `stop` where mlx_lm's EOS comes within
/// `n` tokens, else `length` (see [`expected_prefix`]).
pub fn expected_finish(case: &ReferenceCase, n: usize) -> perch_engine::FinishReason {
    if case.ends_with_eos && case.greedy_ids.len() <= n {
        perch_engine::FinishReason::Stop
    } else {
        perch_engine::FinishReason::Length
    }
}

/// How a request through the engine ended: its token ids, finish reason, stats and error.
pub struct Finished {
    pub ids: Vec<u32>,
    pub reason: perch_engine::FinishReason,
    pub stats: perch_engine::GenerationStats,
    pub error: Option<String>,
}

/// Reads `stream` to its `Finished` event (each event within 300 s).
pub fn finish(stream: &perch_engine::RequestStream) -> Finished {
    use perch_engine::EngineEvent;
    let mut ids = Vec::new();
    loop {
        match stream
            .events
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("an engine event within 300 s")
        {
            EngineEvent::Token { id, .. } => ids.extend(id),
            EngineEvent::Admitted { .. } => {}
            EngineEvent::Finished {
                finish_reason,
                stats,
                error,
                ..
            } => {
                return Finished {
                    ids,
                    reason: finish_reason,
                    stats,
                    error: error.map(|e| e.message),
                }
            }
        }
    }
}

/// Runs `batch` until every request of `schedule` (inserted at its step) has finished; returns
/// each request's output and the text it streamed, in schedule order.
pub fn drive(
    batch: &mut perch_engine::testing::BatchGenerator<'_>,
    schedule: Vec<(usize, perch_engine::GenerateRequest)>,
) -> Vec<(perch_engine::GenerateOutput, String)> {
    use perch_engine::testing::BatchEvent;
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
                    outputs[index_of[&request]] = Some((*output, text));
                }
                BatchEvent::Refused { request, error } => panic!("{request} refused: {error}"),
                BatchEvent::Admitted { .. } => {}
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

/// `model`'s logits over `prompt` (one sequence, its own caches), every position, float32,
/// flattened.
pub fn prompt_logits(model: &dyn perch_engine::models::Model, prompt: &[u32]) -> Vec<f32> {
    let mut cache = model.make_cache(None);
    model
        .forward_sequence(
            &mlx_rs::Array::from_slice(prompt, &[1, prompt.len() as i32]),
            &mut cache,
        )
        .unwrap()
        .as_dtype(mlx_rs::Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .to_vec()
}
