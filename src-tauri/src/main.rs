// No console window on Windows release builds.
#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

fn main() -> std::process::ExitCode {
    perch_engine::device::prepare_mlx_environment();
    perch_app::run()
}
