//! `--hosts`: this process starts a group's ranks itself, one a host, as `mlx.launch --hosts`
//! does: each rank's process runs this command without `--hosts`, with its backend's environment
//! — for ring, `MLX_RANK` and `MLX_HOSTFILE` (a hostfile listing rank `r` at
//! `host:starting_port + r`); for NCCL, `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP` and
//! `NCCL_PORT` (rank 0's address and the starting port, where the ranks meet) and
//! `CUDA_VISIBLE_DEVICES` (the rank's GPU on its machine: the ranks of a machine take its GPUs in
//! order) — on this machine directly for `localhost` and `127.0.0.1`, over `ssh` elsewhere
//! (key-based, and the same `perch` path on every host, as `mlx.launch` assumes the same Python).
//! Rank 0's standard output, and every rank's standard error (relayed), are this command's;
//! when a rank fails, or this command is interrupted or terminated (SIGINT, SIGTERM), the others
//! are ended.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::distributed::BackendArg;

/// Where a rank runs: `ssh`'s destination (`user@host` or `host`) and the address MLX listens
/// on (`host`).
#[derive(Debug, PartialEq)]
struct Host {
    login: String,
    address: String,
}

/// `host` or `user@host`, each a name or IPv4 address of letters, digits, `.`, `-` and `_`
/// (MLX's ring splits an address at its first colon, and nothing here passes through a shell
/// unquoted).
fn parse_host(spec: &str) -> anyhow::Result<Host> {
    // Not starting with `-`, which `ssh` would read as an option.
    let plain = |s: &str| {
        !s.is_empty()
            && !s.starts_with('-')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    let address = match spec.split_once('@') {
        Some((user, address)) if plain(user) => address,
        Some(_) => "",
        None => spec,
    };
    if !plain(address) {
        bail!("--hosts: {spec:?} is not a host name or IPv4 address (or user@host)");
    }
    Ok(Host {
        login: spec.to_owned(),
        address: address.to_owned(),
    })
}

/// A host this process starts its rank on directly.
fn is_local(address: &str) -> bool {
    matches!(address, "localhost" | "127.0.0.1")
}

/// Each machine of a `--hosts` list (`perch search --hosts`): its RAM in bytes and the ranks it
/// would run, in order of first mention. One machine for all of `localhost` and `127.0.0.1`
/// (this one's memory), one per address otherwise (`user@host` and `host` are the same
/// machine), whose RAM is read over `ssh` as the launcher reaches hosts (`sysctl hw.memsize` on
/// macOS, `MemTotal` of `/proc/meminfo` on Linux). Errors name a host that is not a host name
/// or whose memory could not be read.
pub fn group_memory(hosts: &[String]) -> anyhow::Result<Vec<(u64, usize)>> {
    machines(hosts)?
        .iter()
        .map(|(host, ranks)| Ok((memory_bytes(host)?, *ranks)))
        .collect()
}

/// The machines of a `--hosts` list and the ranks each runs ([`group_memory`]).
fn machines(hosts: &[String]) -> anyhow::Result<Vec<(Host, usize)>> {
    let mut machines: Vec<(Host, usize)> = Vec::new();
    for spec in hosts {
        let host = parse_host(spec)?;
        let same = |h: &Host| {
            h.address == host.address || (is_local(&h.address) && is_local(&host.address))
        };
        match machines.iter_mut().find(|(h, _)| same(h)) {
            Some((_, ranks)) => *ranks += 1,
            None => machines.push((host, 1)),
        }
    }
    Ok(machines)
}

/// `host`'s RAM in bytes ([`group_memory`]).
fn memory_bytes(host: &Host) -> anyhow::Result<u64> {
    if is_local(&host.address) {
        return Ok(perch_hub::total_memory_bytes());
    }
    // Through `sh`, whatever the login shell on that host.
    let read =
        "sysctl -n hw.memsize 2>/dev/null || awk '/^MemTotal:/ { print $2, $3 }' /proc/meminfo";
    let read = shlex::try_quote(read).context("a shell command that quotes")?;
    let output = Command::new("ssh")
        .args([
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            &host.login,
        ])
        .arg(format!("sh -c {read}"))
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running ssh to {}", host.login))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let bytes = match text.trim().split_once(' ') {
        Some((kib, "kB")) => kib.parse::<u64>().ok().map(|k| k.saturating_mul(1024)),
        Some(_) => None,
        None => text.trim().parse::<u64>().ok(),
    };
    bytes
        .filter(|&b| output.status.success() && b > 0)
        .with_context(|| {
            format!(
                "{}: its memory could not be read over ssh ({})",
                host.login,
                String::from_utf8_lossy(&output.stderr).trim()
            )
        })
}

