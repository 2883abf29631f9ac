//! The machines of a group that divides a model (`perch serve --hosts`, the app's Settings →
//! Hosts): host names as `ssh` reaches them, which of them are one machine, and each machine's
//! RAM, read over `ssh` (key-based, never asking for a password) as the launcher reaches hosts.

use std::process::{Command, Stdio};

/// Where a rank runs: `ssh`'s destination (`login`: `user@host` or `host`), the host's name or
/// address (`address`: this machine when it is `localhost` or `127.0.0.1`), and from a hostfile
/// the addresses its rank listens on (`ips`: ring's, and where the others meet rank 0;
/// `address` when none are given) and the RDMA devices reaching each other rank (`rdma`,
/// JACCL's: for each rank `null`, a device name or a list of names).
#[derive(Clone, Debug, PartialEq)]
pub struct Host {
    pub login: String,
    pub address: String,
    pub ips: Vec<String>,
    pub rdma: Vec<serde_json::Value>,
}

impl Host {
    /// `spec`, `host` or `user@host`, each a name or IPv4 address of letters, digits, `.`, `-`
    /// and `_` (MLX's ring splits an address at its first colon, and nothing passes through a
    /// shell unquoted). Errors: a sentence naming `spec`.
    pub fn parse(spec: &str) -> Result<Host, String> {
        let address = match spec.split_once('@') {
            Some((user, address)) if is_plain(user) => address,
            Some(_) => "",
            None => spec,
        };
        if !is_plain(address) {
            return Err(format!(
                "{spec:?} is not a host name or IPv4 address (or user@host)"
            ));
        }
        Ok(Host {
            login: spec.to_owned(),
            address: address.to_owned(),
            ips: Vec::new(),
            rdma: Vec::new(),
        })
    }

    /// The addresses this host's rank listens on: its hostfile `ips`, else its name.
    pub fn listens_on(&self) -> Vec<&str> {
        match self.ips.is_empty() {
            true => vec![self.address.as_str()],
            false => self.ips.iter().map(String::as_str).collect(),
        }
    }

    /// Whether this is this machine (`localhost` or `127.0.0.1`): its rank is started directly,
    /// not over `ssh`.
    pub fn is_local(&self) -> bool {
        is_local(&self.address)
    }

    /// Whether `other` is the same machine: the same name, or both this one.
    pub fn same_machine(&self, other: &Host) -> bool {
        self.address == other.address || (self.is_local() && other.is_local())
    }

