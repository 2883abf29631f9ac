//! `perch serve`: the local HTTP API (OpenAI's and Anthropic's wire formats) over one loaded model,
//! headless.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use perch_engine::{EngineConfig, EngineHandle};
use perch_server::{router, serve_until, HeaderValue, ServedModel, ServerConfig};

use crate::model_dir;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Model directory (mlx-community layout) or a downloaded Hub id (ORG/NAME); default: the model installed by setup.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on: 127.0.0.1 (this machine only) unless told otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every request.
    #[arg(long, env = "PERCH_API_KEY")]
    pub api_key: Option<String>,
    /// Most requests in the engine at once; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = ServerConfig::DEFAULT_MAX_REQUESTS, value_parser = parse_max_requests)]
    pub max_requests: usize,
    /// Let web pages from ORIGIN (e.g. http://localhost:3000, or * for any) call the API (repeatable).
    #[arg(long = "cors-origin", value_name = "ORIGIN", value_parser = parse_origin)]
    pub cors_origins: Vec<HeaderValue>,
    /// A draft model (directory or downloaded Hub id, the model's tokenizer): requests then use
    /// speculative decoding unless they set `num_draft_tokens` to 0.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// With --draft-model: tokens proposed per step unless a request says.
    #[arg(long, default_value_t = perch_engine::Draft::DEFAULT_NUM_DRAFT_TOKENS)]
    pub num_draft_tokens: usize,
    #[command(flatten)]
    pub prompt_lookup: crate::generate::PromptLookupOptions,
    /// Unload the model after this long with no request (Ollama's keep_alive: 30m, 1h, 300 for
    /// seconds, 0 once each request ends, -1 never); the next request loads it again. Requests
    /// may set their own `keep_alive`.
    #[arg(long, env = "PERCH_KEEP_ALIVE", default_value = "1h", value_parser = perch_engine::KeepAlive::parse, allow_hyphen_values = true)]
    pub keep_alive: perch_engine::KeepAlive,
    /// Another name requests may give the served model, as NAME or NAME=MODEL (MODEL: the
    /// --model given or the id the server prints); coding agents send their vendor's model
    /// names (repeatable).
    #[arg(long = "alias", value_name = "NAME[=MODEL]")]
    pub aliases: Vec<String>,
    /// Serve the model under any name a request gives.
    #[arg(long)]
    pub any_model_name: bool,
    /// In the log's line for a prompt that left the client's previous one (a prefix-cache
    /// miss), show a few tokens of text of each side (off: no prompt text goes to the log).
    #[arg(long)]
    pub log_prompt_text: bool,
    #[command(flatten)]
    pub group: crate::distributed::DistributedArgs,
}

/// The id clients name the model in `dir` by: `ORG/NAME` for a snapshot of the Hugging Face cache
/// (`…/models--ORG--NAME/snapshots/REVISION`), else the directory's name — never a file-system
/// path.
fn short_id(dir: &std::path::Path) -> String {
    let name = |p: &std::path::Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let repo = dir
        .parent()
        .filter(|p| name(p).as_deref() == Some("snapshots"))
        .and_then(|p| p.parent())
        .and_then(name)
        .and_then(|n| {
            let (org, model) = n.strip_prefix("models--")?.split_once("--")?;
            Some(format!("{org}/{model}"))
        });
    repo.or_else(|| name(dir))
        .unwrap_or_else(|| dir.display().to_string())
}

/// `--alias`'s names: NAME, or NAME=MODEL where MODEL is `model_id` (the one model served) or the
/// `--model` given.
fn alias_names(
    aliases: &[String],
    model_id: &str,
    given: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    aliases
        .iter()
        .map(|alias| {
            let (name, model) = match alias.split_once('=') {
                Some((name, model)) => (name.trim(), Some(model.trim())),
                None => (alias.trim(), None),
            };
            if name.is_empty() {
                anyhow::bail!("--alias `{alias}` names nothing: give NAME or NAME=MODEL");
            }
            if let Some(model) = model.filter(|&m| m != model_id && Some(m) != given) {
                anyhow::bail!("--alias `{alias}`: this server serves `{model_id}`, not `{model}`");
            }
            Ok(name.to_string())
        })
        .collect()
}

fn parse_max_requests(arg: &str) -> Result<usize, String> {
    match arg.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("`{arg}` is not a number of requests (1 or more)")),
    }
}

