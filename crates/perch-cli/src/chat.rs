//! `perch chat`: a multi-turn conversation in the terminal.

use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;

use clap::Args;
use perch_engine::ChatMessage;

use crate::generate::{run_generation, GenerationOptions};
use crate::model_dir;

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory (mlx-community layout) or a downloaded Hub id (ORG/NAME); default: the model installed by setup.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A system message for the conversation.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub options: GenerationOptions,
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let (model, tokenizer) = model_dir::load(args.model.clone())?;
    let draft = args.options.draft.load()?;
    // Metal: the models stay resident while the command runs (mlx_lm's `wired_limit` around
    // generation); the engine does the same for `serve`, the app and `bench --concurrency`.
    let _wired = perch_engine::device::WiredLimit::raise();
    let mut messages: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.clone()))
        .collect();
    let first = messages.clone();
    eprintln!(
        "Chatting with {} — /reset starts over, /exit or Ctrl-D quits.",
        model.info().model_type
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let Some(line) = lines.next().transpose()? else {
            break;
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = first.clone();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line));
        let prompt = tokenizer.encode_chat(&messages)?;
        let request = args.options.request(prompt);
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let result = run_generation(
            model.as_ref(),
            draft.as_ref(),
            &tokenizer,
            &request,
            |event| {
                let _ = write!(out, "{}", event.text).and_then(|_| out.flush());
                ControlFlow::Continue(())
            },
        );
        writeln!(out)?;
        match result {
            Ok(reply) => {
                let s = &reply.stats;
                eprintln!(
                    "[{} tokens, {:.1} tok/s, TTFT {:.0} ms]",
                    s.generation_tokens,
                    s.generation_tps,
                    s.ttft_s * 1000.0
                );
                messages.push(ChatMessage::new("assistant", reply.text));
            }
            Err(err) => {
                // Keep the conversation usable: drop the message that failed (e.g. context full).
                messages.pop();
                eprintln!("perch: error: {err}");
            }
        }
    }
    Ok(())
}
