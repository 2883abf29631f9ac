//! Settings → Hosts: the machines a model could be divided over (`perch serve --hosts`, the
//! settings' `hosts`), each one's memory read over `ssh` when the user asks
//! ([`check_hosts`], off the main thread: an unreachable host takes seconds), and each one's
//! share of a model. The last reading judges models against the group too: the model picker's
//! and the Hub search's `group_fit` ([`GroupMemory::fit`]).

use std::sync::Mutex;

use perch_hub::hosts::{machine_memory, Host};
use perch_hub::{group_memory_fit, MemoryFit};
use serde::Serialize;
use tauri::{AppHandle, Manager, Runtime};

use super::{off_main_thread, poisoned, CommandError};
use crate::store::Store;

/// One machine of the group as last read.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MachineView {
    /// How it is reached (`user@host` or `host`; the first name given for this machine).
    pub login: String,
    /// The ranks it runs: how many times the hosts name it.
    pub ranks: usize,
    /// Its RAM in bytes; `None` when it could not be read (`error` says why).
    pub memory_bytes: Option<u64>,
    pub error: Option<String>,
    /// Its share of a divided model's weights: its ranks of all the group's (every rank holds
    /// an even part; `perch_hub::group_memory_fit`'s rule).
    pub share: f64,
}

/// The group as last read: its machines, rank 0's first.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HostsView {
    /// The settings' hosts this reading is of.
    pub hosts: Vec<String>,
    pub machines: Vec<MachineView>,
    /// The RAM of all machines together; `None` when one could not be read or there are none.
    pub memory_bytes: Option<u64>,
}

impl HostsView {
    /// Reads `hosts` (validated settings): each machine's memory over `ssh`, all at once.
    fn read(hosts: &[String]) -> Result<Self, CommandError> {
        let parsed = hosts
            .iter()
            .map(|h| Host::parse(h))
            .collect::<Result<Vec<Host>, String>>()
            .map_err(|why| CommandError::invalid(&why))?;
        let read = machine_memory(&parsed);
        let ranks: usize = read.iter().map(|(_, _, ranks)| ranks).sum();
        let machines: Vec<MachineView> = read
            .into_iter()
            .map(|(host, memory, here)| MachineView {
                login: host.login.clone(),
                ranks: here,
                share: here as f64 / ranks.max(1) as f64,
                memory_bytes: memory.as_ref().ok().copied(),
                error: memory.err(),
            })
            .collect();
        let memory_bytes = match machines.is_empty() {
            true => None,
            false => machines.iter().map(|m| m.memory_bytes).sum(),
        };
        Ok(Self {
            hosts: hosts.to_vec(),
            machines,
            memory_bytes,
        })
    }
}

/// The last reading of the group ([`check_hosts`]).
#[derive(Default)]
pub struct GroupMemory(Mutex<Option<HostsView>>);

impl GroupMemory {
    /// How a model of `weights_bytes` with a KV cache budget of `kv_cache_bytes` a rank fits
    /// the group of `hosts` (the settings' list) divided evenly over its ranks
    /// ([`perch_hub::group_memory_fit`]), by the last reading of that same list; `None` when
    /// there are no hosts or they have not been read since they changed.
    pub fn fit(
        &self,
        hosts: &[String],
        weights_bytes: Option<u64>,
        kv_cache_bytes: u64,
    ) -> Option<MemoryFit> {
        let last = self.0.lock().ok()?;
        let view = last
            .as_ref()
            .filter(|v| !hosts.is_empty() && v.hosts == hosts)?;
        let machines: Vec<(u64, usize)> = view
            .machines
            .iter()
            .map(|m| (m.memory_bytes.unwrap_or(0), m.ranks))
            .collect();
        Some(group_memory_fit(weights_bytes, kv_cache_bytes, &machines))
    }
}

/// Reads the memory of every machine the settings' hosts name (over `ssh`, key-based, all at
/// once; each within `perch_hub::hosts::MEMORY_READ_LIMIT`) and keeps the reading for the
/// models' `group_fit`.
/// No hosts: an empty view.
#[tauri::command]
pub async fn check_hosts<R: Runtime>(app: AppHandle<R>) -> Result<HostsView, CommandError> {
    off_main_thread(app, |app| {
        let hosts = app.state::<Store>().settings()?.hosts;
        let view = HostsView::read(&hosts)?;
        // Kept only while it is of the hosts the settings list (a reading of an older list
        // that ends after a newer one's does not replace it).
        if view.hosts == app.state::<Store>().settings()?.hosts {
            *app.state::<GroupMemory>()
                .0
                .lock()
                .map_err(|_| poisoned())? = Some(view.clone());
        }
        Ok(view)
    })
    .await
}

/// The last reading of the settings' hosts, when it is of the hosts they list now.
#[tauri::command]
pub fn hosts_status(
    store: tauri::State<'_, Store>,
    group: tauri::State<'_, GroupMemory>,
) -> Result<Option<HostsView>, CommandError> {
    let hosts = store.settings()?.hosts;
    let last = group.0.lock().map_err(|_| poisoned())?;
    Ok(last.as_ref().filter(|v| v.hosts == hosts).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine under two names is one machine of two ranks holding the whole model; a
    /// reading judges only the list it was of.
    #[test]
    fn local_names_are_one_machine_and_a_reading_judges_its_own_list() {
        let hosts: Vec<String> = vec!["127.0.0.1".into(), "localhost".into()];
        let view = HostsView::read(&hosts).unwrap();
        let ram = perch_hub::total_memory_bytes();
        assert_eq!(view.machines.len(), 1);
        assert_eq!(view.machines[0].ranks, 2);
        assert_eq!(view.machines[0].share, 1.0);
        assert_eq!(view.memory_bytes, Some(ram));
        let group = GroupMemory::default();
        *group.0.lock().unwrap() = Some(view);
        let small = Some(ram / 100);
        assert_eq!(group.fit(&hosts, small, 0), Some(MemoryFit::Fits));
        assert_eq!(
            group.fit(&hosts, Some(ram * 2), 0),
            Some(MemoryFit::TooLarge)
        );
        assert_eq!(group.fit(&["other".into()], small, 0), None);
        assert_eq!(group.fit(&[], small, 0), None);
    }

    /// Two machines share a model by their ranks; one that cannot be read leaves the group's
    /// memory and fit unknown, with its reason.
    #[test]
    fn machines_share_by_ranks_and_an_unread_one_is_unknown() {
        let view = HostsView {
            hosts: vec!["a".into(), "b".into(), "b".into()],
            machines: vec![
                MachineView {
                    login: "a".into(),
                    ranks: 1,
                    memory_bytes: Some(64 << 30),
                    error: None,
                    share: 1.0 / 3.0,
                },
                MachineView {
                    login: "b".into(),
                    ranks: 2,
                    memory_bytes: None,
                    error: Some("b: its memory could not be read over ssh".into()),
                    share: 2.0 / 3.0,
                },
            ],
            memory_bytes: None,
        };
        let group = GroupMemory::default();
        let hosts = view.hosts.clone();
        *group.0.lock().unwrap() = Some(view);
        assert_eq!(
            group.fit(&hosts, Some(1 << 30), 0),
            Some(MemoryFit::Unknown)
        );
        // A host that is no host name is refused before any ssh.
        let refused = HostsView::read(&["-oProxyCommand=x".into()]).unwrap_err();
        assert!(
            refused.to_string().contains("is not a host name"),
            "{refused}"
        );
    }
}
