//! `perch serve`: the local HTTP API (OpenAI's wire format) over one loaded model, headless.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use perch_engine::{EngineConfig, EngineHandle};
use perch_server::{router, serve, ServerConfig};

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
    /// Require this key (`Authorization: Bearer KEY`) on every request.
    #[arg(long, env = "PERCH_API_KEY")]
    pub api_key: Option<String>,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let dir = model_dir::resolve(args.model.clone())?;
    // The id clients name: the Hub id or directory given, else the directory's name.
    let model_id = match &args.model {
        Some(given) => given.to_string_lossy().into_owned(),
        None => dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        ),
    };
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| {
            format!(
                "`{}:{}` is not an address to listen on",
                args.host, args.port
            )
        })?;
    eprintln!("loading {}", dir.display());
    let engine = EngineHandle::load(&dir, EngineConfig::default())
        .with_context(|| format!("loading {}", dir.display()))?;
    let config = ServerConfig {
        model_id: model_id.clone(),
        api_key: args.api_key,
    };
    let runtime = tokio::runtime::Runtime::new().context("starting the server's runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        // The line scripts wait for: the address actually bound (port 0 picks a free one).
        println!("perch serve: {model_id} at http://{local}/v1");
        serve(listener, router(engine, config))
            .await
            .context("serving")
    })
}
