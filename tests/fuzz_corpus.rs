//! The fuzz targets' inputs replayed in the ordinary test build: each target's committed seed
//! corpus (`fuzz/corpus/<target>`, which holds the input of every bug fuzzing found), then
//! mutations of its files up to [`INPUTS`] inputs, made by a fixed-seed generator (bit flips,
//! bytes and integers that parsers trip on, truncations, deletions, repeated and inserted runs,
//! splices of two corpus files, the target's dictionary words; a quarter of them mutate the
//! previous mutant again), so that every run tries the same inputs.
//! Each input goes through the very function the cargo-fuzz binary calls (`fuzz/src/lib.rs`,
//! included here); an input fails when it panics or takes over [`SLOW`], and one still running
//! after [`HANG`] aborts the binary. The failing inputs are written to
//! `<target tmp>/fuzz-replay/<target>/` (the one running when the process aborted stays in
//! `current`) and can be replayed with `cargo +nightly fuzz run <target> <file>`.
//!
//! Coverage-guided fuzzing (libFuzzer, AddressSanitizer) is `scripts/fuzz.sh`; this replay needs
//! no second, instrumented build of the engine.

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Inputs per target, the corpus included.
const INPUTS: usize = 10_000;
/// libFuzzer's `-timeout` in scripts/fuzz.sh: an input that takes longer fails.
const SLOW: Duration = Duration::from_secs(10);
/// An input still running after this aborts the test binary (a hang).
const HANG: Duration = Duration::from_secs(60);

thread_local! {
    /// Whether this thread is running an input (its panics are the replay's to report).
    static REPLAYING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Installs, once, a panic hook that stays silent for a thread running an input and hands
/// every other panic (another test's, the replay's own) to the hook it replaced.
fn quiet_panics_while_replaying() {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !REPLAYING.get() {
                previous(info);
            }
        }));
    });
}

/// The targets share MLX and the scratch directory: one runs at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// xorshift64*: a fixed sequence from a fixed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The words of a libFuzzer dictionary (`"..."` per line, `\\`, `\"` and `\xNN` escapes).
fn dictionary(path: &Path) -> Vec<Vec<u8>> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    let mut words = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let (Some(start), Some(end)) = (line.find('"'), line.rfind('"')) else {
            continue;
        };
        if line.starts_with('#') || end <= start {
            continue;
        }
        let quoted = &line.as_bytes()[start + 1..end];
        let mut word = Vec::new();
        let mut i = 0;
        while i < quoted.len() {
            match (quoted[i], quoted.get(i + 1)) {
                (b'\\', Some(b'x')) if i + 3 < quoted.len() => {
                    let hex = std::str::from_utf8(&quoted[i + 2..i + 4]).unwrap();
                    word.push(u8::from_str_radix(hex, 16).expect("a \\xNN escape"));
                    i += 4;
                }
                (b'\\', Some(&c)) => {
                    word.push(c);
                    i += 2;
                }
                (c, _) => {
                    word.push(c);
                    i += 1;
                }
            }
        }
        words.push(word);
    }
    words
}

/// Integers that lengths, counts and offsets are checked against, little-endian.
const INTERESTING: [u64; 10] = [
    0,
    1,
    0x7f,
    0xff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
];

/// `input` changed by one to four mutations.
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>], words: &[Vec<u8>]) -> Vec<u8> {
    let mut data = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let len = data.len();
        match rng.below(9) {
            0 if len > 0 => {
                let at = rng.below(len);
                data[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                data[at] = [0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'}'][rng.below(8)];
            }
            2 if len >= 8 => {
                let width = [2, 4, 8][rng.below(3)];
                let at = rng.below(len - width + 1);
                let value = INTERESTING[rng.below(INTERESTING.len())].to_le_bytes();
                data[at..at + width].copy_from_slice(&value[..width]);
            }
            3 => data.truncate(rng.below(len + 1)),
            4 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(32)).min(len);
                data.drain(at..end);
            }
            5 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(64)).min(len);
                let run = data[at..end].to_vec();
                let to = rng.below(len + 1);
                data.splice(
                    to..to,
                    run.iter()
                        .copied()
                        .cycle()
                        .take(run.len() * (1 + rng.below(3))),
                );
            }
            6 => {
                let to = rng.below(len + 1);
                let bytes: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
                data.splice(to..to, bytes);
            }
            7 => {
                let other = &corpus[rng.below(corpus.len())];
                let (at, from) = (rng.below(len + 1), rng.below(other.len() + 1));
                data.truncate(at);
                data.extend_from_slice(&other[from..]);
            }
            8 if !words.is_empty() => {
                let to = rng.below(len + 1);
                data.splice(to..to, words[rng.below(words.len())].iter().copied());
            }
            _ => {}
        }
    }
    data
}

