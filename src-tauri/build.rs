fn main() {
    // The web UI is built by Vite into ui/dist, which the app embeds; say how when it is missing
    // (instead of tauri's generic "frontendDist does not exist").
    let dist = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ui/dist");
    println!("cargo:rerun-if-changed={}", dist.display());
    if !dist.join("index.html").is_file() {
        panic!(
            "the web UI is not built: run `bash scripts/build-ui.sh` (npm install && npm run build in ui/)"
        );
    }
    // The app binary (and its tests) load libmlx from the wheel directory mlx-sys linked against.
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    // Every command must be granted by a capability (least privilege): the app manifest turns
    // each into an `allow-<command>` permission.
    let commands = &[
        "list_models",
        "load_model",
        "unload_model",
        "model_status",
        "engine_stats",
        "clear_cache",
        "reset_peak_memory",
        "list_conversations",
        "create_conversation",
        "get_conversation",
        "rename_conversation",
        "delete_conversation",
        "set_conversation_settings",
        "chat",
        "stop",
        "get_settings",
        "save_settings",
        "startup_notices",
        "system_stats",
        "search_models",
        "download_model",
        "cancel_download",
        "server_status",
        "check_hosts",
        "hosts_status",
    ];
    tauri_build::try_build(
        tauri_build::Attributes::new()
            .app_manifest(tauri_build::AppManifest::new().commands(commands)),
    )
    .expect("tauri build script");
}
