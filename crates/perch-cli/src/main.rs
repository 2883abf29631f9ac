//! `perch`: run local language models on MLX from the terminal.
//!
//! Subcommands: `generate` (one prompt, streamed), `chat` (interactive), `import` (GGUF → MLX
//! model directory), `bench` (prompt/decode tok/s and peak memory), `search` and `pull` (the
//! Hugging Face Hub), `serve` (the local HTTP API).

mod bench;
mod bench_batch;
mod bench_priority;
mod chat;
mod distributed;
mod generate;
mod hub;
mod import;
mod launch;
mod model_dir;
mod serve;
mod soak;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "perch", version, about = "Run local language models on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt and stream it to stdout.
    Generate(generate::GenerateArgs),
    /// Chat with a model in the terminal (multi-turn).
    Chat(chat::ChatArgs),
    /// Convert a GGUF file (F32/F16/Q8_0/Q4_0/Q4_1, llama family) into an MLX model directory.
    Import(import::ImportArgs),
    /// Measure prompt and decode throughput and peak memory.
    Bench(bench::BenchArgs),
    /// Search the Hugging Face Hub for models (mlx-community by default), with size and fit.
    Search(hub::SearchArgs),
    /// Download a model from the Hugging Face Hub into its cache (resumes, verifies).
    Pull(hub::PullArgs),
    /// Serve the model over HTTP in OpenAI's wire format (chat completions, models).
    Serve(serve::ServeArgs),
    /// Run minutes of mixed traffic (streams, cancels, shared prefixes, long prompts) and print
    /// memory and the KV pool as it goes (a benchmark: memory should stay flat once warm).
    Soak(soak::SoakArgs),
    /// Check Perch's own GPU kernels against MLX's operations on random inputs (CUDA only; prints
    /// the largest error of each case).
    #[command(hide = true)]
    CheckKernels {
        /// The kernels to check (all when none is named).
        #[arg(value_parser = clap::builder::PossibleValuesParser::new(perch_engine::KERNELS))]
        kernels: Vec<String>,
    },
}

fn main() -> ExitCode {
    perch_engine::device::prepare_mlx_environment();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Import(args) => import::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Search(args) => hub::search(args),
        Command::Pull(args) => hub::pull(args),
        Command::Serve(args) => serve::run(args),
        Command::CheckKernels { kernels } => perch_engine::check_kernels(&kernels)
            .map(|lines| lines.iter().for_each(|line| println!("ok: {line}")))
            .map_err(anyhow::Error::from),
        Command::Soak(args) => soak::run(args),
    };
    let code = match result {
        Ok(()) => 0,
        Err(err) => {
            // One line: the error and its causes, outermost first.
            eprintln!("perch: error: {err:#}");
            1
        }
    };
    // A rank of a group ends at once: MLX's exit handlers could wait for ever on a collective
    // stuck on a lost peer (`distributed::exit_now`).
    if perch_engine::distributed::joined() {
        perch_engine::distributed::exit_now(code);
    }
    ExitCode::from(code as u8)
}