/// Every corpus file of `name`, then mutations up to [`INPUTS`], through its target; panics
/// listing the inputs that failed.
fn replay(name: &str) {
    let _guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let target = targets::TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a target of fuzz/src/lib.rs")
        .1;
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("fuzz/corpus").join(name))
        .expect("the target's corpus directory")
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    let corpus: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!corpus.is_empty(), "fuzz/corpus/{name} is empty");
    let words = dictionary(&repo().join(format!("fuzz/{name}.dict")));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz-replay")
        .join(name);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();

    // Panics of the inputs are reported once, with their file, not by the panic hook.
    quiet_panics_while_replaying();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ name.len() as u64);
    let mut failures = Vec::new();
    let mut previous = corpus[0].clone();
    // An input that never returns: after [`HANG`] the process aborts, naming the file it left.
    let running = std::sync::Arc::new(Mutex::new(Some(Instant::now())));
    let watchdog = {
        let (running, current) = (running.clone(), out.join("current"));
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(200));
            match *running.lock().unwrap() {
                Some(start) if start.elapsed() > HANG => {
                    // Past the test harness's capture, which an abort would lose.
                    let message = format!("an input ran over {HANG:?}: {}\n", current.display());
                    let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
                    std::process::abort();
                }
                Some(_) => {}
                None => return,
            }
        })
    };
    for k in 0..INPUTS.max(corpus.len()) {
        let input = match corpus.get(k) {
            Some(seed) => seed.clone(),
            None if rng.below(4) == 0 => mutate(&mut rng, &previous, &corpus, &words),
            None => mutate(&mut rng, &corpus[k % corpus.len()], &corpus, &words),
        };
        std::fs::write(out.join("current"), &input).unwrap();
        let start = Instant::now();
        *running.lock().unwrap() = Some(start);
        REPLAYING.set(true);
        let result = catch_unwind(AssertUnwindSafe(|| target(&input)));
        REPLAYING.set(false);
        let took = start.elapsed();
        let why = match result {
            Err(panic) => panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into()),
            Ok(()) if took > SLOW => format!("took {took:?}"),
            Ok(()) => {
                previous = input;
                continue;
            }
        };
        let file = out.join(format!("input-{k}"));
        std::fs::write(&file, &input).unwrap();
        failures.push(format!("{}: {why}", file.display()));
    }
    *running.lock().unwrap() = None;
    watchdog.join().unwrap();
    std::fs::remove_file(out.join("current")).unwrap();
    assert!(
        failures.is_empty(),
        "{name}: {} of {INPUTS} inputs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn chat_template_inputs() {
    replay("chat_template");
}

#[test]
fn config_inputs() {
    replay("config");
}

#[test]
fn gguf_inputs() {
    replay("gguf");
}

#[test]
fn prompt_cache_inputs() {
    replay("prompt_cache");
}

#[test]
fn safetensors_header_inputs() {
    replay("safetensors_header");
}

/// The generator makes inputs that differ from the seed, and the same ones on every run.
#[test]
fn mutations_change_inputs_and_repeat() {
    let corpus = vec![b"{\"model_type\": \"llama\"}".to_vec(), vec![7; 40]];
    let words = vec![b"{{".to_vec()];
    let make = || {
        let mut rng = Rng(42);
        (0..50)
            .map(|_| mutate(&mut rng, &corpus[0], &corpus, &words))
            .collect::<Vec<_>>()
    };
    let (a, b) = (make(), make());
    assert_eq!(a, b);
    assert!(a.iter().filter(|m| **m != corpus[0]).count() > 40);
    assert!(dictionary(&repo().join("fuzz/chat_template.dict")).contains(&b"\x00".to_vec()));
}