    /// This host's RAM in bytes: this machine's ([`crate::total_memory_bytes`]) for a local
    /// name, else read over `ssh` (`sysctl hw.memsize` on macOS, `MemTotal` of `/proc/meminfo`
    /// on Linux; [`SSH_OPTIONS`]), within [`MEMORY_READ_LIMIT`]. Errors: a sentence naming the host
    /// and `ssh`'s complaint.
    pub fn memory_bytes(&self) -> Result<u64, String> {
        if self.is_local() {
            return Ok(crate::total_memory_bytes());
        }
        // Through `sh`, whatever the login shell on that host.
        let read =
            "sysctl -n hw.memsize 2>/dev/null || awk '/^MemTotal:/ { print $2, $3 }' /proc/meminfo";
        let read = shlex::try_quote(read).map_err(|e| e.to_string())?;
        let mut ssh = Command::new("ssh")
            .args(SSH_OPTIONS)
            .arg(&self.login)
            .arg(format!("sh -c {read}"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: running ssh: {e}", self.login))?;
        // `ssh`'s own limits bound connecting and a link gone quiet, not a login or command
        // that hangs on a host that answers: the whole reading is bounded too (its few bytes
        // of output fit the pipes meanwhile).
        let started = std::time::Instant::now();
        while ssh.try_wait().map_err(|e| e.to_string())?.is_none() {
            if started.elapsed() > MEMORY_READ_LIMIT {
                let _ = ssh.kill();
                let _ = ssh.wait();
                return Err(format!(
                    "{}: its memory could not be read over ssh (no answer within {} s)",
                    self.login,
                    MEMORY_READ_LIMIT.as_secs()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let output = ssh
            .wait_with_output()
            .map_err(|e| format!("{}: running ssh: {e}", self.login))?;
        let text = String::from_utf8_lossy(&output.stdout);
        let bytes = match text.trim().split_once(' ') {
            Some((kib, "kB")) => kib.parse::<u64>().ok().map(|k| k.saturating_mul(1024)),
            Some(_) => None,
            None => text.trim().parse::<u64>().ok(),
        };
        bytes
            .filter(|&b| output.status.success() && b > 0)
            .ok_or_else(|| {
                format!(
                    "{}: its memory could not be read over ssh ({})",
                    self.login,
                    String::from_utf8_lossy(&output.stderr).trim()
                )
            })
    }
}

/// A name or IPv4 address of letters, digits, `.`, `-` and `_`, not starting with `-` (which
/// `ssh` would read as an option).
pub fn is_plain(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with('-')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// Whether `address` names this machine.
pub fn is_local(address: &str) -> bool {
    matches!(address, "localhost" | "127.0.0.1")
}

/// The machines of a group (rank 0's host first) and the ranks each runs, in order of first
/// mention: one machine for all of `localhost` and `127.0.0.1`, one per address otherwise
/// (`user@host` and `host` are the same machine).
pub fn machines(hosts: &[Host]) -> Vec<(&Host, usize)> {
    let mut machines: Vec<(&Host, usize)> = Vec::new();
    for host in hosts {
        match machines.iter_mut().find(|(h, _)| h.same_machine(host)) {
            Some((_, ranks)) => *ranks += 1,
            None => machines.push((host, 1)),
        }
    }
    machines
}

/// Each machine of `hosts` ([`machines`]): its RAM in bytes ([`Host::memory_bytes`], all read
/// at once) and the ranks it would run. Errors: the first host whose memory could not be read.
pub fn group_memory(hosts: &[Host]) -> Result<Vec<(u64, usize)>, String> {
    machine_memory(hosts)
        .into_iter()
        .map(|(_, memory, ranks)| memory.map(|bytes| (bytes, ranks)))
        .collect()
}

/// Each machine of `hosts` ([`machines`]), its RAM in bytes or why it could not be read, and the
/// ranks it would run; the machines are asked at once (each within [`MEMORY_READ_LIMIT`]).
pub fn machine_memory(hosts: &[Host]) -> Vec<(&Host, Result<u64, String>, usize)> {
    let machines = machines(hosts);
    std::thread::scope(|scope| {
        let asked: Vec<_> = machines
            .iter()
            .map(|&(host, ranks)| (host, scope.spawn(move || host.memory_bytes()), ranks))
            .collect();
        asked
            .into_iter()
            .map(|(host, memory, ranks)| {
                let memory = memory
                    .join()
                    .unwrap_or_else(|_| Err(format!("{}: reading its memory failed", host.login)));
                (host, memory, ranks)
            })
            .collect()
    })
}

/// How the launcher runs `ssh`: never asking for a password (a rank cannot answer), giving up on
/// a host that does not answer within 10 s, and on a connection whose host stops answering for
/// 15 s (three keep-alives 5 s apart), so that an unreachable or lost host ends a launch within
/// seconds rather than after the system's TCP timeouts (`ssh` then exits with [`SSH_FAILED`]).
pub const SSH_OPTIONS: [&str; 8] = [
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
];

/// The longest [`Host::memory_bytes`] waits for a host's answer over `ssh`.
pub const MEMORY_READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// The status `ssh` exits with when it fails itself, rather than passing on its command's.
pub const SSH_FAILED: i32 = 255;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(hosts: &[&str]) -> Vec<Host> {
        hosts.iter().map(|h| Host::parse(h).unwrap()).collect()
    }

    #[test]
    fn hosts_name_machines() {
        let hosts = parse_all(&["127.0.0.1", "me@h1", "localhost", "h1", "h2"]);
        let named: Vec<(&str, usize)> = machines(&hosts)
            .into_iter()
            .map(|(h, ranks)| (h.login.as_str(), ranks))
            .collect();
        assert_eq!(named, [("127.0.0.1", 2), ("me@h1", 2), ("h2", 1)]);
        // Local names only (no ssh here): one machine of three ranks, this one's memory.
        let hosts = parse_all(&["127.0.0.1", "localhost", "127.0.0.1"]);
        assert_eq!(
            group_memory(&hosts).unwrap(),
            [(crate::total_memory_bytes(), 3)]
        );
    }

    #[test]
    fn host_names_are_plain() {
        let host = Host::parse("me@studio.local").unwrap();
        assert_eq!(
            (host.login.as_str(), host.address.as_str()),
            ("me@studio.local", "studio.local")
        );
        for bad in [
            "",
            "a b",
            "h;rm",
            "fe80::1",
            "@h",
            "u@",
            "$(x)",
            "-oProxyCommand=x y",
            "-v",
        ] {
            let error = Host::parse(bad).unwrap_err();
            assert!(error.contains("is not a host name"), "{bad:?}: {error}");
        }
        assert!(is_local("127.0.0.1") && is_local("localhost") && !is_local("127.0.0.2"));
    }
}