/// The ring backend's hostfile for `hosts`: rank `r` at `address:starting_port + r`.
fn hostfile(hosts: &[Host], starting_port: u16) -> anyhow::Result<String> {
    let last = usize::from(starting_port) + hosts.len() - 1;
    if starting_port == 0 || last > usize::from(u16::MAX) {
        bail!(
            "--starting-port {starting_port}: the ranks need ports {starting_port} to {last}, \
             within 1 to 65535"
        );
    }
    let addresses: Vec<Vec<String>> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| vec![format!("{}:{}", h.address, usize::from(starting_port) + r)])
        .collect();
    Ok(serde_json::to_string(&addresses)?)
}

/// This command's arguments without `--hosts` and `--starting-port`: what every rank runs.
fn rank_args(args: impl Iterator<Item = OsString>) -> Vec<OsString> {
    let mut kept = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = arg.to_string_lossy();
        if text == "--hosts" || text == "--starting-port" {
            skip_value = true;
        } else if !(text.starts_with("--hosts=") || text.starts_with("--starting-port=")) {
            kept.push(arg);
        }
    }
    kept
}

/// The command `ssh` runs for a rank on a remote host: `sh` setting the rank's environment
/// `env` and running `exe args`; with a ring `hostfile`, first writing it to a temporary file
/// there, named by `MLX_HOSTFILE` (and the rank removes that file once MLX has read it).
fn remote_command(
    env: &[(&str, String)],
    hostfile: Option<&str>,
    exe: &std::path::Path,
    args: &[OsString],
) -> anyhow::Result<String> {
    let quote = |s: &str| -> anyhow::Result<String> {
        Ok(shlex::try_quote(s)
            .with_context(|| format!("{s:?} cannot be passed to a shell"))?
            .into_owned())
    };
    fn utf8(s: &std::ffi::OsStr) -> anyhow::Result<&str> {
        s.to_str()
            .with_context(|| format!("{s:?} is not UTF-8: it cannot be passed over ssh"))
    }
    let mut command = String::new();
    if let Some(hostfile) = hostfile {
        command.push_str(&format!(
            "f=$(mktemp) && printf '%s' {} > \"$f\" && ",
            quote(hostfile)?
        ));
    }
    for (name, value) in env {
        command.push_str(&format!("{name}={} ", quote(value)?));
    }
    if hostfile.is_some() {
        command.push_str(&format!(
            "MLX_HOSTFILE=\"$f\" {}=1 ",
            perch_engine::distributed::HOSTFILE_IS_TEMPORARY
        ));
    }
    command.push_str(&format!("exec {}", quote(utf8(exe.as_os_str())?)?));
    for arg in args {
        command.push(' ');
        command.push_str(&quote(utf8(arg)?)?);
    }
    // Through `sh`, whatever the login shell on that host.
    Ok(format!("sh -c {}", quote(&command)?))
}

