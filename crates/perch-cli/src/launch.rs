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

use perch_hub::hosts::{self, is_local, is_plain, Host, SSH_FAILED, SSH_OPTIONS};

use crate::distributed::BackendArg;

/// `host` or `user@host` (`perch_hub::hosts::Host::parse`), as `--hosts` names it.
fn parse_host(spec: &str) -> anyhow::Result<Host> {
    Host::parse(spec).map_err(|why| anyhow::anyhow!("--hosts: {why}"))
}

/// A group read from a hostfile in `mlx.launch`'s format (what `mlx.distributed_config`
/// writes): `{"backend": …, "envs": ["NAME=value", …], "hosts": [{"ssh": …, "ips": [...],
/// "rdma": [...]}, …]}`, or the list of hosts alone. Rank `r` runs on the `r`th host.
#[derive(Debug, PartialEq)]
struct Hostfile {
    hosts: Vec<Host>,
    /// The backend the file names, if any.
    backend: Option<BackendArg>,
    envs: Vec<(String, String)>,
}

impl Hostfile {
    /// Reads and checks `path`: every host's `ssh` a host (or `user@host`), its `ips` names or
    /// IPv4 addresses, its `rdma` device names; the `envs` `NAME=value` with a plain name; a
    /// backend MLX has. Errors name the file and what is wrong.
    fn read(path: &std::path::Path) -> anyhow::Result<Hostfile> {
        let text =
            perch_engine::limits::read_text_capped(path, perch_engine::limits::MAX_CONFIG_BYTES)
                .with_context(|| format!("--hostfile {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("--hostfile {}", path.display()))
    }

    fn parse(text: &str) -> anyhow::Result<Hostfile> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Entry {
            ssh: String,
            #[serde(default)]
            ips: Vec<String>,
            #[serde(default)]
            rdma: Vec<serde_json::Value>,
        }
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum File {
            Full {
                #[serde(default)]
                backend: String,
                #[serde(default)]
                envs: Vec<String>,
                hosts: Vec<Entry>,
            },
            Hosts(Vec<Entry>),
        }
        let file: File = serde_json::from_str(text).map_err(|_| {
            anyhow::anyhow!(
                "not mlx.launch's hostfile: a JSON list of hosts, or an object with \
                 \"hosts\" (each {{\"ssh\": …, \"ips\": […], \"rdma\": […]}}) and \
                 optionally \"backend\" and \"envs\""
            )
        })?;
        let (backend, envs, entries) = match file {
            File::Full {
                backend,
                envs,
                hosts,
            } => (backend, envs, hosts),
            File::Hosts(hosts) => (String::new(), Vec::new(), hosts),
        };
        let backend = match backend.as_str() {
            "" => None,
            name => Some(
                <BackendArg as clap::ValueEnum>::from_str(name, false).map_err(|_| {
                    anyhow::anyhow!(
                        "\"backend\": {name:?} is not ring, jaccl, jaccl-ring, mpi or nccl"
                    )
                })?,
            ),
        };
        let envs = envs
            .iter()
            .map(|e| {
                let named = e.split_once('=').filter(|(name, _)| {
                    !name.is_empty()
                        && !name.starts_with(|c: char| c.is_ascii_digit())
                        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                });
                let (name, value) =
                    named.with_context(|| format!("\"envs\": {e:?} is not NAME=value"))?;
                // Names the launch sets itself (JACCL's own names MLX reads before its).
                if name.starts_with("__perch_") || name.starts_with("JACCL_") {
                    bail!("\"envs\": {name} is set by the launch");
                }
                Ok((name.to_owned(), value.to_owned()))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut hosts = Vec::with_capacity(entries.len());
        for (rank, entry) in entries.into_iter().enumerate() {
            let mut host = parse_host(&entry.ssh).with_context(|| format!("host {rank}"))?;
            if let Some(ip) = entry.ips.iter().find(|ip| !is_plain(ip)) {
                bail!("host {rank}: {ip:?} is not a host name or IPv4 address");
            }
            // Each entry null, a name or a list of names (the shape is JACCL's check).
            let names = entry.rdma.iter().flat_map(|e| match e {
                serde_json::Value::Array(list) => list.iter().collect(),
                other => vec![other],
            });
            for name in names {
                match name {
                    serde_json::Value::Null => {}
                    serde_json::Value::String(name) if is_plain(name) => {}
                    other => bail!("host {rank}: {other} is not an RDMA device name"),
                }
            }
            host.ips = entry.ips;
            host.rdma = entry.rdma;
            hosts.push(host);
        }
        Ok(Hostfile {
            hosts,
            backend,
            envs,
        })
    }
}

/// Each machine of a group (`perch search --hosts` or `--hostfile`): its RAM in bytes and the
/// ranks it would run, in order of first mention (`perch_hub::hosts::group_memory`). Errors name
/// a host that is not a host name or whose memory could not be read.
pub fn group_memory(group: GroupSpec<'_>) -> anyhow::Result<Vec<(u64, usize)>> {
    hosts::group_memory(&group.read()?.hosts).map_err(anyhow::Error::msg)
}

/// The ring backend's hostfile for `hosts`: each rank's addresses ([`Host::listens_on`]) in
/// rank order, each on the next port from `starting_port` (rank `r` at `starting_port + r` when
/// each has one, as `mlx.launch` numbers them), checked as the ranks will check it
/// ([`perch_engine::distributed::check_ring_hostfile`]).
fn hostfile(hosts: &[Host], starting_port: u16) -> anyhow::Result<String> {
    let count: usize = hosts.iter().map(|h| h.listens_on().len()).sum();
    let last = usize::from(starting_port) + count - 1;
    if last > usize::from(u16::MAX) {
        bail!(
            "--starting-port {starting_port}: the ranks need ports {starting_port} to {last}, \
             within 1 to 65535"
        );
    }
    let mut port = usize::from(starting_port);
    let addresses: Vec<Vec<String>> = hosts
        .iter()
        .map(|h| {
            h.listens_on()
                .into_iter()
                .map(|ip| {
                    port += 1;
                    format!("{ip}:{}", port - 1)
                })
                .collect()
        })
        .collect();
    let json = serde_json::to_string(&addresses)?;
    // The rule every rank checks it by, here before any starts.
    if let Err(why) = perch_engine::distributed::check_ring_hostfile(&json) {
        bail!("--backend ring: the hosts' addresses ({why})");
    }
    Ok(json)
}

/// The launch's own flags, which ranks do not get (`--backend` is given to them as resolved).
const LAUNCH_FLAGS: [&str; 4] = ["--hosts", "--hostfile", "--starting-port", "--backend"];

/// This command's arguments without the launch's flags, then `--backend backend`: what every
/// rank runs.
fn rank_args(args: impl Iterator<Item = OsString>, backend: BackendArg) -> Vec<OsString> {
    let mut kept = Vec::new();
    let mut skip_value = false;
    for arg in args {
        if std::mem::take(&mut skip_value) {
            continue;
        }
        let text = arg.to_string_lossy();
        if LAUNCH_FLAGS.contains(&text.as_ref()) {
            skip_value = true;
        } else if !LAUNCH_FLAGS
            .iter()
            .any(|flag| text.starts_with(&format!("{flag}=")))
        {
            kept.push(arg);
        }
    }
    let name = clap::ValueEnum::to_possible_value(&backend).expect("every backend has a name");
    kept.extend(["--backend".into(), name.get_name().into()]);
    kept
}

/// What a rank's process is given: environment variables, and files it reads, each named by
/// a variable (on this machine a temporary file of the launcher's; on another host one the
/// rank writes there and removes once MLX has read it).
#[derive(Debug, Default, PartialEq)]
struct RankSetup {
    env: Vec<(String, String)>,
    files: Vec<(&'static str, String)>,
}

/// The command `ssh` runs for a rank on a remote host: `sh` writing each of `setup`'s files to
/// a temporary file there, then running `exe args` with the rank's environment and each file's
/// variable naming its file, in the background, and waiting for it. When the launcher ends (its
/// end of `ssh`'s standard input closes: `sshd` sends a command without a terminal no signal
/// when the client goes) or `sh` is hung up or terminated, the rank is terminated. The rank
/// removes its files once MLX has read them (`PERCH_HOSTFILE_IS_TEMPORARY=1`), and `sh` when
/// the rank ends. The script's status is the rank's.
fn remote_command(
    setup: &RankSetup,
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
    // The session's standard input, kept for the watcher below (a command run in the background
    // gets /dev/null).
    let mut script = String::from("exec 3<&0; ");
    let files: Vec<String> = (0..setup.files.len())
        .map(|i| format!("\"$__perch_f{i}\""))
        .collect();
    if !files.is_empty() {
        script.push_str(&format!("trap 'rm -f {}' EXIT; ", files.join(" ")));
    }
    for (i, (_, content)) in setup.files.iter().enumerate() {
        script.push_str(&format!(
            "__perch_f{i}=$(mktemp) && printf '%s' {} > {} || exit 1; ",
            quote(content)?,
            files[i]
        ));
    }
    for (name, value) in &setup.env {
        script.push_str(&format!("{name}={} ", quote(value)?));
    }
    for ((name, _), file) in setup.files.iter().zip(&files) {
        script.push_str(&format!("{name}={file} "));
    }
    if !files.is_empty() {
        script.push_str(&format!(
            "{}=1 ",
            perch_engine::distributed::HOSTFILE_IS_TEMPORARY
        ));
    }
    script.push_str(&quote(utf8(exe.as_os_str())?)?);
    for arg in args {
        script.push(' ');
        script.push_str(&quote(utf8(arg)?)?);
    }
    script.push_str(
        " </dev/null 3<&- & __perch_p=$!; \
         (while read -r __perch_l; do :; done <&3; kill -TERM $__perch_p) >/dev/null 2>&1 & \
         __perch_w=$!; exec 3<&-; \
         trap 'kill -TERM $__perch_p 2>/dev/null' HUP INT TERM; \
         while :; do wait $__perch_p; __perch_s=$?; kill -0 $__perch_p 2>/dev/null || break; done; \
         kill $__perch_w 2>/dev/null; exit $__perch_s",
    );
    // Through `sh`, whatever the login shell on that host.
    Ok(format!("sh -c {}", quote(&script)?))
}

/// Where the other ranks meet rank 0 (NCCL, JACCL): its first address ([`Host::listens_on`]),
/// `127.0.0.1` for this machine. Errors when that is this machine while another host is not:
/// the others could not reach it.
fn meeting_address(hosts: &[Host], backend: &str) -> anyhow::Result<String> {
    let first = hosts[0].listens_on()[0];
    match is_local(first) {
        true if !hosts.iter().all(|h| is_local(&h.address)) => bail!(
            "--backend {backend}: rank 0 is reached at {first:?}, which the other hosts cannot \
             reach: name it by an address they reach"
        ),
        true => Ok("127.0.0.1".to_owned()),
        false => Ok(first.to_owned()),
    }
}

/// Each rank's setup for JACCL (as `mlx.launch` sets it): `MLX_RANK`, `MLX_JACCL_COORDINATOR`
/// (rank 0's address and `port`), `MLX_IBV_DEVICES`, a file of every host's `rdma` list, and with
/// `ring` `MLX_JACCL_RING=1` (a ring preferred to a mesh). Errors when the lists do not form a
/// mesh or a ring as MLX reads them ([`perch_engine::distributed::check_jaccl_devices`]).
fn jaccl_setups(hosts: &[Host], port: u16, ring: bool) -> anyhow::Result<Vec<RankSetup>> {
    let devices: Vec<&Vec<serde_json::Value>> = hosts.iter().map(|h| &h.rdma).collect();
    let devices = serde_json::to_string(&devices)?;
    if let Err(why) = perch_engine::distributed::check_jaccl_devices(&devices) {
        bail!(
            "--backend jaccl: the hosts' \"rdma\" lists ({why}; mlx.distributed_config writes \
             them)"
        );
    }
    let coordinator = format!("{}:{port}", meeting_address(hosts, "jaccl")?);
    Ok((0..hosts.len())
        .map(|rank| {
            let mut env = vec![
                ("MLX_RANK".into(), rank.to_string()),
                ("MLX_JACCL_COORDINATOR".into(), coordinator.clone()),
            ];
            if ring {
                env.push(("MLX_JACCL_RING".into(), "1".into()));
            }
            RankSetup {
                env,
                files: vec![("MLX_IBV_DEVICES", devices.clone())],
            }
        })
        .collect())
}

/// Each rank's environment for NCCL (`hosts` rank 0 first): `MLX_RANK`, `MLX_WORLD_SIZE`,
/// `NCCL_HOST_IP` and `NCCL_PORT` (where the ranks meet: rank 0's address, `127.0.0.1` for this
/// machine, and `port`), `CUDA_VISIBLE_DEVICES` (the rank's GPU: the ranks of one machine take
/// its GPUs in order, on this machine from the devices `visible` lists when it is set), and on a
/// group of this machine alone `NCCL_SOCKET_IFNAME=lo` (the loopback; unless this process has
/// the variable, which its ranks then inherit). Errors when rank
/// 0 is named as this machine while another host is not (the others could not reach it), and
/// when this machine's ranks would share a GPU (NCCL refuses two ranks of one device): more
/// ranks than the devices `visible` lists, one listed twice, or more than its `gpus` (when
/// known, and `visible` is not set).
fn nccl_setups(
    hosts: &[Host],
    port: u16,
    visible: Option<&str>,
    gpus: Option<usize>,
) -> anyhow::Result<Vec<RankSetup>> {
    let meet = meeting_address(hosts, "nccl")?;
    let visible: Vec<&str> = visible
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let local_ranks = hosts.iter().filter(|h| is_local(&h.address)).count();
    let all_local = local_ranks == hosts.len();
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
    let mut setups = Vec::with_capacity(hosts.len());
    for (rank, host) in hosts.iter().enumerate() {
        let index = hosts[..rank]
            .iter()
            .filter(|h| h.same_machine(host))
            .count();
        let device = match (is_local(&host.address), visible.get(index)) {
            (true, Some(device)) => (*device).to_owned(),
            (true, None) if !visible.is_empty() => bail!(
                "--backend nccl: {local_ranks} ranks on this machine, but CUDA_VISIBLE_DEVICES \
                 lists {} devices",
                visible.len()
            ),
            _ => index.to_string(),
        };
        let mut env: Vec<(String, String)> = vec![
            ("MLX_RANK".into(), rank.to_string()),
            ("MLX_WORLD_SIZE".into(), hosts.len().to_string()),
            ("NCCL_HOST_IP".into(), meet.clone()),
            ("NCCL_PORT".into(), port.to_string()),
            ("CUDA_VISIBLE_DEVICES".into(), device),
        ];
        if all_local && std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
            env.push(("NCCL_SOCKET_IFNAME".into(), "lo".into()));
        }
        setups.push(RankSetup {
            env,
            files: Vec::new(),
        });
    }
    Ok(setups)
}

/// This machine's NVIDIA GPUs as `nvidia-smi -L` lists them; `None` without `nvidia-smi`.
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

/// The group `--hosts` or `--hostfile` names.
pub enum GroupSpec<'a> {
    /// `--hosts`: a host a rank, rank 0 first.
    List(&'a [String]),
    /// `--hostfile`: mlx.launch's hostfile ([`Hostfile`]).
    File(&'a std::path::Path),
}

impl<'a> GroupSpec<'a> {
    /// The group a command names: its `--hostfile` when given, else its `--hosts`.
    pub fn new(hostfile: Option<&'a std::path::Path>, hosts: &'a [String]) -> Self {
        match hostfile {
            Some(path) => GroupSpec::File(path),
            None => GroupSpec::List(hosts),
        }
    }
}

impl GroupSpec<'_> {
    /// The group's hosts (rank 0 first), the backend its hostfile names, and the variables
    /// it sets for every rank (a `--hosts` list as a hostfile of no backend or variables).
    fn read(&self) -> anyhow::Result<Hostfile> {
        Ok(match self {
            GroupSpec::List(hosts) => Hostfile {
                hosts: hosts
                    .iter()
                    .map(|h| parse_host(h))
                    .collect::<anyhow::Result<Vec<_>>>()?,
                backend: None,
                envs: Vec::new(),
            },
            GroupSpec::File(path) => Hostfile::read(path)?,
        })
    }
}

/// Starts one rank a host of `group` (rank 0 first) running this command on `backend` (else
/// the hostfile's, else ring), relays rank 0's output, and waits for them all; the first that
/// fails ends the others and is the error.
pub fn launch(
    group: GroupSpec<'_>,
    starting_port: u16,
    backend: Option<BackendArg>,
) -> anyhow::Result<()> {
    let Hostfile {
        hosts,
        backend: file_backend,
        envs,
    } = group.read()?;
    let backend = backend.or(file_backend).unwrap_or(BackendArg::Ring);
    if hosts.len() < 2 {
        bail!("a group needs two hosts or more (a host may be named twice)");
    }
    if starting_port == 0 {
        bail!(
            "--starting-port 0: the ranks listen (ring) or meet (JACCL, NCCL) from that port on, \
             1 to 65535"
        );
    }
    let mut setups = match backend {
        BackendArg::Ring => {
            let json = hostfile(&hosts, starting_port)?;
            (0..hosts.len())
                .map(|rank| RankSetup {
                    env: vec![("MLX_RANK".into(), rank.to_string())],
                    files: vec![("MLX_HOSTFILE", json.clone())],
                })
                .collect()
        }
        BackendArg::Nccl => {
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
            nccl_setups(&hosts, starting_port, visible.as_deref(), local_gpus())?
        }
        BackendArg::Jaccl => jaccl_setups(&hosts, starting_port, false)?,
        BackendArg::JacclRing => jaccl_setups(&hosts, starting_port, true)?,
        BackendArg::Mpi => bail!(
            "--hosts and --hostfile start ranks of the ring, JACCL and NCCL backends; start MPI's \
             ranks with its launcher (mpirun)"
        ),
    };
    // The hostfile's variables first, as mlx.launch sets them: the backend's own win. This
    // machine's stall and load limits go to every rank (remote ones get no other environment).
    use perch_engine::distributed::{LOAD_LIMIT_ENV, STALL_LIMIT_ENV};
    let limits: Vec<(String, String)> = [STALL_LIMIT_ENV, LOAD_LIMIT_ENV]
        .into_iter()
        .filter_map(|name| std::env::var(name).ok().map(|v| (name.to_owned(), v)))
        .collect();
    for setup in &mut setups {
        setup
            .env
            .splice(0..0, envs.iter().cloned().chain(limits.iter().cloned()));
    }
    let exe = std::env::current_exe().context("finding this perch executable")?;
    let args = rank_args(std::env::args_os().skip(1), backend);
    let stopped = on_stop_signals();
    let mut relay = StderrRelay::new();
    // This machine's ranks' files, removed when the launch ends.
    let mut temporary = Vec::new();
    // Every rank's command is made (and this machine's files written) before any starts, so
    // that a failure here leaves no rank running.
    let mut commands = Vec::with_capacity(hosts.len());
    for ((rank, host), setup) in hosts.iter().enumerate().zip(&setups) {
        let mut command = if is_local(&host.address) {
            let mut command = Command::new(&exe);
            command
                .args(&args)
                .envs(setup.env.iter().map(|(k, v)| (k, v)));
            for (name, content) in &setup.files {
                let mut file = tempfile::NamedTempFile::new()
                    .and_then(|mut f| f.write_all(content.as_bytes()).map(|_| f))
                    .with_context(|| format!("writing rank {rank}'s {name}"))?;
                file.flush()?;
                command.env(name, file.path());
                temporary.push(file);
            }
            command.stdin(Stdio::null());
            command
        } else {
            let mut command = Command::new("ssh");
            command.args(SSH_OPTIONS).arg(&host.login);
            command.arg(remote_command(setup, &exe, &args)?);
            // Held open until the rank is ended or waited for ([`end`], `Child::wait` closes
            // it): the remote `sh` ends its rank when it closes.
            command.stdin(Stdio::piped());
            command
        };
        command.stderr(Stdio::piped());
        if rank > 0 {
            command.stdout(Stdio::null());
        }
        commands.push(command);
    }
    let mut ranks: Vec<(Child, &Host)> = Vec::with_capacity(hosts.len());
    for (rank, (mut command, host)) in commands.into_iter().zip(&hosts).enumerate() {
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
                    let host = ranks[rank].1;
                    let (login, remote) = (host.login.clone(), !is_local(&host.address));
                    end(&mut ranks, relay);
                    // `ssh`'s own failures (a host it cannot reach, a login refused, a
                    // connection lost) exit 255; Perch's ranks never do.
                    if remote && status.code() == Some(SSH_FAILED) {
                        bail!(
                            "rank {rank}: ssh to {login} failed with status {SSH_FAILED} (the host \
                             unreachable, the login refused or the connection lost): the group stopped"
                        );
                    }
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

    fn parse_all(hosts: &[&str]) -> Vec<Host> {
        hosts.iter().map(|h| parse_host(h).unwrap()).collect()
    }

    fn get(setup: &RankSetup, name: &str) -> Option<String> {
        setup
            .env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    /// `--hosts` read as a group: bad names refused, saying it is `--hosts` (the machines and
    /// their memory: `perch_hub::hosts`' tests).
    #[test]
    fn bad_hosts_are_refused_as_hosts() {
        for bad in ["-oProxyCommand=x y", "-v", "a;b"] {
            let hosts = ["127.0.0.1".to_owned(), bad.to_owned()];
            let refused = group_memory(GroupSpec::List(&hosts)).unwrap_err();
            assert!(
                refused.to_string().contains("--hosts: \"")
                    && refused.to_string().contains("is not a host name"),
                "{bad}: {refused}"
            );
        }
    }

    #[test]
    fn hosts_become_a_ring_hostfile() {
        let mut hosts = parse_all(&["127.0.0.1", "me@studio.local", "10.0.0.2"]);
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
        // A hostfile's addresses (two a host here): every one on the next port.
        for (i, host) in hosts.iter_mut().enumerate() {
            host.ips = vec![format!("10.0.1.{i}"), format!("10.0.2.{i}")];
        }
        assert_eq!(
            hostfile(&hosts, 5000).unwrap(),
            r#"[["10.0.1.0:5000","10.0.2.0:5001"],["10.0.1.1:5002","10.0.2.1:5003"],["10.0.1.2:5004","10.0.2.2:5005"]]"#
        );
    }

    /// mlx.launch's hostfile, as an object or a list of hosts; what is wrong in it is named.
    #[test]
    fn hostfiles_read_as_mlx_launch_writes_them() {
        let file = Hostfile::parse(
            r#"{"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=1"], "hosts": [
                {"ssh": "me@m1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]},
                {"ssh": "m2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", null]}]}"#,
        )
        .unwrap();
        assert_eq!(file.backend, Some(BackendArg::Jaccl));
        assert_eq!(
            file.envs,
            [("MLX_METAL_FAST_SYNCH".to_owned(), "1".to_owned())]
        );
        assert_eq!(file.hosts[0].login, "me@m1");
        assert_eq!(file.hosts[0].address, "m1");
        assert_eq!(file.hosts[1].listens_on(), ["10.0.0.2"]);
        assert_eq!(
            file.hosts[1].rdma,
            [serde_json::json!("rdma_en3"), serde_json::Value::Null]
        );
        // mlx.distributed_config's ring of Macs: "jaccl-ring", several cables a neighbour.
        let ring = Hostfile::parse(
            r#"{"backend": "jaccl-ring", "hosts": [
                {"ssh": "m1", "rdma": [null, ["rdma_en3", "rdma_en4"]]},
                {"ssh": "m2", "rdma": [["rdma_en3", "rdma_en4"], null]}]}"#,
        )
        .unwrap();
        assert_eq!(ring.backend, Some(BackendArg::JacclRing));
        let list = Hostfile::parse(r#"[{"ssh": "a"}, {"ssh": "b", "ips": []}]"#).unwrap();
        assert_eq!(list.backend, None);
        assert_eq!(list.hosts[1].listens_on(), ["b"]);
        for (text, expected) in [
            ("{}", "not mlx.launch's hostfile"),
            (r#"[{"ssh": "a", "port": 1}]"#, "not mlx.launch's hostfile"),
            (r#"{"backend": "tcp", "hosts": []}"#, "\"tcp\" is not ring"),
            (
                r#"[{"ssh": "a", "rdma": [null, 3]}]"#,
                "3 is not an RDMA device",
            ),
            (
                r#"[{"ssh": "a", "rdma": [null, ["x", "a b"]]}]"#,
                "is not an RDMA device",
            ),
            (
                r#"{"envs": ["1X=2"], "hosts": []}"#,
                "\"1X=2\" is not NAME=value",
            ),
            (r#"{"envs": ["NOVALUE"], "hosts": []}"#, "is not NAME=value"),
            (
                r#"{"envs": ["__perch_f0=/x"], "hosts": []}"#,
                "set by the launch",
            ),
            (
                r#"{"envs": ["JACCL_RANK=0"], "hosts": []}"#,
                "set by the launch",
            ),
            (r#"[{"ssh": "a;b"}]"#, "host 0"),
            (
                r#"[{"ssh": "a", "ips": ["1.2.3.4 x"]}]"#,
                "is not a host name",
            ),
            (
                r#"[{"ssh": "a", "rdma": [null, "$(x)"]}]"#,
                "not an RDMA device",
            ),
        ] {
            let error = format!("{:#}", Hostfile::parse(text).unwrap_err());
            assert!(error.contains(expected), "{text}: {error}");
        }
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
            "--backend",
            "ring",
            "--hostfile=h.json",
            "--json",
        ];
        let kept = rank_args(args.iter().map(OsString::from), BackendArg::Jaccl);
        assert_eq!(
            kept,
            ["generate", "--prompt", "Hi", "--json", "--backend", "jaccl"]
        );
        let exe = std::path::Path::new("/opt/perch dir/perch");
        let setup = RankSetup {
            env: vec![("MLX_RANK".into(), "1".into())],
            files: vec![("MLX_HOSTFILE", r#"[["a:1"],["b:2"]]"#.into())],
        };
        let command = remote_command(&setup, exe, &kept[..4]).unwrap();
        let script = shlex::split(command.strip_prefix("sh -c ").unwrap()).unwrap();
        assert_eq!(script.len(), 1);
        let script = &script[0];
        for part in [
            "exec 3<&0; trap 'rm -f \"$__perch_f0\"' EXIT; __perch_f0=$(mktemp) && printf '%s' \
             '[[\"a:1\"],[\"b:2\"]]' > \"$__perch_f0\" || exit 1; MLX_RANK=1 \
             MLX_HOSTFILE=\"$__perch_f0\" PERCH_HOSTFILE_IS_TEMPORARY=1 '/opt/perch dir/perch' \
             generate --prompt Hi --json </dev/null 3<&- & __perch_p=$!;",
            "done <&3; kill -TERM $__perch_p)",
            "exit $__perch_s",
        ] {
            assert!(script.contains(part), "{part}\nnot in\n{script}");
        }
        // NCCL: the environment alone, no file.
        let setup = RankSetup {
            env: vec![
                ("MLX_RANK".into(), "1".into()),
                ("NCCL_HOST_IP".into(), "10.0.0.1".into()),
            ],
            files: Vec::new(),
        };
        let command = remote_command(&setup, exe, &kept[..4]).unwrap();
        let script = &shlex::split(command.strip_prefix("sh -c ").unwrap()).unwrap()[0];
        assert!(
            script.starts_with(
                "exec 3<&0; MLX_RANK=1 NCCL_HOST_IP=10.0.0.1 '/opt/perch dir/perch' generate"
            ),
            "{script}"
        );
        assert!(!script.contains("trap 'rm"), "{script}");
    }

    /// The script `ssh` runs, run here by `sh`: the rank's status is the script's, its files are
    /// gone when it ends, and when the launcher's end of standard input closes the rank is
    /// terminated.
    #[test]
    fn a_remote_rank_s_script_cleans_up_and_ends_with_its_launcher() {
        let dir = tempfile::tempdir().unwrap();
        let rank = dir.path().join("rank.sh");
        // A stand-in rank: notes the file it was given, then exits 3 or sleeps.
        std::fs::write(
            &rank,
            "#!/bin/sh\necho \"$MLX_HOSTFILE\" > \"$1\"\n[ \"$2\" = sleep ] && exec sleep 30\nexit 3\n",
        )
        .unwrap();
        std::fs::set_permissions(&rank, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let noted = dir.path().join("noted");
        let setup = RankSetup {
            env: vec![("MLX_RANK".into(), "1".into())],
            files: vec![("MLX_HOSTFILE", "[]".into())],
        };
        let run = |how: &str| {
            let args = [noted.clone().into_os_string(), how.into()];
            let script = remote_command(&setup, &rank, &args).unwrap();
            let script = shlex::split(script.strip_prefix("sh -c ").unwrap()).unwrap();
            Command::new("sh")
                .arg("-c")
                .arg(&script[0])
                .stdin(Stdio::piped())
                .env("TMPDIR", dir.path())
                .spawn()
                .unwrap()
        };
        // Its standard input held open meanwhile, as the launcher holds it (`Child::wait`
        // would close it first).
        let mut exiting = run("exit");
        let exited = loop {
            if let Some(status) = exiting.try_wait().unwrap() {
                break status;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(exited.code(), Some(3));
        let file = std::fs::read_to_string(&noted).unwrap();
        assert!(
            file.trim().starts_with(&dir.path().display().to_string()),
            "{file}"
        );
        assert!(
            !std::path::Path::new(file.trim()).exists(),
            "the rank's file removed"
        );
        // Standard input closed (the launcher gone): the sleeping rank is terminated.
        let mut sleeping = run("sleep");
        while !noted.exists() || std::fs::read_to_string(&noted).unwrap().is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let start = Instant::now();
        drop(sleeping.stdin.take());
        let ended = sleeping.wait().unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "ended within seconds"
        );
        assert!(!ended.success(), "{ended:?}");
        let file = std::fs::read_to_string(&noted).unwrap();
        assert!(
            !std::path::Path::new(file.trim()).exists(),
            "the rank's file removed"
        );
    }

    /// NCCL's ranks meet at rank 0's address and the starting port; the ranks of a machine take
    /// its GPUs in order (here, from the devices this process may see); rank 0 named as this
    /// machine while another host is elsewhere is refused, and so are ranks sharing a GPU.
    #[test]
    fn nccl_ranks_get_their_rendezvous_and_gpu() {
        let one_machine =
            nccl_setups(&parse_all(&["localhost", "127.0.0.1"]), 6000, None, Some(2)).unwrap();
        for (rank, setup) in one_machine.iter().enumerate() {
            assert_eq!(get(setup, "MLX_RANK").unwrap(), rank.to_string());
            assert_eq!(get(setup, "MLX_WORLD_SIZE").unwrap(), "2");
            assert_eq!(get(setup, "NCCL_HOST_IP").unwrap(), "127.0.0.1");
            assert_eq!(get(setup, "NCCL_PORT").unwrap(), "6000");
            assert_eq!(
                get(setup, "CUDA_VISIBLE_DEVICES").unwrap(),
                rank.to_string()
            );
            assert_eq!(get(setup, "NCCL_SOCKET_IFNAME").unwrap(), "lo");
            assert!(setup.files.is_empty());
        }
        let two_local = parse_all(&["127.0.0.1", "127.0.0.1"]);
        let visible = nccl_setups(&two_local, 6000, Some("2, 5"), Some(1)).unwrap();
        assert_eq!(get(&visible[0], "CUDA_VISIBLE_DEVICES").unwrap(), "2");
        assert_eq!(get(&visible[1], "CUDA_VISIBLE_DEVICES").unwrap(), "5");
        let short = nccl_setups(&two_local, 6000, Some("3"), None).unwrap_err();
        assert!(short.to_string().contains("lists 1 devices"), "{short}");
        // Two machines of two GPUs each: each machine's ranks count its GPUs from 0.
        let two = nccl_setups(
            &parse_all(&["a@gpu1", "gpu2", "gpu1", "gpu2"]),
            7000,
            Some("9"),
            Some(1),
        )
        .unwrap();
        let devices: Vec<String> = two
            .iter()
            .map(|s| get(s, "CUDA_VISIBLE_DEVICES").unwrap())
            .collect();
        assert_eq!(devices, ["0", "0", "1", "1"]);
        for setup in &two {
            assert_eq!(get(setup, "NCCL_HOST_IP").unwrap(), "gpu1");
            assert_eq!(get(setup, "NCCL_SOCKET_IFNAME"), None);
        }
        let unreachable =
            nccl_setups(&parse_all(&["127.0.0.1", "gpu2"]), 7000, None, None).unwrap_err();
        assert!(
            unreachable.to_string().contains("cannot reach"),
            "{unreachable}"
        );
        let one_gpu = nccl_setups(&two_local, 6000, None, Some(1)).unwrap_err();
        assert!(
            one_gpu.to_string().contains("which has 1 GPU(s)"),
            "{one_gpu}"
        );
        let twice = nccl_setups(&two_local, 6000, Some("0,0"), Some(2)).unwrap_err();
        assert!(twice.to_string().contains("device 0 twice"), "{twice}");
        assert!(
            nccl_setups(&two_local, 6000, None, None).is_ok(),
            "GPUs unknown"
        );
    }

    /// JACCL's ranks get rank 0's address and port as the coordinator, the hostfile's device
    /// lists as one file (and `jaccl-ring` a ring preferred); lists that form neither a mesh nor
    /// a ring are refused.
    #[test]
    fn jaccl_ranks_get_their_coordinator_and_devices() {
        let file = Hostfile::parse(
            r#"[{"ssh": "m1", "ips": ["10.0.0.1"], "rdma": [null, "rdma_en3"]},
                {"ssh": "m2", "rdma": [["rdma_en4", "rdma_en5"], null]}]"#,
        )
        .unwrap();
        let setups = jaccl_setups(&file.hosts, 5000, false).unwrap();
        for (rank, setup) in setups.iter().enumerate() {
            assert_eq!(get(setup, "MLX_RANK").unwrap(), rank.to_string());
            assert_eq!(
                get(setup, "MLX_JACCL_COORDINATOR").unwrap(),
                "10.0.0.1:5000"
            );
            assert_eq!(get(setup, "MLX_JACCL_RING"), None);
            assert_eq!(
                setup.files,
                [(
                    "MLX_IBV_DEVICES",
                    r#"[[null,"rdma_en3"],[["rdma_en4","rdma_en5"],null]]"#.to_owned()
                )]
            );
        }
        let ring = jaccl_setups(&file.hosts, 5000, true).unwrap();
        assert_eq!(get(&ring[1], "MLX_JACCL_RING").unwrap(), "1");
        for bad in [
            r#"[{"ssh": "m1", "rdma": [null]}, {"ssh": "m2", "rdma": ["r", null]}]"#,
            r#"[{"ssh": "m1", "rdma": [null, null]}, {"ssh": "m2", "rdma": [null, null]}]"#,
            r#"[{"ssh": "m1"}, {"ssh": "m2"}]"#,
        ] {
            let hosts = Hostfile::parse(bad).unwrap().hosts;
            let error = jaccl_setups(&hosts, 5000, false).unwrap_err().to_string();
            assert!(error.contains("\"rdma\" lists"), "{bad}: {error}");
        }
    }

    /// A ring hostfile whose hosts list different numbers of addresses is refused here, by the
    /// ranks' own rule.
    #[test]
    fn ring_hosts_list_as_many_addresses() {
        let file =
            Hostfile::parse(r#"[{"ssh": "a", "ips": ["1.1.1.1", "1.1.1.2"]}, {"ssh": "b"}]"#)
                .unwrap();
        let error = hostfile(&file.hosts, 5000).unwrap_err().to_string();
        assert!(
            error.contains("rank 1 lists 1 addresses and rank 0 2"),
            "{error}"
        );
    }
}
