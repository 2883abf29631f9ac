//! Placeholder for the Tauri 2 menu-bar shell (tray, chat window, dashboards), which calls into
//! `perch-engine`. Until it exists, `perch chat` is the way to talk to a model.

fn main() {
    eprintln!("The Perch menu-bar app is not built yet; use `perch chat` (crates/perch-cli).");
    std::process::exit(2);
}