/// Each rank's environment for NCCL (`hosts` rank 0 first): `MLX_RANK`, `MLX_WORLD_SIZE`,
/// `NCCL_HOST_IP` and `NCCL_PORT` (where the ranks meet: rank 0's address, `127.0.0.1` for this
/// machine, and `port`), `CUDA_VISIBLE_DEVICES` (the rank's GPU: the ranks of one machine take
/// its GPUs in order, on this machine from the devices `visible` lists when it is set), and on a
/// group of this machine alone `NCCL_SOCKET_IFNAME=lo` (as `mlx.launch` sets it). Errors when rank
/// 0 is named as this machine while another host is not (the others could not reach it), and
/// when this machine's ranks would share a GPU (NCCL refuses two ranks of one device): more
/// ranks than the devices `visible` lists, one listed twice, or more than its `gpus` (when
/// known, and `visible` is not set).
fn nccl_environments(
    hosts: &[Host],
    port: u16,
    visible: Option<&str>,
    gpus: Option<usize>,
) -> anyhow::Result<Vec<Vec<(&'static str, String)>>> {
    if port == 0 {
        bail!("--starting-port 0: NCCL's ranks meet at that port on rank 0's host");
    }
    let all_local = hosts.iter().all(|h| is_local(&h.address));
    let meet = match is_local(&hosts[0].address) {
        true if !all_local => bail!(
            "--backend nccl: rank 0 is named {:?}, which the other hosts cannot reach: name it by \
             an address they reach",
            hosts[0].login
        ),
        true => "127.0.0.1".to_owned(),
        false => hosts[0].address.clone(),
    };
    let visible: Vec<&str> = visible
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let local_ranks = hosts.iter().filter(|h| is_local(&h.address)).count();
    // The devices this machine's ranks take.
    let taken = &visible[..local_ranks.min(visible.len())];
    if let Some(twice) = taken
        .iter()
        .enumerate()
        .find_map(|(i, d)| taken[..i].contains(d).then_some(d))
    {
        bail!(
            "--backend nccl: CUDA_VISIBLE_DEVICES lists device {twice} twice; NCCL needs a GPU \
             of its own for each rank"
        );
    }
    match gpus {
        Some(gpus) if visible.is_empty() && local_ranks > gpus => bail!(
            "--backend nccl: {local_ranks} ranks on this machine, which has {gpus} GPU(s); NCCL \
             needs a GPU of its own for each rank"
        ),
        _ => {}
    }
    let mut environments = Vec::with_capacity(hosts.len());
    for (rank, host) in hosts.iter().enumerate() {
        let same = |h: &Host| {
            h.address == host.address || (is_local(&h.address) && is_local(&host.address))
        };
        let index = hosts[..rank].iter().filter(|h| same(h)).count();
        let device = match (is_local(&host.address), visible.get(index)) {
            (true, Some(device)) => (*device).to_owned(),
            (true, None) if !visible.is_empty() => bail!(
                "--backend nccl: {local_ranks} ranks on this machine, but CUDA_VISIBLE_DEVICES \
                 lists {} devices",
                visible.len()
            ),
            _ => index.to_string(),
        };
        let mut env = vec![
            ("MLX_RANK", rank.to_string()),
            ("MLX_WORLD_SIZE", hosts.len().to_string()),
            ("NCCL_HOST_IP", meet.clone()),
            ("NCCL_PORT", port.to_string()),
            ("CUDA_VISIBLE_DEVICES", device),
        ];
        if all_local {
            env.push(("NCCL_SOCKET_IFNAME", "lo".to_owned()));
        }
        environments.push(env);
    }
    Ok(environments)
}

/// This machine's NVIDIA GPUs as `nvidia-smi -L` lists them (as `mlx.launch` counts them);
/// `None` without `nvidia-smi`.
fn local_gpus() -> Option<usize> {
    let out = Command::new("nvidia-smi")
        .arg("-L")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|out| out.status.success())?;
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|line| line.starts_with("GPU "))
            .count(),
    )
}

