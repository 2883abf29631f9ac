//! End-to-end tests of the `perch` binary: the default model's path from GGUF to text, bad input
//! reported as one line with a non-zero exit, and `perch serve` answering over HTTP.
//!
//! Runs on the test model and the default model's GGUF that `scripts/test-inputs.sh` makes
//! (`perch-test-support`).

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn perch(args: &[&str]) -> Output {
    perch_with_env(args, &[])
}

/// Runs `perch` with `args` (ending in `--json`), checks it succeeded, and returns its stdout and
/// the JSON object on its last line.
fn perch_report(args: &[&str]) -> (String, serde_json::Value) {
    let out = perch(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let report = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    (stdout, report)
}

fn perch_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run perch")
}

fn test_model() -> String {
    perch_test_support::model_dir()
        .to_string_lossy()
        .into_owned()
}

/// The failure contract: exit code 1, one line on stderr starting `perch: error:`, no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    assert!(stderr.starts_with("perch: error: "), "{stderr}");
    assert!(stderr.contains(needle), "`{needle}` not in: {stderr}");
}

#[test]
fn imported_gguf_answers_paris() {
    let gguf = perch_test_support::gguf_path()
        .to_string_lossy()
        .into_owned();
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("smollm2");
    let out = perch(&["import", &gguf, "--out", out_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // The import, as users run it, generates mlx_lm's reference continuation (made on the
    // float32 copy of the same weights) token for token.
    let reference = perch_test_support::reference();
    let case = reference.case("raw-text");
    let out = perch(&[
        "generate",
        "--model",
        out_dir.to_str().unwrap(),
        "--raw",
        case.text.as_deref().unwrap(),
        "--max-tokens",
        &reference.max_tokens.to_string(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text: String = lines.iter().filter_map(|l| l["text"].as_str()).collect();
    let ids: Vec<u32> = (lines.iter())
        .filter_map(|l| l["token"].as_u64())
        .map(|id| id as u32)
        .collect();
    let last = lines.last().unwrap();
    let stopped = last["finish_reason"] == "stop";
    assert_eq!(ids, case.expected_ids(stopped));
    assert_eq!(text, case.greedy_text);
    assert!(text.contains("Paris"), "continuation: {text:?}");
    assert_eq!(last["stats"]["prompt_tokens"], case.prompt_ids.len());

    // Importing over an existing model is refused and leaves it intact.
    let before = std::fs::read(out_dir.join("config.json")).unwrap();
    let again = perch(&["import", &gguf, "--out", out_dir.to_str().unwrap()]);
    assert_clean_error(&again, "");
    assert_eq!(std::fs::read(out_dir.join("config.json")).unwrap(), before);
}

#[test]
fn generate_streams_plain_text_with_a_chat_template() {
    let out = perch(&[
        "generate",
        "--model",
        &test_model(),
        "--prompt",
        "What is 2 + 2?",
        "--max-tokens",
        "8",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(!text.trim().is_empty());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tok/s"),
        "stats line on stderr"
    );
}

#[test]
fn bad_input_is_one_line_and_exit_code_1() {
    let tmp = tempfile::tempdir().unwrap();
    let model = test_model();

    assert_clean_error(
        &perch(&[
            "generate",
            "--model",
            "/nonexistent/model",
            "--prompt",
            "hi",
        ]),
        "no model at /nonexistent/model",
    );
    assert_clean_error(
        &perch(&["generate", "--model", &model, "--prompt", "  "]),
        "the prompt is empty",
    );
    assert_clean_error(&perch(&["generate", "--model", &model]), "--prompt");

    let messages = tmp.path().join("messages.json");
    std::fs::write(&messages, r#"{"role": "user"}"#).unwrap();
    assert_clean_error(
        &perch(&[
            "generate",
            "--model",
            &model,
            "--messages",
            messages.to_str().unwrap(),
        ]),
        "messages",
    );

    let gguf = tmp.path().join("bad.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").unwrap();
    assert_clean_error(
        &perch(&[
            "import",
            gguf.to_str().unwrap(),
            "--out",
            tmp.path().join("o").to_str().unwrap(),
        ]),
        "bad.gguf",
    );
    assert!(!tmp.path().join("o").exists());

    let not_gguf = tmp.path().join("x.gguf");
    std::fs::write(&not_gguf, b"hello world, not a gguf").unwrap();
    assert_clean_error(
        &perch(&[
            "import",
            not_gguf.to_str().unwrap(),
            "--out",
            tmp.path().join("o").to_str().unwrap(),
        ]),
        "x.gguf",
    );
}

#[test]
fn messages_file_and_sampling_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let messages = tmp.path().join("m.json");
    std::fs::write(
        &messages,
        r#"[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi."}]"#,
    )
    .unwrap();
    let args = [
        "generate",
        "--model",
        &test_model(),
        "--messages",
        messages.to_str().unwrap(),
        "--max-tokens",
        "6",
        "--temp",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "3",
        "--json",
    ];
    let a = perch(&args);
    let b = perch(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let tokens = |o: &Output| -> Vec<u64> {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["token"].as_u64())
            .collect()
    };
    assert!(!tokens(&a).is_empty());
    assert_eq!(tokens(&a), tokens(&b), "same seed, same sample");

    // XTC on every token (mlx_lm's flags): the top choices are excluded, so the sample changes.
    let xtc = [
        &args[..],
        &["--xtc-probability", "1", "--xtc-threshold", "0.05"],
    ]
    .concat();
    let c = perch(&xtc);
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    assert!(!tokens(&c).is_empty());
    assert_ne!(tokens(&a), tokens(&c), "XTC changed nothing");
    let bad = [
        &args[..],
        &["--xtc-probability", "0.5", "--xtc-threshold", "0.7"],
    ]
    .concat();
    assert_clean_error(&perch(&bad), "xtc_threshold must be in [0, 0.5]");
}

#[test]
fn chat_keeps_the_conversation_and_resets() {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["chat", "--model", &test_model(), "--max-tokens", "6"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is 2 + 2?\nAnd times three?\n/reset\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches("tok/s").count(), 2, "two answers: {stderr}");
    assert!(stderr.contains("(conversation cleared)"));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count(),
        2
    );
}

#[test]
fn logit_bias_changes_the_greedy_token() {
    let model = test_model();
    let first = |extra: &[&str]| -> u64 {
        let mut args = vec![
            "generate",
            "--model",
            &model,
            "--raw",
            "The capital of France is",
            "--max-tokens",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = perch(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap()
            .to_string();
        serde_json::from_str::<serde_json::Value>(&line).unwrap()["token"]
            .as_u64()
            .unwrap()
    };
    let greedy = first(&[]);
    let banned = format!("{greedy}=-1000");
    assert_ne!(first(&["--logit-bias", &banned]), greedy);
    assert_clean_error(
        &perch(&[
            "generate",
            "--model",
            &model,
            "--raw",
            "x",
            "--logit-bias",
            "999999=1",
        ]),
        "logit_bias",
    );
}

/// `perch generate --model MODEL INPUT.. --max-tokens N --json EXTRA..`'s lines, parsed; it
/// must succeed.
fn generate_json(
    model: &str,
    input: &[&str],
    max_tokens: usize,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let max_tokens = max_tokens.to_string();
    let mut args = vec!["generate", "--model", model];
    args.extend_from_slice(input);
    args.extend_from_slice(&["--max-tokens", &max_tokens, "--json"]);
    args.extend_from_slice(extra);
    let out = perch(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The token ids of [`generate_json`]'s lines.
fn generated_ids(lines: &[serde_json::Value]) -> Vec<u64> {
    lines.iter().filter_map(|l| l["token"].as_u64()).collect()
}

/// `perch generate --image`: a tiny random Qwen3.5 with its vision tower (mlx-vlm writes it,
/// `crates/perch-engine/tests/oracle/tiny_qwen_vision.py`) answers a prompt with an image through
/// the batch engine, its prompt 8 tokens longer than without (the image's 6 tokens between the
/// vision markers) and the same answer twice (greedy); a text-only model, a missing file and
/// `--image` without `--prompt` end in one-line errors. `perch bench --image` measures requests
/// that each hold the image (their prompts counted with its tokens); with `--http` it is refused.
#[test]
fn generate_with_an_image() {
    let out = tempfile::tempdir().unwrap();
    let script = perch_test_support::workspace_dir()
        .join("crates/perch-engine/tests/oracle/tiny_qwen_vision.py");
    let made = std::process::Command::new(perch_test_support::oracle_python())
        .arg(&script)
        .arg(out.path())
        .arg(perch_test_support::model_dir())
        .output()
        .expect("run the oracle");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let model = out.path().join("qwen3_5");
    let model = model.to_str().unwrap();
    let image = out.path().join("qwen3_5-image-0.png");
    let image = image.to_str().unwrap();
    let prompt = ["--prompt", "What is in the picture?"];
    let with = generate_json(model, &[&prompt[..], &["--image", image]].concat(), 4, &[]);
    let again = generate_json(model, &[&prompt[..], &["--image", image]].concat(), 4, &[]);
    let without = generate_json(model, &prompt, 4, &[]);
    assert_eq!(generated_ids(&with).len(), 4);
    assert_eq!(generated_ids(&with), generated_ids(&again), "greedy, twice");
    // Over two ranks started by one command (pipeline stages of 2 layers each): the batch
    // engine over ranks, rank 0's request carrying the image's pixels to the other rank; the
    // same ids as one process.
    let port = consecutive_free_ports().to_string();
    let divided = generate_json(
        model,
        &[&prompt[..], &["--image", image]].concat(),
        4,
        &two_local_stages(&port),
    );
    assert_eq!(
        generated_ids(&divided),
        generated_ids(&with),
        "over two ranks"
    );
    let prompt_tokens = |lines: &[serde_json::Value]| {
        lines.last().unwrap()["stats"]["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(prompt_tokens(&with), prompt_tokens(&without) + 8);
    // The same image as an `image_url` part of a messages file: the same request.
    let url = {
        use base64::Engine as _;
        let bytes = std::fs::read(image).unwrap();
        format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    };
    let chat = serde_json::json!([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is in the picture?"},
    ]}]);
    let file = out.path().join("chat.json");
    std::fs::write(&file, chat.to_string()).unwrap();
    let from_file = generate_json(model, &["--messages", file.to_str().unwrap()], 4, &[]);
    assert_eq!(
        generated_ids(&from_file),
        generated_ids(&with),
        "a messages file's image"
    );

    let text_only = test_model();
    let refused = perch(&[
        "generate",
        "--model",
        &text_only,
        "--prompt",
        "hi",
        "--image",
        image,
        "--max-tokens",
        "2",
    ]);
    assert_clean_error(&refused, "this model takes no images");
    let missing = perch(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--image",
        "/nonexistent.png",
    ]);
    assert_clean_error(&missing, "/nonexistent.png");
    let no_prompt = perch(&[
        "generate", "--model", model, "--raw", "hi", "--image", image,
    ]);
    assert_clean_error(&no_prompt, "--image goes with --prompt");

    let bench = |extra: &[&str]| {
        let args = [
            &[
                "bench",
                "--model",
                model,
                "--concurrency",
                "2",
                "--image",
                image,
                "--prompt-tokens",
                "16",
                "--gen-tokens",
                "4",
                "--runs",
                "1",
            ][..],
            extra,
        ]
        .concat();
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    };
    let args = bench(&["--json"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, report) = perch_report(&args);
    let counted = report["prompt_tokens"].as_u64().unwrap();
    assert!(
        counted >= 16 + 8,
        "{counted} prompt tokens: the image's are in"
    );
    assert!(report["generation_tps"].as_f64().unwrap() > 0.0);
    let args = bench(&["--http"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(&perch(&args), "--image is measured on the engine directly");
}

/// mlx_lm's KV cache flags reach generation (their numerics are checked against mlx_lm in
/// `crates/perch-engine/tests/kv_cache_options.rs`): a cache bounded below the prompt, and a
/// cache quantized to 2 bits from the start, each change the greedy answer; the two together are
/// refused, as `perch bench --concurrency` refuses the bound.
#[test]
fn kv_cache_flags_change_generation() {
    let model = test_model();
    let tokens = |extra: &[&str]| -> Vec<u64> {
        let input = [
            "--raw",
            "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
        ];
        generated_ids(&generate_json(&model, &input, 8, extra))
    };
    let plain = tokens(&[]);
    assert_eq!(plain.len(), 8);
    assert_ne!(
        tokens(&["--max-kv-size", "8"]),
        plain,
        "--max-kv-size changed nothing"
    );
    assert_ne!(
        tokens(&[
            "--kv-bits",
            "2",
            "--kv-group-size",
            "32",
            "--quantized-kv-start",
            "0"
        ]),
        plain,
        "--kv-bits changed nothing"
    );
    assert_clean_error(
        &perch(&[
            "generate",
            "--model",
            &model,
            "--raw",
            "x",
            "--max-kv-size",
            "64",
            "--kv-bits",
            "8",
        ]),
        "cannot be combined",
    );
    assert_clean_error(
        &perch(&[
            "bench",
            "--model",
            &model,
            "--concurrency",
            "2",
            "--max-kv-size",
            "64",
            "--http",
        ]),
        "not with --http",
    );
}

/// Speculative decoding from the command line (its numerics: `crates/perch-engine/tests/
/// speculative.rs`): greedy with the model as its own draft answers what it answers alone, the
/// accepted tokens say so, and the stats count the proposals.
#[test]
fn draft_model_flag_speculates() {
    let model = test_model();
    let lines =
        |extra: &[&str]| generate_json(&model, &["--prompt", "Name three colours."], 10, extra);
    let ids = generated_ids;
    let plain = lines(&[]);
    let drafted = lines(&["--draft-model", &model, "--num-draft-tokens", "2"]);
    assert_eq!(ids(&drafted), ids(&plain));
    assert!(drafted
        .iter()
        .filter(|l| l["token"].is_u64())
        .any(|l| l["from_draft"] == true));
    let stats = &drafted.last().unwrap()["stats"];
    assert!(stats["draft_tokens"].as_u64().unwrap() > 0);
    assert!(stats["accepted_draft_tokens"].as_u64().unwrap() > 0);
    assert!(plain.iter().all(|l| l.get("from_draft").is_none()));
    // With a logits processor each position is processed after the tokens before it: still the
    // answer without a draft.
    let penalty = ["--repetition-penalty", "1.5"];
    let drafted = lines(&[&penalty[..], &["--draft-model", &model]].concat());
    assert_eq!(ids(&drafted), ids(&lines(&penalty)));
    assert_clean_error(
        &perch(&[
            "generate",
            "--model",
            &model,
            "--raw",
            "x",
            "--draft-model",
            &model,
            "--num-draft-tokens",
            "0",
        ]),
        "num_draft_tokens must be 1 to 64",
    );
}

#[test]
fn batch_bench_reports_every_field() {
    let (_, report) = perch_report(&[
        "bench",
        "--model",
        &test_model(),
        "--concurrency",
        "2",
        "--prompt-tokens",
        "6",
        "--gen-tokens",
        "3",
        "--shared-prefix-tokens",
        "2",
        "--json-requests",
        "1",
        "--json",
    ]);
    for key in [
        "prompt_tps",
        "generation_tps",
        "ttft_ms_p50",
        "ttft_ms_p95",
        "itl_ms_p50",
        "itl_ms_p95",
        "peak_memory_bytes",
    ] {
        assert!(
            report[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {report}"
        );
    }
    assert!(report["ttft_ms_p95"].as_f64() >= report["ttft_ms_p50"].as_f64());
    assert!(report.get("prefix_cache_hit_rate").is_some());
    assert_eq!(report["concurrency"], 2);
    assert!(
        report["engine_prefill_passes"].as_u64() >= Some(1),
        "{report}"
    );
    // Bad combinations: a clean error naming the option.
    let model = test_model();
    for (bad, named) in [
        (
            ["--json-requests", "3", "--prompt-tokens", "6"],
            "--json-requests must be at most --concurrency",
        ),
        (
            ["--prompt-tokens", "4", "--shared-prefix-tokens", "4"],
            "shared-prefix-tokens",
        ),
    ] {
        let args = [
            &["bench", "--model", &model, "--concurrency", "2"][..],
            &bad[..],
        ]
        .concat();
        assert_clean_error(&perch(&args), named);
    }
}

/// `--first-prompts` waits for the idle warm-up and reports each prompt length's TTFT twice.
#[test]
fn batch_bench_first_prompts_reports_each_length_after_the_warm_up() {
    // The GPU path on CPU, with the idle warm-up on: it runs before the first request.
    let (_, report) = perch_report(&[
        "bench",
        "--model",
        &test_model(),
        "--concurrency",
        "2",
        "--prefill-token-budget",
        "32",
        "--idle-warm-up",
        "true",
        "--kv-cache-mib",
        "256",
        "--first-prompts",
        "5,40",
        "--json",
    ]);
    // Budget 32, one prompt a pass (the CPU's prefill batch size): widths 16 and 32, a decode
    // step at capacities 512 to 1,280 (a quarter of the 256 MiB pool's 5,825 float32 tokens),
    // a long prompt's next three chunks (9 passes), then the load's decode shapes (1 and 2 rows).
    assert!(report["warm_up_shapes"].as_u64() > Some(9), "{report}");
    let rows = report["first_prompts"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{report}");
    for (row, len) in rows.iter().zip([5, 40]) {
        assert_eq!(row["prompt_tokens"], len);
        for key in ["ttft_ms_first", "ttft_ms_again"] {
            assert!(row[key].as_f64() > Some(0.0), "{key}: {report}");
        }
    }
}

/// `--http` runs the same workload through the local API (an in-process server) and reports both
/// runs; every request of both generated all its tokens.
#[test]
fn batch_bench_through_http_reports_both_runs() {
    let (stdout, both) = perch_report(&[
        "bench",
        "--model",
        &test_model(),
        "--concurrency",
        "3",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "4",
        "--http",
        "--json",
    ]);
    assert!(stdout.contains("through HTTP, 3 concurrent"), "{stdout}");
    for run in ["direct", "http"] {
        let report = &both[run];
        assert_eq!(report["concurrency"], 3, "{both}");
        assert!(
            report["generation_tps"].as_f64() > Some(0.0),
            "{run}: {both}"
        );
        assert!(report["ttft_ms_p50"].as_f64() > Some(0.0), "{run}: {both}");
    }
    assert!(both["http_generation_ratio"].as_f64() > Some(0.0));
}

/// `--output-ids` writes what each path generated (scripts/parity_gpu.py compares them on a GPU):
/// on CPU the batch engine's greedy ids equal the single-stream ones (the numerics:
/// `crates/perch-engine/tests/batch_parity.rs`).
#[test]
fn bench_output_ids_match_between_single_stream_and_batch() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let prompts: Vec<Vec<u32>> = vec![(100..120).collect(), (300..307).collect()];
    std::fs::write(
        path("one.json"),
        serde_json::to_string(&prompts[0]).unwrap(),
    )
    .unwrap();
    std::fs::write(path("all.json"), serde_json::to_string(&prompts).unwrap()).unwrap();
    let run = |args: &[&str]| {
        let out = perch(args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let model = test_model();
    let common = ["bench", "--model", &model, "--gen-tokens", "5"];
    let (one, single, all) = (path("one.json"), path("single.json"), path("all.json"));
    run(&[
        &common[..],
        &["--prompt-ids", &one, "--runs", "1", "--output-ids", &single],
    ]
    .concat());
    let read = |p: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let single = read(&single);
    assert_eq!(single.as_array().map(Vec::len), Some(5), "{single}");
    // Both prompts at once through the batch engine, their ids written to `out`.
    let batch_of_two = |out: &str, more: &[&str]| {
        run(&[
            &common[..],
            &[
                "--concurrency",
                "2",
                "--prompt-ids",
                &all,
                "--output-ids",
                out,
                "--json",
            ],
            more,
        ]
        .concat())
    };
    let batch = path("batch.json");
    batch_of_two(&batch, &[]);
    let batch = read(&batch);
    assert_eq!(batch.as_array().map(Vec::len), Some(2), "{batch}");
    assert_eq!(batch[1].as_array().map(Vec::len), Some(5), "{batch}");
    assert_eq!(batch[0], single);
    // The batch engine over two pipeline stages started by this one command (rank 0 runs the
    // workload and reports it; the other follows): the same ids.
    let divided = path("divided.json");
    let port = consecutive_free_ports().to_string();
    let report = batch_of_two(&divided, &two_local_stages(&port));
    assert_eq!(read(&divided), batch, "over two ranks");
    let line = report.lines().rfind(|l| l.starts_with('{')).unwrap();
    let report: serde_json::Value = serde_json::from_str(line).unwrap();
    assert!(report["generation_tps"].as_f64() > Some(0.0), "{report}");
    // Over ranks, bench measures the batch engine only.
    let refused = perch(&[&common[..], &["--distributed", "pipeline"]].concat());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(
        said.contains("--distributed measures the batch engine over ranks"),
        "{said}"
    );
}

#[test]
fn search_pull_then_generate_by_repository_id() {
    use perch_hub::fake_hub::{FakeHub, FakeRepo};
    const REPO: &str = "mlx-community/SmolLM2-135M-Instruct-4bit";
    let mut repo = FakeRepo::from_dir(REPO, std::path::Path::new(&test_model())).unwrap();
    repo.safetensors_parameters = [("U32".to_owned(), 1000), ("BF16".to_owned(), 500)].into();
    // A model of an architecture Perch does not run (yet).
    let mamba = FakeRepo::new(
        "mlx-community/mamba-130m-hf-f32",
        vec![(
            "config.json",
            br#"{"architectures": ["MambaForCausalLM"], "model_type": "mamba"}"#.to_vec(),
        )],
    );
    // A Llama whose weights and whole context's KV (30 layers of 3 KV heads of 64 features,
    // keys and values, float32 on CPU: 46,080 bytes a token, 8,192 tokens) just fit this
    // machine's usable memory.
    const BIG: &str = "mlx-community/Big-Llama-4bit";
    let usable = perch_hub::total_memory_bytes() as f64 * perch_hub::USABLE_MEMORY_FRACTION;
    let kv = 46_080 * 8_192;
    let mut big = FakeRepo::new(
        BIG,
        vec![(
            "config.json",
            std::fs::read(PathBuf::from(test_model()).join("config.json")).unwrap(),
        )],
    );
    big.safetensors_parameters = [("U32".to_owned(), (usable as u64 - kv) / 4)].into();
    // And one 1.2 times that: too large here, 0.6 of it a machine over two.
    let mut huge = big.clone();
    huge.id = "mlx-community/Huge-Llama-4bit".to_owned();
    huge.safetensors_parameters = [("U32".to_owned(), (usable * 1.2 / 4.0) as u64)].into();
    let hub = FakeHub::start(vec![repo, mamba, big, huge]);
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_str().unwrap();
    let env = [
        ("HF_ENDPOINT", hub.url()),
        ("HF_HUB_CACHE", cache_dir),
        ("HF_TOKEN", ""),
    ];
    let stdout = |out: &Output| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        String::from_utf8(out.stdout.clone()).unwrap()
    };

    let found = stdout(&perch_with_env(&["search", "smollm"], &env));
    let row = found.lines().find(|l| l.starts_with(REPO)).expect(&found);
    assert!(
        row.contains("5.0 kB") && row.contains("yes"),
        "size and fit: {row}"
    );
    assert!(row.ends_with("  llama"), "architecture: {row}");
    // Its config gives its KV bytes per token (30 layers of 3 KV heads of 64 features, keys and
    // values, float32 on CPU: 46,080): a 2 GiB budget holds its whole 8,192-token context, a
    // 1 MiB one 22 tokens.
    let columns: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(columns[4], "8,192", "context: {row}");
    let small = stdout(&perch_with_env(
        &["search", "smollm", "--kv-cache-mib", "1"],
        &env,
    ));
    let row = small.lines().find(|l| l.starts_with(REPO)).expect(&small);
    let columns: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(columns[4], "22", "context: {row}");
    // `--hosts`: two ranks on this one machine (both names are it) hold the whole weights and
    // two KV budgets: tight where one process fits; a bad host is refused.
    // Over this machine and another (127.0.0.2, its memory read through a stand-in `ssh` that
    // runs the command here), the huge one fits.
    let hosts_dir = tempfile::tempdir().unwrap();
    let (path, logins) = stand_in_ssh(hosts_dir.path());
    let fit_of = |repo: &str, extra: &[&str]| {
        let mut args = vec!["search", "llama-4bit"];
        args.extend(extra);
        let mut with_ssh = env.to_vec();
        with_ssh.push(("PATH", &path));
        let out = perch_with_env(&args, &with_ssh);
        let found = stdout(&out);
        let row = found.lines().find(|l| l.starts_with(repo)).expect(&found);
        let fit = row.split_whitespace().nth(3).unwrap().to_owned();
        (fit, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    const HUGE: &str = "mlx-community/Huge-Llama-4bit";
    assert_eq!(fit_of(BIG, &[]).0, "yes");
    assert_eq!(fit_of(HUGE, &[]).0, "no");
    let (fit, said) = fit_of(BIG, &["--hosts", "127.0.0.1,localhost"]);
    assert_eq!(fit, "tight", "{said}");
    assert!(
        said.contains("divided over 2 ranks on 1 machine,"),
        "{said}"
    );
    assert!(!logins.exists(), "no ssh for this machine");
    let (fit, said) = fit_of(HUGE, &["--hosts", "127.0.0.1,127.0.0.2"]);
    assert_eq!(fit, "yes", "{said}");
    assert!(
        said.contains("divided over 2 ranks on 2 machines,"),
        "{said}"
    );
    assert_eq!(std::fs::read_to_string(&logins).unwrap(), "127.0.0.2\n");
    // The same group from an mlx.launch hostfile.
    let hostfile = hosts_dir.path().join("hosts.json");
    std::fs::write(&hostfile, r#"[{"ssh": "127.0.0.1"}, {"ssh": "127.0.0.2"}]"#).unwrap();
    let (fit, said) = fit_of(HUGE, &["--hostfile", hostfile.to_str().unwrap()]);
    assert_eq!(fit, "yes", "{said}");
    assert!(said.contains("2 ranks on 2 machines,"), "{said}");
    let refused = perch_with_env(&["search", "big", "--hosts", "127.0.0.1,a;b"], &env);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && said.contains("is not a host name"),
        "{said}"
    );
    // Before anything is downloaded, the search says which models Perch cannot run.
    let searched = perch_with_env(&["search", "mamba"], &env);
    let found = stdout(&searched);
    let row = found
        .lines()
        .find(|l| l.starts_with("mlx-community/mamba-130m-hf-f32"))
        .expect(&found);
    assert!(
        row.ends_with("mamba (not supported yet)"),
        "architecture: {row}"
    );
    let stderr = String::from_utf8_lossy(&searched.stderr);
    let runs = format!(
        "Perch runs these architectures: {}",
        perch_engine::models::supported_architectures().join(", ")
    );
    assert!(stderr.contains(&runs), "{stderr}");

    let pulled = perch_with_env(&["pull", REPO], &env);
    let snapshot = PathBuf::from(stdout(&pulled).trim());
    assert!(snapshot.starts_with(cache.path()) && snapshot.join("config.json").is_file());
    let again = perch_with_env(&["pull", REPO], &env);
    assert!(String::from_utf8_lossy(&again.stderr).contains("0 B fetched"));

    // The id finds the download, and it is the same model as the test model's directory.
    let generate = |model: &str| {
        let args = [
            "generate",
            "--model",
            model,
            "--raw",
            "The capital of France is",
            "--max-tokens",
            "8",
        ];
        stdout(&perch_with_env(&args, &env))
    };
    assert_eq!(generate(REPO), generate(&test_model()));

    let missing = perch_with_env(&["pull", "mlx-community/Missing"], &env);
    assert_clean_error(&missing, "no such repository");
    let not_pulled = perch_with_env(
        &[
            "generate",
            "--model",
            "mlx-community/Other",
            "--prompt",
            "x",
        ],
        &env,
    );
    assert_clean_error(&not_pulled, "run `perch pull mlx-community/Other`");
}

/// One HTTP/1.1 exchange with `addr` (`host:port`): returns the status line and the body.
fn http(addr: &str, request_line: &str, key: &str, body: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(addr).expect("connect to perch serve");
    write!(
        socket,
        "{request_line} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    (
        head.lines().next().unwrap_or("").to_owned(),
        body.to_owned(),
    )
}

/// The `host:port` a `perch serve` child prints on its first line.
fn serve_address(child: &mut std::process::Child) -> String {
    use std::io::BufRead;
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines
        .next()
        .expect("perch serve prints its address")
        .unwrap();
    line.split("http://")
        .nth(1)
        .and_then(|rest| rest.strip_suffix("/v1"))
        .unwrap_or_else(|| panic!("no address in `{line}`"))
        .to_owned()
}

/// `perch serve` prints where it listens, answers `/v1/models` and a chat completion with the
/// key, refuses a request without it, and reports a bad address as one line.
#[test]
fn serve_answers_over_http() {
    let model = test_model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["serve", "--model", &model, "--port", "0", "--api-key", "k"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run perch serve");
    let addr = serve_address(&mut child);

    let (status, body) = http(&addr, "GET /v1/models", "k", "");
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    let models: serde_json::Value = serde_json::from_str(&body).unwrap();
    // The directory's name, then the path given (still a name requests may use).
    let name = std::path::Path::new(&model).file_name().unwrap();
    assert_eq!(models["data"][0]["id"], name.to_str().unwrap());
    assert_eq!(models["data"][1]["id"], model.as_str());

    let request = serde_json::json!({
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}],
    });
    let (status, body) = http(
        &addr,
        "POST /v1/chat/completions",
        "k",
        &request.to_string(),
    );
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    let completion: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(completion["object"], "chat.completion");
    let generated = completion["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=4).contains(&generated), "{body}");

    let (status, _) = http(&addr, "GET /v1/models", "wrong", "");
    assert_eq!(status, "HTTP/1.1 401 Unauthorized");
    child.kill().unwrap();
    child.wait().unwrap();

    let out = perch(&["serve", "--model", &model, "--host", "not an address"]);
    assert_clean_error(&out, "is not an address to listen on");
}

#[test]
fn soak_runs_mixed_traffic_and_reports_memory() {
    // A 16 MiB pool (about 350 tokens of this model) under 2 streams with prompts up to 256
    // tokens: requests wait, get preempted and cancelled, and none fails.
    let model = test_model();
    let out = perch(&[
        "soak",
        "--model",
        &model,
        "--minutes",
        "0.1",
        "--report-every-s",
        "2",
        "--concurrency",
        "2",
        "--long-prompt-tokens",
        "256",
        "--kv-cache-mib",
        "16",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Three reports (6 s, one every 2 s; two asked, a late one to spare): the minute, then
    // finished, cancelled and errors (none).
    let reports: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() > 4 && f[0].parse::<f64>().is_ok())
        .collect();
    assert!(reports.len() >= 2, "{stdout}");
    // After the reports, every request (the clients end theirs when time runs out): each of the
    // 2 clients ended at least one, and none failed.
    let ended: Vec<u64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("requests: "))
        .unwrap_or_else(|| panic!("no requests line: {stdout}"))
        .split(", ")
        .map(|part| part.split(' ').next().unwrap().parse().unwrap())
        .collect();
    let [finished, cancelled, errors] = ended[..] else {
        panic!("requests line: {stdout}")
    };
    assert!(finished + cancelled >= 2, "requests ended: {stdout}");
    assert_eq!(errors, 0, "no request failed: {stdout}");
    assert!(stdout.contains("KV and activations at peak"), "{stdout}");
    assert!(stdout.contains("second half: MLX active"), "{stdout}");
}

/// A memory cgroup of `limit` bytes made for one test (v1's memory hierarchy or v2's, as root),
/// removed when dropped; `None`, with the reason, where cgroups are not writable.
struct MemoryCgroup {
    dir: PathBuf,
    procs: PathBuf,
}

impl MemoryCgroup {
    fn new(limit: u64) -> Result<Self, String> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("no /proc/self/mountinfo: {e}"))?;
        // One per test: tests of this binary run at once in one process.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let name = format!(
            "perch-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        // `ID PARENT MAJ:MIN ROOT MOUNT_POINT ... - FSTYPE SOURCE SUPER_OPTIONS`
        let mounts: Vec<(String, String, String)> = mountinfo
            .lines()
            .filter_map(|line| {
                let (before, after) = line.split_once(" - ")?;
                let mut after = after.split(' ');
                let fstype = after.next()?.to_owned();
                let options = after.nth(1).unwrap_or("").to_owned();
                Some((before.split(' ').nth(4)?.to_owned(), fstype, options))
            })
            .collect();
        let mut reasons = Vec::new();
        for (mount, fstype, options) in &mounts {
            let v1 = fstype == "cgroup" && options.split(',').any(|o| o == "memory");
            let v2 = fstype == "cgroup2";
            if !v1 && !v2 {
                continue;
            }
            let root = PathBuf::from(mount);
            if v2 {
                let enabled = std::fs::read_to_string(root.join("cgroup.subtree_control"))
                    .unwrap_or_default();
                if !enabled.split_whitespace().any(|c| c == "memory")
                    && std::fs::write(root.join("cgroup.subtree_control"), "+memory").is_err()
                {
                    reasons.push(format!("{mount}: cannot enable the memory controller"));
                    continue;
                }
            }
            let dir = root.join(&name);
            if let Err(e) = std::fs::create_dir(&dir) {
                reasons.push(format!("{}: {e}", dir.display()));
                continue;
            }
            let group = Self {
                procs: dir.join("cgroup.procs"),
                dir: dir.clone(),
            };
            let file = if v1 {
                "memory.limit_in_bytes"
            } else {
                "memory.max"
            };
            if let Err(e) = std::fs::write(dir.join(file), limit.to_string()) {
                reasons.push(format!("{}: {e}", dir.join(file).display()));
                continue;
            }
            // No swap to spill into: over the limit means the OOM killer, as on a full machine.
            let swap = if v1 {
                "memory.memsw.limit_in_bytes"
            } else {
                "memory.swap.max"
            };
            let _ = std::fs::write(dir.join(swap), limit.to_string());
            return Ok(group);
        }
        Err(if reasons.is_empty() {
            "no memory cgroup hierarchy is mounted".to_owned()
        } else {
            reasons.join("; ")
        })
    }

    /// `perch args` to run inside this cgroup.
    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "echo $$ > '{}' && exec \"$0\" \"$@\"",
                self.procs.display()
            ))
            .arg(env!("CARGO_BIN_EXE_perch"))
            .args(args);
        command
    }

    /// `perch args` run inside this cgroup.
    fn perch(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run perch in a cgroup")
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A test that cannot run here says so where `scripts/test.sh` prints it at the end.
fn record_skip(test: &str, reason: &str) {
    use std::io::Write;
    eprintln!("SKIPPED {test}: {reason}");
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("skipped-tests.txt");
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(file, "{test}: {reason}");
    }
}

/// In a 64 MiB memory cgroup the test model (115 MB of weights) is refused before its weights
/// are read: exit code 1 and one sentence naming the memory, not the OOM killer's exit 137.
#[test]
fn a_model_larger_than_the_memory_limit_is_refused() {
    let group = match MemoryCgroup::new(64 << 20) {
        Ok(group) => group,
        Err(reason) => {
            return record_skip(
                "a_model_larger_than_the_memory_limit_is_refused",
                &format!("memory cgroups are not writable here ({reason})"),
            )
        }
    };
    let model = test_model();
    let args = [
        "generate",
        "--model",
        &model,
        "--raw",
        "Hello",
        "--max-tokens",
        "4",
    ];
    let out = group.perch(&args);
    assert_clean_error(&out, "of memory and");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the memory limit of the cgroup"),
        "{stderr}"
    );
    // The same model runs in a cgroup with room for it.
    drop(group);
    let group = MemoryCgroup::new(1 << 30).unwrap();
    let out = group.perch(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// In a memory cgroup that holds the model with a few hundred MB to spare, a 2 GiB KV cache budget
/// is lowered to what that memory allows (at most 0.3 of what is left after loading), and the
/// batch still runs; with memory to spare the configured budget stands.
#[test]
fn the_kv_budget_fits_the_memory_left() {
    let bench = |group: Option<&MemoryCgroup>, mib: &str| {
        let model = test_model();
        let args = [
            "bench",
            "--model",
            &model,
            "--concurrency",
            "2",
            "--prompt-tokens",
            "6",
            "--gen-tokens",
            "2",
            "--kv-cache-mib",
            mib,
            "--json",
        ];
        let out = match group {
            Some(group) => group.perch(&args),
            None => perch(&args),
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        report["kv_cache_bytes"].as_u64().unwrap()
    };
    assert_eq!(bench(None, "64"), 64 << 20);
    let limit: u64 = 768 << 20;
    let group = match MemoryCgroup::new(limit) {
        Ok(group) => group,
        Err(reason) => {
            return record_skip(
                "the_kv_budget_fits_the_memory_left",
                &format!("memory cgroups are not writable here ({reason})"),
            )
        }
    };
    let lowered = bench(Some(&group), "2048");
    assert!(
        lowered > 0 && lowered as f64 <= 0.3 * limit as f64,
        "a 2 GiB budget in a {limit}-byte cgroup ran with {lowered} bytes"
    );
}

/// `perch serve` in a 400 MiB memory cgroup (the test model, its runtime and about 100 MB more)
/// meets 16 requests of ~340 prompt tokens and two of ~1,570 at once: each one finishes or is
/// refused with a reason, the server is not OOM-killed, and it keeps serving after. Before
/// admissions were bounded by the memory left, the same traffic was killed at 400 and at 700
/// MiB; before a request that does not fit alone was refused, the long ones were admitted when
/// nothing ran and their KV caches grew into the limit.
#[test]
fn many_long_requests_under_a_tight_memory_limit_finish_or_are_refused() {
    let group = match MemoryCgroup::new(400 << 20) {
        Ok(group) => group,
        Err(reason) => {
            return record_skip(
                "many_long_requests_under_a_tight_memory_limit_finish_or_are_refused",
                &format!("memory cgroups are not writable here ({reason})"),
            )
        }
    };
    let model = test_model();
    let mut child = group
        .command(&["serve", "--model", &model, "--port", "0", "--api-key", "k"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run perch serve in a cgroup");
    let addr = serve_address(&mut child);
    let request = |sentences: usize| {
        let text = "The history of science is long and full of surprises. ".repeat(sentences);
        serde_json::json!({
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": text}],
        })
        .to_string()
    };
    let answers: Vec<(String, String)> = std::thread::scope(|scope| {
        let asks: Vec<_> = (0..18)
            .map(|i| {
                let body = request(if i % 9 == 4 { 140 } else { 28 });
                let addr = &addr;
                scope.spawn(move || http(addr, "POST /v1/chat/completions", "k", &body))
            })
            .collect();
        asks.into_iter()
            .map(|ask| ask.join().expect("an answer, not a dropped connection"))
            .collect()
    });
    let exited = child.try_wait().unwrap();
    let statuses: Vec<&str> = answers.iter().map(|(status, _)| status.as_str()).collect();
    assert!(
        exited.is_none(),
        "perch serve ended ({exited:?}): {statuses:?}"
    );
    let mut finished = 0;
    for (status, body) in &answers {
        if status == "HTTP/1.1 200 OK" {
            finished += 1;
            continue;
        }
        // Refused: a status that says why and a sentence in OpenAI's error shape.
        let error: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        let message = error["error"]["message"].as_str().unwrap_or("");
        assert!(
            (status.contains(" 400 ") || status.contains(" 503 ")) && message.len() > 20,
            "{status}: {body}"
        );
    }
    assert!(finished >= 16, "{finished} of 18 finished: {answers:?}");
    let (status, body) = http(&addr, "POST /v1/chat/completions", "k", &request(2));
    assert_eq!(status, "HTTP/1.1 200 OK", "still serving: {body}");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// The resident memory of process `pid` in bytes (`VmRSS` of `/proc/PID/status`).
#[cfg(target_os = "linux")]
fn resident_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib * 1024
}

/// `perch serve --keep-alive 1s` gives the model's memory back once idle and loads it again
/// for the next request, which answers as the first did (resident memory read from `/proc`).
#[cfg(target_os = "linux")]
#[test]
fn serve_unloads_an_idle_model_and_gives_its_memory_back() {
    let model = test_model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["serve", "--model", &model, "--port", "0", "--api-key", "k"])
        .args(["--keep-alive", "1s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run perch serve");
    let addr = serve_address(&mut child);
    let request = serde_json::json!({
        "model": model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}],
    })
    .to_string();
    let ask = || {
        let (status, body) = http(&addr, "POST /v1/chat/completions", "k", &request);
        assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
        let completion: serde_json::Value = serde_json::from_str(&body).unwrap();
        completion["choices"][0]["message"]["content"].clone()
    };
    let first = ask();
    let loaded = resident_bytes(child.id());
    let weights: u64 = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| p.metadata().unwrap().len())
        .sum();
    // Within a minute of idling, at least half the weights' size is given back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut idle = resident_bytes(child.id());
    while idle + weights / 2 > loaded && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(200));
        idle = resident_bytes(child.id());
    }
    assert!(
        idle + weights / 2 <= loaded,
        "resident {loaded} B loaded, {idle} B idle, weights {weights} B"
    );
    eprintln!("resident {loaded} B loaded, {idle} B idle, weights {weights} B");
    assert_eq!(ask(), first, "loaded again, the same answer");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// `perch serve --alias NAME=MODEL` names the one model it serves: an alias for another model, or
/// one naming nothing, is a one-line error before anything loads.
#[test]
fn serve_refuses_an_alias_of_another_model() {
    let model = test_model();
    let other = perch(&[
        "serve",
        "--model",
        &model,
        "--port",
        "0",
        "--alias",
        "gpt-4o=other-model",
    ]);
    assert_clean_error(&other, "not `other-model`");
    let empty = perch(&["serve", "--model", &model, "--port", "0", "--alias", "=x"]);
    assert_clean_error(&empty, "names nothing");
}

/// `dir/hosts.json`: an `MLX_HOSTFILE` of `ranks` ring addresses on 127.0.0.1, each on a port
/// free when it was written.
fn ring_hostfile(dir: &std::path::Path, ranks: usize) -> PathBuf {
    let ports: Vec<u16> = (0..ranks)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect::<Vec<_>>()
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect();
    let hosts = dir.join("hosts.json");
    let addresses: Vec<Vec<String>> = ports
        .iter()
        .map(|p| vec![format!("127.0.0.1:{p}")])
        .collect();
    std::fs::write(&hosts, serde_json::to_string(&addresses).unwrap()).unwrap();
    hosts
}

/// `perch generate --distributed`: two ranks on 127.0.0.1 over MLX's ring backend, started as
/// `mlx.launch -n 2 --backend ring` starts them (`MLX_RANK`, `MLX_HOSTFILE`). Split into two
/// pipeline stages, rank 0 prints what one process prints (greedy, and sampled with a seed) and
/// rank 1 prints nothing, and rank 0's peak memory while generating is below one process's (it
/// keeps only its layers); divided by heads, the test model's 9 query heads are refused on both.
#[test]
fn generate_divided_over_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model();
    let run = |extra: &[&str]| -> [Output; 2] {
        let hosts = ring_hostfile(dir.path(), 2);
        let children: Vec<_> = (0..2)
            .map(|rank| {
                Command::new(env!("CARGO_BIN_EXE_perch"))
                    .args(["generate", "--model", &model, "--max-tokens", "16"])
                    .args(extra)
                    .env("MLX_RANK", rank.to_string())
                    .env("MLX_HOSTFILE", &hosts)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut outputs = children.into_iter().map(|c| c.wait_with_output().unwrap());
        [outputs.next().unwrap(), outputs.next().unwrap()]
    };
    for sampling in [&[][..], &["--temp", "0.9", "--seed", "11"][..]] {
        let prompt = ["--prompt", "Name three colors.", "--json"];
        let one = perch(
            &[
                &["generate", "--model", &model, "--max-tokens", "16"][..],
                &prompt,
                sampling,
            ]
            .concat(),
        );
        assert!(
            one.status.success(),
            "{}",
            String::from_utf8_lossy(&one.stderr)
        );
        let [rank0, rank1] = run(&[&prompt[..], sampling, &["--distributed", "pipeline"]].concat());
        for (r, out) in [&rank0, &rank1].iter().enumerate() {
            assert!(
                out.status.success(),
                "rank {r}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Token lines, then the stats.
        let lines = |out: &[u8]| -> (Vec<String>, serde_json::Value) {
            let text = String::from_utf8(out.to_vec()).unwrap();
            let mut lines: Vec<String> = text.lines().map(String::from).collect();
            let stats = serde_json::from_str(&lines.pop().unwrap()).unwrap();
            (lines, stats)
        };
        let (tokens, alone) = lines(&one.stdout);
        assert!(tokens.len() >= 8, "{tokens:?}");
        let (rank0_tokens, rank0_stats) = lines(&rank0.stdout);
        assert_eq!(rank0_tokens, tokens, "{sampling:?}");
        assert!(rank1.stdout.is_empty(), "rank 1 printed");
        let peak =
            |stats: &serde_json::Value| stats["stats"]["peak_memory_bytes"].as_f64().unwrap();
        assert!(
            peak(&rank0_stats) < 0.8 * peak(&alone),
            "rank 0's peak {} against one process's {}",
            peak(&rank0_stats),
            peak(&alone)
        );
    }
    for out in run(&["--prompt", "hi", "--distributed", "tensor"]) {
        assert_clean_error(&out, "9 query heads cannot be divided over 2 ranks");
    }
}

/// `--join-timeout`: a rank whose group's other rank never starts stops waiting after that many
/// seconds with a sentence (not the 60 s default); 0 is refused before anything starts.
#[test]
fn a_rank_waits_for_its_group_as_long_as_join_timeout_says() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model();
    let hosts = ring_hostfile(dir.path(), 2);
    let rank_0 = |timeout: &str| {
        Command::new(env!("CARGO_BIN_EXE_perch"))
            .args(["generate", "--model", &model, "--prompt", "hi"])
            .args(["--distributed", "tensor", "--join-timeout", timeout])
            .env("MLX_RANK", "0")
            .env("MLX_HOSTFILE", &hosts)
            .output()
            .unwrap()
    };
    let start = std::time::Instant::now();
    let out = rank_0("3");
    let seconds = start.elapsed().as_secs_f32();
    assert_clean_error(&out, "not every rank connected within 3 s");
    assert!(seconds < 30.0, "{seconds} s");
    let zero = rank_0("0");
    let stderr = String::from_utf8_lossy(&zero.stderr);
    assert_eq!(zero.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--join-timeout"), "{stderr}");
}

/// `perch serve --distributed`: two ranks on 127.0.0.1 (`MLX_RANK`, `MLX_HOSTFILE`), the model
/// in two pipeline stages; rank 0 serves, rank 1 follows its batch and prints nothing. Requests
/// sent at once (greedy, and sampled with a seed) get what one process's `perch serve` answers.
/// Rank 0 killed, rank 1 ends with an error within seconds, not a hang; divided by heads, the
/// test model's 9 query heads are refused by both. Started by one command (`--hosts`), the ranks
/// answer alike, and terminating that command ends them.
#[test]
fn serve_divided_over_two_ranks() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let model = test_model();
    let name = std::path::Path::new(&model)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let requests: Vec<String> = [
        ("Name three colors.", 0.0),
        ("Count to five.", 0.0),
        ("Hello", 0.9),
        ("Write a haiku about rain.", 0.0),
    ]
    .iter()
    .map(|(content, temperature)| {
        serde_json::json!({
            "model": name, "max_tokens": 12, "temperature": temperature, "seed": 5,
            "messages": [{"role": "user", "content": content}],
        })
        .to_string()
    })
    .collect();
    // Every request at once; each answer's text.
    let answers = |addr: &str| -> Vec<String> {
        std::thread::scope(|scope| {
            let sent: Vec<_> = requests
                .iter()
                .map(|body| {
                    scope.spawn(move || {
                        let (status, body) = http(addr, "POST /v1/chat/completions", "", body);
                        assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
                        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
                        answer["choices"][0]["message"]["content"]
                            .as_str()
                            .unwrap()
                            .to_owned()
                    })
                })
                .collect();
            sent.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let mut one = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["serve", "--model", &model, "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let alone = answers(&serve_address(&mut one));
    one.kill().unwrap();
    one.wait().unwrap();
    assert!(alone.iter().all(|a| !a.is_empty()), "{alone:?}");

    let ranks = |split: &str| -> Vec<std::process::Child> {
        let port = |_| {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let addresses: Vec<Vec<String>> = (0..2)
            .map(port)
            .map(|p| vec![format!("127.0.0.1:{p}")])
            .collect();
        let hosts = dir.path().join("hosts.json");
        std::fs::write(&hosts, serde_json::to_string(&addresses).unwrap()).unwrap();
        (0..2)
            .map(|rank| {
                Command::new(env!("CARGO_BIN_EXE_perch"))
                    .args(["serve", "--model", &model, "--port", "0"])
                    .args(["--distributed", split])
                    .env("MLX_RANK", rank.to_string())
                    .env("MLX_HOSTFILE", &hosts)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect()
    };
    let mut pair = ranks("pipeline");
    let addr = serve_address(&mut pair[0]);
    assert_eq!(answers(&addr), alone);
    // Rank 0 gone without a word: rank 1 ends, with a sentence.
    pair[0].kill().unwrap();
    pair[0].wait().unwrap();
    let start = std::time::Instant::now();
    while pair[1].try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "rank 1 still runs 30 s after rank 0 ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let follower = pair.pop().unwrap().wait_with_output().unwrap();
    assert!(follower.stdout.is_empty(), "rank 1 printed");
    // After `loading …` (and MLX's own lines), one line of error.
    let ends_in_error = |out: &Output, needle: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        let last = stderr.trim_end().lines().last().unwrap_or("");
        assert!(last.starts_with("perch: error: "), "{stderr}");
        assert!(last.contains(needle), "`{needle}` not in: {stderr}");
    };
    ends_in_error(&follower, "connection to a peer was lost");
    // Rank 1 gone: rank 0's next request fails, and rank 0 then ends with the group's sentence
    // rather than serve on while nothing can answer.
    let mut pair = ranks("pipeline");
    let addr = serve_address(&mut pair[0]);
    pair[1].kill().unwrap();
    pair[1].wait().unwrap();
    let (status, body) = http(&addr, "POST /v1/chat/completions", "", &requests[0]);
    assert_ne!(status, "HTTP/1.1 200 OK", "{body}");
    let start = std::time::Instant::now();
    while pair[0].try_wait().unwrap().is_none() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "rank 0 still serves 30 s after its group stopped"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let leader = pair.remove(0).wait_with_output().unwrap();
    ends_in_error(&leader, "stopped working together");
    for out in ranks("tensor")
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
    {
        ends_in_error(&out, "9 query heads cannot be divided over 2 ranks");
    }

    // One command starting both ranks (`--hosts`: rank 0 on "another host", 127.0.0.2 through
    // the stand-in `ssh`, rank 1 here), every rank with the model as its own draft (speculative
    // decoding in the divided batch), answers the greedy requests alike (a sampled one draws
    // otherwise with a draft, as mlx_lm's speculative sampling does); terminated, it ends its
    // ranks: the remote one (serving, idle) when its `ssh` goes.
    let (path, _) = stand_in_ssh(dir.path());
    let starting_port = consecutive_free_ports();
    let marker = format!("marker-{}", std::process::id());
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args([
            "serve",
            "--model",
            &model,
            "--port",
            "0",
            "--alias",
            &marker,
            "--draft-model",
            &model,
        ])
        .args([
            "--distributed",
            "pipeline",
            "--hosts",
            "127.0.0.2,127.0.0.1",
        ])
        .args(["--starting-port", &starting_port.to_string()])
        .env("PATH", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = serve_address(&mut launcher);
    let drafted = answers(&addr);
    for i in [0, 1, 3] {
        assert_eq!(drafted[i], alone[i], "request {i}");
    }
    // `perch` processes whose command line holds the marker (read from /proc: no procps on a
    // clean machine; the shells of the stand-in `ssh` hold it too).
    let ranks_left = || {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
            .filter(|cmdline| {
                let text = String::from_utf8_lossy(cmdline);
                let program = text.split('\0').next().unwrap_or_default();
                program.ends_with("/perch") && text.contains(&marker)
            })
            .count()
    };
    assert_eq!(ranks_left(), 3, "the launcher and its two ranks");
    // The shell's own `kill`.
    Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", launcher.id())])
        .status()
        .unwrap();
    let out = launcher.wait_with_output().unwrap();
    ends_in_error(&out, "stopped by a signal");
    let start = std::time::Instant::now();
    while ranks_left() > 0 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "ranks still run after their launcher was terminated"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A stand-in `ssh` in `dir/bin`: `ssh -o OPTION … HOST COMMAND` runs COMMAND on this machine
/// and notes HOST in the returned file, a line a call. Returns a `PATH` that finds it first.
fn stand_in_ssh(dir: &std::path::Path) -> (String, PathBuf) {
    let logins = dir.join("logins.txt");
    let script = format!(
        "while [ \"$1\" = -o ]; do shift 2; done\necho \"$1\" >> '{}'\nshift\nexec sh -c \"$1\"\n",
        logins.display()
    );
    (ssh_on_path(dir, &script), logins)
}

/// A `PATH` that first finds `dir/bin/ssh`, a shell script of `body`.
fn ssh_on_path(dir: &std::path::Path, body: &str) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let ssh = bin.join("ssh");
    std::fs::write(&ssh, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(&ssh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// A host that does not answer ends a launch within seconds, with an error that names it: the
/// launcher's `ssh` gives up after its `ConnectTimeout` (a stand-in `ssh` that, like a real one
/// facing a host that drops its packets, waits that long and exits with 255 — and without the
/// option waits 45 s, past this test's bound).
#[test]
fn an_unreachable_host_ends_the_launch_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let path = ssh_on_path(
        dir.path(),
        "wait=45\nwhile [ \"$1\" = -o ]; do\n  case \"$2\" in ConnectTimeout=*) wait=${2#ConnectTimeout=} ;; esac\n  shift 2\ndone\nsleep \"$wait\"\necho \"ssh: connect to host $1 port 22: Connection timed out\" >&2\nexit 255\n",
    );
    let start = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["generate", "--model", &test_model(), "--prompt", "Hi"])
        .args([
            "--distributed",
            "pipeline",
            "--hosts",
            "127.0.0.1,127.0.0.3",
        ])
        .args(["--starting-port", &consecutive_free_ports().to_string()])
        .env("PATH", &path)
        .env("TMPDIR", dir.path())
        .output()
        .unwrap();
    let took = start.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("rank 1: ssh to 127.0.0.3 failed with status 255 (the host unreachable"),
        "{stderr}"
    );
    assert!(stderr.contains(": the group stopped"), "{stderr}");
    assert!(
        took < std::time::Duration::from_secs(30),
        "the launch took {took:?}"
    );
}

/// A free port on 127.0.0.1 whose next one is free too (a ring group of two ranks started with
/// `--hosts 127.0.0.1,127.0.0.1` listens on both).
/// The arguments that run a command over two pipeline stages on this machine, started by the
/// command itself from `port` on.
fn two_local_stages(port: &str) -> [&str; 6] {
    [
        "--distributed",
        "pipeline",
        "--hosts",
        "127.0.0.1,127.0.0.1",
        "--starting-port",
        port,
    ]
}

fn consecutive_free_ports() -> u16 {
    loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            break port;
        }
    }
}

/// `perch generate --distributed --hosts` whose rank 1 stops answering mid-answer (paused with
/// SIGSTOP once rank 0 has printed tokens): rank 0's watchdog ends it within the stall limit
/// (`PERCH_GROUP_STALL_SECS`, 4 s here) while its main thread, blocked in a collective, holds
/// standard output; the launch then ends with rank 0's sentence and the others, never a hang.
#[test]
fn generate_over_ranks_ends_when_a_rank_stops_answering() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    // A tiny random Llama: its answers run to --max-tokens (end of sequence is unlikely).
    let models = dir.path().join("models");
    perch_test_support::run_oracle(
        "tiny_models.py",
        &[
            models.to_str().unwrap(),
            perch_test_support::model_dir().to_str().unwrap(),
            "llama3-rope",
        ],
    );
    let model = models.join("llama3-rope");
    let marker = format!("stall-{}", std::process::id());
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_perch"))
        .args(["generate", "--model"])
        .arg(&model)
        .args(["--raw", "a b", "--json", "--max-tokens", "4000"])
        .args([
            "--distributed",
            "pipeline",
            "--hosts",
            "127.0.0.1,127.0.0.1",
        ])
        .args(["--starting-port", &consecutive_free_ports().to_string()])
        .env("PERCH_GROUP_STALL_SECS", "4")
        .env("PERCH_TEST_MARKER", &marker)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The ranks: `perch` processes whose environment holds the marker (the launcher's, which
    // its ranks inherit) and their rank.
    let rank = |r: usize| -> Option<libc::pid_t> {
        std::fs::read_dir("/proc").unwrap().find_map(|e| {
            let dir = e.ok()?.path();
            let environ = std::fs::read(dir.join("environ")).ok()?;
            let has = |wanted: String| environ.split(|&b| b == 0).any(|v| v == wanted.as_bytes());
            (has(format!("PERCH_TEST_MARKER={marker}")) && has(format!("MLX_RANK={r}")))
                .then(|| dir.file_name()?.to_str()?.parse().ok())
                .flatten()
        })
    };
    // A few tokens printed: rank 1 stops answering.
    let mut out = std::io::BufReader::new(launcher.stdout.take().unwrap());
    let mut line = String::new();
    for _ in 0..3 {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr)
                .unwrap();
            panic!("no tokens: {stderr}");
        }
    }
    let rank_1 = rank(1).expect("rank 1 runs");
    // SAFETY: plain system calls on a process this test's launcher started.
    assert_eq!(unsafe { libc::kill(rank_1, libc::SIGSTOP) }, 0);
    let stopped_at = std::time::Instant::now();
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break Some(status);
        }
        if stopped_at.elapsed() > std::time::Duration::from_secs(60) {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let seconds = stopped_at.elapsed().as_secs_f32();
    // Whatever happened, nothing of the group stays behind.
    for r in [0, 1] {
        if let Some(pid) = rank(r) {
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    let _ = launcher.kill();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut launcher.stderr.take().unwrap(), &mut stderr).unwrap();
    let status = status
        .unwrap_or_else(|| panic!("the launch still ran 60 s after rank 1 stopped: {stderr}"));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("rank 0: the ranks dividing the model made no progress"),
        "{stderr}"
    );
    assert!(seconds < 30.0, "{seconds} s: {stderr}");
}

/// `perch generate --distributed --hosts`: this process starts the ranks itself, as `mlx.launch
/// --hosts` does — on 127.0.0.1 directly, and on a host reached over `ssh` (a stand-in `ssh` on
/// PATH that runs the command here, for the host 127.0.0.2) — and prints what one process
/// prints. A rank that fails ends the group with an error; bad host lists are refused.
#[test]
fn generate_starts_its_ranks_from_a_host_list() {
    let dir = tempfile::tempdir().unwrap();
    let model = test_model();
    let (path, logins) = stand_in_ssh(dir.path());
    let starting_port = consecutive_free_ports();
    let prompt = [
        "--prompt",
        "Name three colors.",
        "--json",
        "--max-tokens",
        "16",
    ];
    let one = perch(&[&["generate", "--model", &model][..], &prompt].concat());
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    let lines = |out: &[u8]| -> Vec<String> {
        let text = String::from_utf8(out.to_vec()).unwrap();
        let mut lines: Vec<String> = text.lines().map(String::from).collect();
        lines.pop(); // the stats, with their timings
        lines
    };
    // Temporary files (the hostfiles: the launcher's own, and the one each ssh rank writes
    // where it runs) go here, to be found if they are left behind.
    let temporary = dir.path().join("tmp");
    std::fs::create_dir(&temporary).unwrap();
    let launch_with = |hosts: &str, split: &str, backend: &str| {
        Command::new(env!("CARGO_BIN_EXE_perch"))
            .args(["generate", "--model", &model])
            .args(prompt)
            .args([
                "--distributed",
                split,
                "--backend",
                backend,
                "--hosts",
                hosts,
            ])
            .args(["--starting-port", &starting_port.to_string()])
            .env("PATH", &path)
            .env("TMPDIR", &temporary)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .output()
            .unwrap()
    };
    let launch = |hosts: &str, split: &str| launch_with(hosts, split, "ring");
    // The launch ended with a rank's failure, `said` among what the ranks wrote.
    let group_failed = |out: &std::process::Output, said: &str| -> String {
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        assert!(stderr.contains(": the group stopped"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    };
    // What is there but MLX's own folder of compiled CPU kernels and the ranks' folders of
    // theirs (`device::rank_temp_dir`), caches kept on purpose.
    let left_behind = || -> Vec<String> {
        std::fs::read_dir(&temporary)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != "mlx" && name != "perch-ranks")
            .collect()
    };
    for hosts in ["127.0.0.1,127.0.0.1", "127.0.0.1,127.0.0.2"] {
        let out = launch(hosts, "pipeline");
        assert!(
            out.status.success(),
            "{hosts}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(lines(&out.stdout), lines(&one.stdout), "{hosts}");
    }
    // Only the host that is not this machine was reached over ssh; its rank removed the
    // hostfile it wrote once MLX had read it, and the launcher its own.
    assert_eq!(std::fs::read_to_string(&logins).unwrap(), "127.0.0.2\n");
    assert_eq!(
        left_behind(),
        Vec::<String>::new(),
        "temporary files left behind"
    );
    // Both ranks refuse to divide 9 heads over 2: the launch ends with the first one's failure.
    let failed = launch("127.0.0.1,127.0.0.1", "tensor");
    let stderr = group_failed(&failed, "9 query heads cannot be divided");
    assert!(
        stderr.contains("exited with status 1: the group stopped"),
        "{stderr}"
    );
    for (hosts, needle) in [
        ("127.0.0.1", "two hosts or more"),
        ("127.0.0.1,a;b", "\"a;b\" is not a host name"),
    ] {
        let out = launch(hosts, "pipeline");
        assert_clean_error(&out, needle);
    }
    // Port 0 is refused once for every backend, before its setup or any rank starts.
    for backend in ["ring", "nccl", "jaccl"] {
        let out = Command::new(env!("CARGO_BIN_EXE_perch"))
            .args(["generate", "--model", &model])
            .args(prompt)
            .args(["--distributed", "tensor", "--backend", backend])
            .args(["--hosts", "127.0.0.1,127.0.0.2", "--starting-port", "0"])
            .env("PATH", &path)
            .env("TMPDIR", &temporary)
            .output()
            .unwrap();
        assert_clean_error(&out, "--starting-port 0");
    }
    // NCCL: each rank gets MLX_RANK, MLX_WORLD_SIZE, where the ranks meet (NCCL_HOST_IP,
    // NCCL_PORT) and a GPU; a rank's environment passes Perch's check (which names a bad
    // variable), and then this CPU build of MLX has no NCCL backend: the launch ends with that
    // (the first rank to fail ends the other, which may not have printed its own yet).
    // These cases end where MLX's NCCL and JACCL would start: the CPU build has neither.
    for backend in [
        perch_engine::distributed::Backend::Nccl,
        perch_engine::distributed::Backend::Jaccl,
    ] {
        assert!(
            !backend.is_available(),
            "this test expects a build of MLX without {backend:?}"
        );
    }
    let nccl = |hosts: &str| launch_with(hosts, "tensor", "nccl");
    let stderr = group_failed(
        &nccl("127.0.0.2,127.0.0.1"),
        "this build of MLX has no nccl backend",
    );
    assert!(
        !stderr.contains("MLX_") && !stderr.contains("NCCL_"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&logins).unwrap(),
        "127.0.0.2\n127.0.0.2\n",
        "rank 0 started over ssh"
    );
    // Rank 0 named as this machine, another host elsewhere: refused before any rank starts.
    assert_clean_error(&nccl("127.0.0.1,127.0.0.2"), "cannot reach");
    // `--hostfile` in mlx.launch's format: ring over each host's "ips" (rank 1 through ssh),
    // with the file's variables; what one process prints.
    let hostfile = dir.path().join("hosts.json");
    let from_file = |text: &str, split: &str| {
        std::fs::write(&hostfile, text).unwrap();
        Command::new(env!("CARGO_BIN_EXE_perch"))
            .args(["generate", "--model", &model])
            .args(prompt)
            .args(["--distributed", split, "--hostfile"])
            .arg(&hostfile)
            .args(["--starting-port", &starting_port.to_string()])
            .env("PATH", &path)
            .env("TMPDIR", &temporary)
            .output()
            .unwrap()
    };
    let ring = from_file(
        r#"{"envs": ["MLX_RING_VERBOSE=0"], "hosts": [{"ssh": "127.0.0.1"},
            {"ssh": "127.0.0.2", "ips": ["127.0.0.2"]}]}"#,
        "pipeline",
    );
    assert!(
        ring.status.success(),
        "{}",
        String::from_utf8_lossy(&ring.stderr)
    );
    assert_eq!(lines(&ring.stdout), lines(&one.stdout), "--hostfile");
    // JACCL from the file: each rank's coordinator and devices file pass its check (the remote
    // rank removes its copy of the file), then this build of MLX has no JACCL.
    let jaccl = from_file(
        r#"{"backend": "jaccl", "hosts": [
            {"ssh": "127.0.0.2", "ips": ["127.0.0.2"], "rdma": [null, "rdma_en3"]},
            {"ssh": "127.0.0.1", "rdma": ["rdma_en3", null]}]}"#,
        "tensor",
    );
    let stderr = group_failed(&jaccl, "this build of MLX has no jaccl backend");
    assert!(!stderr.contains("MLX_"), "{stderr}");
    // The remote rank's files go when it ends, also when the launcher ended it first (then
    // its `sh` removes them as the rank ends, which may come just after the launch returned).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !left_behind().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let bad = from_file(r#"{"hosts": [{"ssh": "a;b"}]}"#, "tensor");
    assert_clean_error(&bad, "host 0");
    assert_eq!(
        std::fs::read_to_string(&logins).unwrap().lines().count(),
        4,
        "127.0.0.2 reached over ssh for --hosts (ring, NCCL) and for the hostfiles (ring, JACCL)"
    );
    assert_eq!(
        left_behind(),
        Vec::<String>::new(),
        "temporary files left behind"
    );
}
