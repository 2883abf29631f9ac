//! `fake-hub --repo ORG/NAME=DIR [--repo …] [--chunk-delay-ms N]`: serves model directories as a
//! fake Hugging Face Hub on 127.0.0.1 (for the app's end-to-end test), prints its URL on the
//! first line of stdout, and runs until killed.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use perch_hub::fake_hub::{FakeHub, FakeRepo};

fn main() -> ExitCode {
    let mut repos = Vec::new();
    let mut chunk_delay = Duration::ZERO;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let value = args.next();
        let parsed = match (arg.as_str(), value) {
            ("--repo", Some(spec)) => spec
                .split_once('=')
                .ok_or(format!("--repo {spec}: expected ORG/NAME=DIR"))
                .and_then(|(id, dir)| {
                    FakeRepo::from_dir(id, Path::new(dir))
                        .map_err(|e| format!("--repo {spec}: {e}"))
                })
                .map(|repo| repos.push(repo)),
            ("--chunk-delay-ms", Some(ms)) => ms
                .parse()
                .map(|ms| chunk_delay = Duration::from_millis(ms))
                .map_err(|e| format!("--chunk-delay-ms {ms}: {e}")),
            _ => Err(format!("unexpected argument {arg}")),
        };
        if let Err(message) = parsed {
            eprintln!("fake-hub: {message}");
            return ExitCode::FAILURE;
        }
    }
    let hub = FakeHub::start(repos);
    hub.configure(|b| b.chunk_delay = chunk_delay);
    println!("{}", hub.url());
    let _ = std::io::stdout().flush();
    loop {
        std::thread::park();
    }
}