/// Starts one rank a host of `hosts` (rank 0 first) running this command, relays rank 0's
/// output, and waits for them all; the first that fails ends the others and is the error.
pub fn launch(hosts: &[String], starting_port: u16, backend: BackendArg) -> anyhow::Result<()> {
    if !matches!(backend, BackendArg::Ring | BackendArg::Nccl) {
        bail!(
            "--hosts starts ranks of the ring and NCCL backends; start the ranks of another \
             backend as its launcher does (mlx.launch)"
        );
    }
    if hosts.len() < 2 {
        bail!("--hosts needs two hosts or more (a host may be named twice)");
    }
    let hosts = hosts
        .iter()
        .map(|h| parse_host(h))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Ring: the hostfile every rank reads (this machine's ranks from a temporary file here);
    // NCCL: each rank's environment.
    let (json, mut local, environments) = match backend {
        BackendArg::Nccl => {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
            let environments =
                nccl_environments(&hosts, starting_port, visible.as_deref(), local_gpus())?;
            (None, None, environments)
        }
        _ => {
            let json = hostfile(&hosts, starting_port)?;
            let mut local =
                tempfile::NamedTempFile::new().context("writing the ranks' hostfile")?;
            std::io::Write::write_all(&mut local, json.as_bytes())
                .context("writing the ranks' hostfile")?;
            let environments = (0..hosts.len())
                .map(|rank| vec![("MLX_RANK", rank.to_string())])
                .collect();
            (Some(json), Some(local), environments)
        }
    };
    let exe = std::env::current_exe().context("finding this perch executable")?;
    let args = rank_args(std::env::args_os().skip(1));
    let stopped = on_stop_signals();
    let mut relay = StderrRelay::new();
    let mut ranks: Vec<(Child, &Host)> = Vec::with_capacity(hosts.len());
    for ((rank, host), env) in hosts.iter().enumerate().zip(&environments) {
        let mut command = if is_local(&host.address) {
            let mut command = Command::new(&exe);
            command.args(&args).envs(env.iter().map(|(k, v)| (k, v)));
            if let Some(local) = &mut local {
                command.env("MLX_HOSTFILE", local.path());
            }
            command
        } else {
            let mut command = Command::new("ssh");
            command.args(["-o", "BatchMode=yes", &host.login]);
            command.arg(remote_command(env, json.as_deref(), &exe, &args)?);
            command
        };
        command.stdin(Stdio::null()).stderr(Stdio::piped());
        if rank > 0 {
            command.stdout(Stdio::null());
        }
        match command.spawn() {
            Ok(mut child) => {
                if let Some(stderr) = child.stderr.take() {
                    relay.relay(stderr);
                }
                ranks.push((child, host));
            }
            Err(e) => {
                end(&mut ranks, relay);
                bail!("starting rank {rank} on {}: {e}", host.login);
            }
        }
    }
    loop {
        if stopped.load(Ordering::SeqCst) {
            end(&mut ranks, relay);
            bail!("stopped by a signal: every rank was ended");
        }
        let mut running = 0;
        for rank in 0..ranks.len() {
            match ranks[rank].0.try_wait()? {
                None => running += 1,
                Some(status) if status.success() => {}
                Some(status) => {
                    let login = ranks[rank].1.login.clone();
                    end(&mut ranks, relay);
                    bail!(
                        "rank {rank} on {login} {}: the group stopped",
                        exited(status)
                    );
                }
            }
        }
        if running == 0 {
            relay.finish();
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The ranks' standard error, relayed through this process as it comes, so that this command's
/// own last line starts a line of its own even when a rank was ended in the middle of one (MLX
/// writes `[ring] ` and its message separately).
struct StderrRelay {
    /// Whether the last byte relayed ended a line.
    at_line_start: Arc<Mutex<bool>>,
    closed: mpsc::Receiver<()>,
    closing: mpsc::Sender<()>,
    relays: usize,
}

impl StderrRelay {
    fn new() -> Self {
        let (closing, closed) = mpsc::channel();
        Self {
            at_line_start: Arc::new(Mutex::new(true)),
            closed,
            closing,
            relays: 0,
        }
    }

    /// Copies `from` to this process's standard error on a thread of its own until it closes.
    fn relay(&mut self, mut from: ChildStderr) {
        let at_line_start = Arc::clone(&self.at_line_start);
        let closing = self.closing.clone();
        self.relays += 1;
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                match from.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        let mut at_line_start =
                            at_line_start.lock().unwrap_or_else(|p| p.into_inner());
                        let _ = std::io::stderr().lock().write_all(&buf[..n]);
                        *at_line_start = buf[n - 1] == b'\n';
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            let _ = closing.send(());
        });
    }

    /// Waits (two seconds at most: a rank's own children may hold its standard error open) for
    /// every relayed stream to close, then ends a line left unfinished.
    fn finish(self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        for _ in 0..self.relays {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.closed.recv_timeout(left).is_err() {
                break;
            }
        }
        let mut at_line_start = self.at_line_start.lock().unwrap_or_else(|p| p.into_inner());
        if !*at_line_start {
            let _ = std::io::stderr().lock().write_all(b"\n");
            *at_line_start = true;
        }
    }
}

/// A flag set once this process receives SIGINT or SIGTERM (which then no longer end it: the
/// launcher ends its ranks first). Each signal is awaited on a thread of its own.
fn on_stop_signals() -> Arc<AtomicBool> {
    let stopped = Arc::new(AtomicBool::new(false));
    #[cfg(unix)]
    for kind in [
        tokio::signal::unix::SignalKind::interrupt(),
        tokio::signal::unix::SignalKind::terminate(),
    ] {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build();
        // Registered here, before any rank starts; awaited on the thread.
        let registered = runtime
            .as_ref()
            .ok()
            .and_then(|rt| rt.block_on(async { tokio::signal::unix::signal(kind).ok() }));
        if let (Ok(runtime), Some(mut signal)) = (runtime, registered) {
            let flag = Arc::clone(&stopped);
            std::thread::spawn(move || {
                if runtime.block_on(signal.recv()).is_some() {
                    flag.store(true, Ordering::SeqCst);
                }
            });
        }
    }
    stopped
}

/// Ends every rank still running (a remote one's `ssh`; MLX's ring ends a rank whose peers are
/// gone within seconds), all before reaping any, and finishes relaying their output.
fn end(ranks: &mut [(Child, &Host)], relay: StderrRelay) {
    for (child, _) in ranks.iter_mut() {
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
        }
    }
    for (child, _) in ranks.iter_mut() {
        let _ = child.wait();
    }
    relay.finish();
}

/// "exited with status 1", "was killed by signal 9".
fn exited(status: ExitStatus) -> String {
    #[cfg(unix)]
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&status) {
        return format!("was killed by signal {signal}");
    }
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "ended".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_machines() {
        let hosts: Vec<String> = ["127.0.0.1", "me@h1", "localhost", "h1", "h2"]
            .map(String::from)
            .to_vec();
        let named: Vec<(String, usize)> = machines(&hosts)
            .unwrap()
            .into_iter()
            .map(|(h, ranks)| (h.login, ranks))
            .collect();
        assert_eq!(
            named,
            [
                ("127.0.0.1".to_owned(), 2),
                ("me@h1".to_owned(), 2),
                ("h2".to_owned(), 1)
            ]
        );
        // Local names only (no ssh here): one machine of three ranks, this one's memory.
        let hosts: Vec<String> = ["127.0.0.1", "localhost", "127.0.0.1"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            group_memory(&hosts).unwrap(),
            [(perch_hub::total_memory_bytes(), 3)]
        );
        for bad in ["-oProxyCommand=x y", "-v", "a;b"] {
            let refused = group_memory(&["127.0.0.1".to_owned(), bad.to_owned()]).unwrap_err();
            assert!(
                refused.to_string().contains("is not a host name"),
                "{bad}: {refused}"
            );
        }
    }

    #[test]
    fn hosts_become_a_ring_hostfile() {
        let hosts: Vec<Host> = ["127.0.0.1", "me@studio.local", "10.0.0.2"]
            .iter()
            .map(|h| parse_host(h).unwrap())
            .collect();
        assert_eq!(hosts[1].login, "me@studio.local");
        assert_eq!(hosts[1].address, "studio.local");
        assert_eq!(
            hostfile(&hosts, 5000).unwrap(),
            r#"[["127.0.0.1:5000"],["studio.local:5001"],["10.0.0.2:5002"]]"#
        );
        assert!(hostfile(&hosts, 65534)
            .unwrap_err()
            .to_string()
            .contains("65536"));
        for bad in ["", "a b", "h;rm", "fe80::1", "@h", "u@", "$(x)"] {
            let error = parse_host(bad).unwrap_err().to_string();
            assert!(error.contains("is not a host name"), "{bad:?}: {error}");
        }
        assert!(is_local("127.0.0.1") && is_local("localhost") && !is_local("127.0.0.2"));
    }

    #[test]
    fn ranks_run_the_command_without_the_launch_flags() {
        let args = [
            "generate",
            "--hosts",
            "a,b",
            "--prompt",
            "Hi",
            "--starting-port=7",
            "--json",
        ];
        let kept = rank_args(args.iter().map(OsString::from));
        assert_eq!(kept, ["generate", "--prompt", "Hi", "--json"]);
        let exe = std::path::Path::new("/opt/perch dir/perch");
        let command = remote_command(
            &[("MLX_RANK", "1".to_owned())],
            Some(r#"[["a:1"],["b:2"]]"#),
            exe,
            &kept,
        )
        .unwrap();
        let script = "f=$(mktemp) && printf '%s' '[[\"a:1\"],[\"b:2\"]]' > \"$f\" && MLX_RANK=1 \
                      MLX_HOSTFILE=\"$f\" PERCH_HOSTFILE_IS_TEMPORARY=1 exec '/opt/perch dir/perch' \
                      generate --prompt Hi --json";
        assert_eq!(
            command,
            format!("sh -c {}", shlex::try_quote(script).unwrap())
        );
        // NCCL: the environment alone, no hostfile.
        let env = [
            ("MLX_RANK", "1".to_owned()),
            ("NCCL_HOST_IP", "10.0.0.1".to_owned()),
        ];
        let command = remote_command(&env, None, exe, &kept).unwrap();
        let script = "MLX_RANK=1 NCCL_HOST_IP=10.0.0.1 exec '/opt/perch dir/perch' generate \
                      --prompt Hi --json";
        assert_eq!(
            command,
            format!("sh -c {}", shlex::try_quote(script).unwrap())
        );
    }

    /// NCCL's ranks meet at rank 0's address and the starting port; the ranks of a machine take
    /// its GPUs in order (here, from the devices this process may see); rank 0 named as this
    /// machine while another host is elsewhere is refused.
    #[test]
    fn nccl_ranks_get_their_rendezvous_and_gpu() {
        let parse = |hosts: &[&str]| -> Vec<Host> {
            hosts.iter().map(|h| parse_host(h).unwrap()).collect()
        };
        let get = |env: &[(&str, String)], name: &str| -> Option<String> {
            env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone())
        };
        let one_machine =
            nccl_environments(&parse(&["localhost", "127.0.0.1"]), 6000, None, Some(2)).unwrap();
        for (rank, env) in one_machine.iter().enumerate() {
            assert_eq!(get(env, "MLX_RANK").unwrap(), rank.to_string());
            assert_eq!(get(env, "MLX_WORLD_SIZE").unwrap(), "2");
            assert_eq!(get(env, "NCCL_HOST_IP").unwrap(), "127.0.0.1");
            assert_eq!(get(env, "NCCL_PORT").unwrap(), "6000");
            assert_eq!(get(env, "CUDA_VISIBLE_DEVICES").unwrap(), rank.to_string());
            assert_eq!(get(env, "NCCL_SOCKET_IFNAME").unwrap(), "lo");
        }
        let visible = nccl_environments(
            &parse(&["127.0.0.1", "127.0.0.1"]),
            6000,
            Some("2, 5"),
            Some(1),
        )
        .unwrap();
        assert_eq!(get(&visible[0], "CUDA_VISIBLE_DEVICES").unwrap(), "2");
        assert_eq!(get(&visible[1], "CUDA_VISIBLE_DEVICES").unwrap(), "5");
        let short = nccl_environments(&parse(&["127.0.0.1", "127.0.0.1"]), 6000, Some("3"), None)
            .unwrap_err();
        assert!(short.to_string().contains("lists 1 devices"), "{short}");
        // Two machines of two GPUs each: each machine's ranks count its GPUs from 0.
        let two = nccl_environments(
            &parse(&["a@gpu1", "gpu2", "gpu1", "gpu2"]),
            7000,
            Some("9"),
            Some(1),
        )
        .unwrap();
        let devices: Vec<String> = two
            .iter()
            .map(|e| get(e, "CUDA_VISIBLE_DEVICES").unwrap())
            .collect();
        assert_eq!(devices, ["0", "0", "1", "1"]);
        for env in &two {
            assert_eq!(get(env, "NCCL_HOST_IP").unwrap(), "gpu1");
            assert_eq!(get(env, "NCCL_SOCKET_IFNAME"), None);
        }
        let unreachable =
            nccl_environments(&parse(&["127.0.0.1", "gpu2"]), 7000, None, None).unwrap_err();
        assert!(
            unreachable.to_string().contains("cannot reach"),
            "{unreachable}"
        );
        assert!(nccl_environments(&parse(&["gpu1", "gpu2"]), 0, None, None).is_err());
        // This machine's ranks may not share a GPU.
        let two_local = parse(&["127.0.0.1", "localhost"]);
        let one_gpu = nccl_environments(&two_local, 6000, None, Some(1)).unwrap_err();
        assert!(
            one_gpu.to_string().contains("which has 1 GPU(s)"),
            "{one_gpu}"
        );
        let twice = nccl_environments(&two_local, 6000, Some("0,0"), Some(2)).unwrap_err();
        assert!(twice.to_string().contains("device 0 twice"), "{twice}");
        assert!(
            nccl_environments(&two_local, 6000, None, None).is_ok(),
            "GPUs unknown"
        );
    }
}
