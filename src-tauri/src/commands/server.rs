//! The app's local API server (Settings → Local server): `perch-server` over the model the app
//! has loaded, the same [`perch_engine::EngineHandle`] the chat window uses, so API requests
//! and chats are batched together. Off by default; started, restarted or stopped when the
//! settings change, and at start when they say so. The dashboard shows its address and live
//! request count ([`server_status`]).

use super::CommandError;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Mutex;

use perch_server::{ServedModel, ServerActivity, ServerConfig};
use perch_store::ServerSettings;
use serde::Serialize;
use tauri::State;
use tokio::sync::oneshot;

use super::poisoned;

/// The server, when one runs, and what it serves.
pub struct LocalServer {
    /// The app's loaded model; [`crate::AppState`] replaces it on every load and unload.
    served: ServedModel,
    running: Mutex<Option<Running>>,
}

struct Running {
    settings: ServerSettings,
    address: SocketAddr,
    activity: ServerActivity,
    /// Dropped or sent: the server stops taking connections and ends.
    stop: oneshot::Sender<()>,
}

/// What the dashboard shows.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ServerStatus {
    /// Whether a server is listening.
    pub running: bool,
    /// Its base URL for clients (`http://127.0.0.1:8080/v1`); on all interfaces the host is
    /// `0.0.0.0` (other devices use this machine's address).
    pub url: Option<String>,
    /// Requests in the engine now, and since it started.
    pub requests: usize,
    pub served: u64,
    /// Whether it asks for a key, and whether other devices may call it.
    pub api_key: bool,
    pub allow_lan: bool,
}

impl LocalServer {
    pub fn new(served: ServedModel) -> Self {
        Self {
            served,
            running: Mutex::new(None),
        }
    }

    /// Makes the server match `settings`: stopped when disabled, (re)started when enabled and
    /// different from the running one (port, key or interface), untouched otherwise. A port
    /// that cannot be bound is an error: a new port leaves the running server as it was; on the
    /// same port (another key or interface) the old server was stopped to free it, and the
    /// caller restores it by applying the old settings (as `save_settings` does).
    pub fn apply(&self, settings: &ServerSettings) -> Result<(), CommandError> {
        let mut running = self.running.lock().map_err(|_| poisoned())?;
        if !settings.enabled {
            *running = None;
            return Ok(());
        }
        if running.as_ref().is_some_and(|r| &r.settings == settings) {
            return Ok(());
        }
        let host = if settings.allow_lan {
            Ipv4Addr::UNSPECIFIED
        } else {
            Ipv4Addr::LOCALHOST
        };
        // A restart on the same port: the old listener must close first.
        let same_port = running
            .as_ref()
            .is_some_and(|r| r.address.port() == settings.port && settings.port != 0);
        let previous = if same_port { running.take() } else { None };
        drop(previous);
        let listener = bind_retrying((host, settings.port).into(), same_port).map_err(|e| {
            CommandError::invalid(&format!(
                "The local server cannot listen on port {}: {e}. Choose another port.",
                settings.port
            ))
        })?;
        let address = listener.local_addr().map_err(|e| e.to_string())?;
        listener
            .set_nonblocking(true)
            .map_err(|e| CommandError::invalid(&format!("The local server cannot start: {e}.")))?;
        let config = ServerConfig {
            api_key: settings.api_key.clone(),
            any_model_name: settings.any_model_name,
            model_aliases: settings.model_aliases.clone(),
            ..ServerConfig::new()
        };
        let activity = config.activity.clone();
        let router = perch_server::router(self.served.clone(), config);
        let (stop, stopped) = oneshot::channel::<()>();
        tauri::async_runtime::spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            let shutdown = async move {
                let _ = stopped.await;
            };
            let _ = perch_server::serve_until(listener, router, shutdown).await;
        });
        *running = Some(Running {
            settings: settings.clone(),
            address,
            activity,
            stop,
        });
        Ok(())
    }

    /// Stops the server (the app is quitting, or the tests are done).
    pub fn stop(&self) {
        if let Ok(mut running) = self.running.lock() {
            if let Some(r) = running.take() {
                let _ = r.stop.send(());
            }
        }
    }

    pub fn status(&self) -> ServerStatus {
        let Ok(running) = self.running.lock() else {
            return ServerStatus::default();
        };
        match running.as_ref() {
            Some(r) => ServerStatus {
                running: true,
                url: Some(format!("http://{}/v1", r.address)),
                requests: r.activity.requests(),
                served: r.activity.served(),
                api_key: r.settings.api_key.is_some(),
                allow_lan: r.settings.allow_lan,
            },
            None => ServerStatus::default(),
        }
    }
}

/// Binds `address`; right after a server on the same port stopped, its socket may take a moment
/// to close, so a few retries are allowed then.
fn bind_retrying(address: SocketAddr, restarting: bool) -> std::io::Result<TcpListener> {
    let tries = if restarting { 20 } else { 1 };
    let mut last = None;
    for _ in 0..tries {
        match TcpListener::bind(address) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    Err(last.expect("at least one try"))
}

/// The local server's address and live request count, for the dashboard.
#[tauri::command]
pub fn server_status(server: State<'_, LocalServer>) -> ServerStatus {
    server.status()
}
