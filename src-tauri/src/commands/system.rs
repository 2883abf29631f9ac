//! What the machine reports: system RAM and this process's resident memory (`sysinfo`).

use super::CommandError;
use std::sync::Mutex;

use serde::Serialize;
use tauri::State;

use super::poisoned;

/// System memory and this process's resident set, in bytes (from `sysinfo`).
#[derive(Clone, Debug, Serialize)]
pub struct SystemStats {
    pub ram_used_bytes: u64,
    pub ram_total_bytes: u64,
    /// What a model and its KV cache may take: [`perch_hub::USABLE_MEMORY_FRACTION`] of RAM.
    pub usable_memory_bytes: u64,
    /// `None` when the OS does not report it.
    pub process_rss_bytes: Option<u64>,
}

/// `sysinfo`'s view of the machine, kept between calls (refreshing it is cheap, creating it not).
#[derive(Default)]
pub struct SystemMonitor(Mutex<sysinfo::System>);

#[tauri::command]
pub fn system_stats(monitor: State<'_, SystemMonitor>) -> Result<SystemStats, CommandError> {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate};
    let mut system = monitor.0.lock().map_err(|_| poisoned())?;
    system.refresh_memory();
    let pid = sysinfo::get_current_pid().ok();
    if let Some(pid) = pid {
        system.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[pid]),
            false,
            ProcessRefreshKind::nothing().with_memory(),
        );
    }
    Ok(SystemStats {
        ram_used_bytes: system.used_memory(),
        ram_total_bytes: system.total_memory(),
        usable_memory_bytes: (system.total_memory() as f64 * perch_hub::USABLE_MEMORY_FRACTION)
            as u64,
        process_rss_bytes: pid.and_then(|pid| system.process(pid)).map(|p| p.memory()),
    })
}