fn parse_origin(origin: &str) -> Result<HeaderValue, String> {
    let valid = origin == "*"
        || ((origin.starts_with("http://") || origin.starts_with("https://"))
            && !origin.trim_end_matches('/').contains(char::is_whitespace));
    if !valid {
        return Err(format!(
            "`{origin}` is not an origin: give scheme://host[:port], or *"
        ));
    }
    HeaderValue::from_str(origin.trim_end_matches('/'))
        .map_err(|_| format!("`{origin}` is not an origin: give scheme://host[:port], or *"))
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    if args.group.launches() {
        return args.group.launch();
    }
    let dir = model_dir::resolve(args.model.clone())?;
    let model_id = short_id(&dir);
    let given = args
        .model
        .as_ref()
        .map(|m| m.to_string_lossy().into_owned());
    let mut aliases = alias_names(&args.aliases, &model_id, given.as_deref())?;
    // The --model given (a path, say) stays a name requests may use.
    if let Some(given) = given.filter(|g| *g != model_id && !aliases.contains(g)) {
        aliases.push(given);
    }
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| {
            format!(
                "`{}:{}` is not an address to listen on",
                args.host, args.port
            )
        })?;
    eprintln!("loading {}", dir.display());
    let draft_model = args
        .draft_model
        .map(|draft| model_dir::resolve(Some(draft)))
        .transpose()?;
    let engine_config = EngineConfig {
        draft_model,
        num_draft_tokens: args.num_draft_tokens,
        prompt_lookup: args.prompt_lookup.config()?,
        keep_alive: args.keep_alive,
        ..EngineConfig::default()
    };
    let engine = match args.group.distributed {
        None => EngineHandle::load(&dir, engine_config)
            .with_context(|| format!("loading {}", dir.display()))?,
        Some(split) => {
            match crate::distributed::engine(&dir, split, &args.group, engine_config)? {
                Some(engine) => engine,
                // Another rank than 0: it followed rank 0's batch until rank 0 stopped.
                None => return Ok(()),
            }
        }
    };
    let config = ServerConfig {
        model_aliases: aliases,
        any_model_name: args.any_model_name,
        num_draft_tokens: args.num_draft_tokens,
        api_key: args.api_key,
        max_requests: args.max_requests,
        cors_origins: args.cors_origins,
        log_prompt_text: args.log_prompt_text,
        ..ServerConfig::new()
    };
    // A line a request on standard error (the prefix cache's hits and misses); `RUST_LOG`-style
    // filtering is left out: one level.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_max_level(tracing::Level::INFO)
        .init();
    // Rank 0 of a divided model: the ranks that stopped working together cannot serve again,
    // and the others wait for rank 0's process to end; so it ends, with their sentence.
    let watched = args.group.distributed.is_some().then(|| engine.clone());
    let runtime = tokio::runtime::Runtime::new().context("starting the server's runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        // The line scripts wait for: the address actually bound (port 0 picks a free one).
        println!("perch serve: {model_id} at http://{local}/v1");
        let (stopped, why) = tokio::sync::oneshot::channel();
        let shutdown = async move {
            match watched {
                Some(engine) => {
                    let _ = stopped.send(group_stopped(&engine).await);
                }
                None => std::future::pending().await,
            }
        };
        serve_until(
            listener,
            router(ServedModel::new(engine, model_id), config),
            shutdown,
        )
        .await
        .context("serving")?;
        match why.await {
            Ok(why) => anyhow::bail!("{why}"),
            Err(_) => Ok(()),
        }
    })
}

/// How often rank 0 of a divided model looks whether its ranks still work together.
const GROUP_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// Returns once the engine's ranks stopped working together (its stats say why), or its thread
/// ended.
async fn group_stopped(engine: &EngineHandle) -> String {
    loop {
        match engine.stats() {
            Ok(stats) => {
                if let Some(why) = stats.group_stopped {
                    return why;
                }
            }
            Err(e) => return e.to_string(),
        }
        tokio::time::sleep(GROUP_WATCH_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::short_id;
    use std::path::Path;

    #[test]
    fn served_models_have_short_ids() {
        let snapshot =
            "/home/u/.cache/huggingface/hub/models--mlx-community--Qwen3-0.6B-4bit/snapshots/abc";
        assert_eq!(
            short_id(Path::new(snapshot)),
            "mlx-community/Qwen3-0.6B-4bit"
        );
        assert_eq!(short_id(Path::new("/models/SmolLM2-mlx")), "SmolLM2-mlx");
        assert_eq!(
            short_id(Path::new("/x/snapshots/abc")),
            "abc",
            "not a Hub cache folder"
        );
    }
}
