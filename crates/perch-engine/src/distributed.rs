//! Groups of processes that compute together over MLX's distributed backends (mlx-c's
//! `mlx_distributed_*`, which mlx-rs 0.33 does not wrap): ring (TCP; what `mlx.launch
//! --backend ring` starts), JACCL (Thunderbolt RDMA between Macs), MPI and NCCL (CUDA).
//!
//! A process joins its group with [`init`], configured as `mlx.launch` configures each rank: for
//! the ring backend `MLX_RANK` (this process's rank) and `MLX_HOSTFILE`, a JSON file listing each
//! rank's `"ip:port"` addresses in rank order (`[["127.0.0.1:5000"], ["127.0.0.1:5001"]]`).
//! Collectives ([`Group::all_sum`], [`Group::all_gather`]) are lazy MLX operations like any other:
//! they run, and fail, when their result is evaluated.
//!
//! Faults end in errors, not hangs, where MLX allows it: a peer that never connects is an error
//! after [`init`]'s deadline (MLX's ring backend waits for it without a timeout), and a peer that
//! dies makes the next collective fail (MLX: "connection to a peer was lost"). A peer that is
//! alive but stuck still blocks a collective: the batch engine and [`crate::generate`] over
//! ranks run under a [`Watchdog`], which ends the process when the group makes no progress. A
//! process that joined a group ends with [`exit_now`].

use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

use mlx_rs::{Array, Dtype, Stream};

use crate::error::{EngineError, Result};

/// The environment variable setting [`stall_limit`] in seconds.
pub const STALL_LIMIT_ENV: &str = "PERCH_GROUP_STALL_SECS";

/// How long a rank goes without progress before it counts the group stalled ([`Watchdog`]):
/// `PERCH_GROUP_STALL_SECS` when it is a number of seconds (at least 1 s), else 300 s, more
/// than a long prompt pass of a large model or a warm-up shape's first compilation takes.
pub fn stall_limit() -> Duration {
    limit_from_env(STALL_LIMIT_ENV, Duration::from_secs(300))
}

/// The environment variable setting [`load_limit`] in seconds.
pub const LOAD_LIMIT_ENV: &str = "PERCH_GROUP_LOAD_SECS";

/// How long a rank waits for the others where the ranks meet while loading
/// ([`crate::models::load_divided`]: comparing their copies of the model before reading it, and
/// once every rank has loaded its part): `PERCH_GROUP_LOAD_SECS` when it is a number of seconds
/// (at least 1 s), else 1,800 s. A wait covers how much longer the slowest rank takes, so the
/// limit allows a slower disk on one host; past it the waiting rank ends ([`Watchdog`]).
pub fn load_limit() -> Duration {
    limit_from_env(LOAD_LIMIT_ENV, Duration::from_secs(1800))
}

/// `name`'s value as seconds (at least 1 s), or `default` when it is unset or not a number.
fn limit_from_env(name: &str, default: Duration) -> Duration {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .map_or(default, |d| d.max(Duration::from_secs(1)))
}

/// The exit status of a rank ended by its [`Watchdog`].
pub const STALLED_EXIT_CODE: i32 = 75;

/// Milliseconds since [`progress_epoch`] at this process's last progress ([`note_progress`]).
static LAST_PROGRESS_MS: AtomicU64 = AtomicU64::new(0);

fn progress_epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Records that this rank's group made progress: a call exchanged between the ranks, a pass or
/// token computed, a warm-up shape built. One atomic load in a process that joined no group
/// ([`joined`]: a single process's decode loop calls it too); else one atomic store.
pub fn note_progress() {
    if !joined() {
        return;
    }
    let now = progress_epoch().elapsed().as_millis().min(u64::MAX as u128) as u64;
    LAST_PROGRESS_MS.store(now, Ordering::Relaxed);
}

/// Ends this rank's process when its group makes no progress ([`note_progress`]) for
/// [`stall_limit`]: MLX's collectives never time out, so a rank that is alive but stuck
/// (paused, spinning, its host frozen) would leave the others blocked in a collective for ever.
/// The batch engine notes every call exchanged between the ranks (`engine::batch::lockstep`,
/// where an idle rank 0 still calls the others now and then) and every warm-up shape,
/// [`crate::generate`] every token and prompt chunk. Past the limit the rank says why on its
/// standard error and ends at once with [`STALLED_EXIT_CODE`] ([`exit_now`]); the ranks still
/// answering then lose their peer (MLX's error), and a launch (`perch serve --hosts`) stops
/// the group when a rank exits. Dropping or [`Watchdog::disarm`]ing it ends the watch.
pub struct Watchdog {
    armed: Arc<AtomicBool>,
}

/// What a [`Watchdog`] watches, for its message.
#[derive(Clone, Copy)]
enum Watched {
    /// The group computing: its limit is [`stall_limit`].
    Progress,
    /// The ranks meeting while loading: its limit is [`load_limit`].
    Loading,
}

impl Watchdog {
    /// Watches the group's progress from now.
    pub fn start(rank: usize, limit: Duration) -> Self {
        Self::watching(rank, limit, Watched::Progress)
    }

    /// Watches a meeting of the ranks while they load their parts (nothing notes progress
    /// meanwhile, so the limit counts from now): past `limit` this rank ends as
    /// [`Watchdog::start`]'s does, saying the other ranks did not get there.
    pub fn waiting_while_loading(rank: usize, limit: Duration) -> Self {
        Self::watching(rank, limit, Watched::Loading)
    }

    fn watching(rank: usize, limit: Duration, kind: Watched) -> Self {
        note_progress();
        let armed = Arc::new(AtomicBool::new(true));
        let watched = Arc::downgrade(&armed);
        let poll = (limit / 8).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let spawned = std::thread::Builder::new()
            .name("perch-group-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(poll);
                match watched.upgrade() {
                    Some(armed) if armed.load(Ordering::Relaxed) => {}
                    _ => return,
                }
                let last = Duration::from_millis(LAST_PROGRESS_MS.load(Ordering::Relaxed));
                let idle = progress_epoch().elapsed().saturating_sub(last);
                if idle > limit {
                    let (what, env) = match kind {
                        Watched::Progress => (
                            "the ranks dividing the model made no progress for",
                            STALL_LIMIT_ENV,
                        ),
                        Watched::Loading => (
                            "the ranks loading the model did not all reach this point in",
                            LOAD_LIMIT_ENV,
                        ),
                    };
                    eprintln!(
                        "perch: rank {rank}: {what} {:.0} s (a rank stopped answering: paused, \
                         stuck, its host frozen or its engine gone); ending this rank so that \
                         the others stop too (the limit: {env}, {:.0} s)",
                        idle.as_secs_f64(),
                        limit.as_secs_f64()
                    );
                    // Not `exit_now`: the main thread, blocked in a collective, may hold
                    // standard output's lock (`perch generate` writes tokens under it), and
                    // flushing would wait on it for ever. Standard error is unbuffered.
                    exit_at_once(STALLED_EXIT_CODE);
                }
            });
        if let Err(e) = spawned {
            eprintln!("perch: rank {rank}: no watchdog for the group ({e})");
        }
        Self { armed }
    }

    /// No more watching (a group stopped by an error, which this rank no longer waits on).
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Relaxed);
    }
}

/// Whether this process joined a group ([`init`]).
static JOINED: AtomicBool = AtomicBool::new(false);

/// Whether this process joined a group: it should then end with [`exit_now`].
pub fn joined() -> bool {
    JOINED.load(Ordering::Relaxed)
}

/// Ends the process at once with `code`, its standard streams flushed, without running exit
/// handlers: MLX keeps every group it starts until exit, when its destructors run, and the
/// ring backend's joins worker threads that a collective stuck on a lost or stopped peer
/// blocks for ever, so a plain exit could hang after the rank's error was reported.
pub fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    exit_at_once(code)
}

/// [`exit_now`] without flushing standard output (a [`Watchdog`]'s end: another thread may hold
/// its lock while it waits in a collective).
fn exit_at_once(code: i32) -> ! {
    #[cfg(any(all(target_os = "linux", target_env = "gnu"), target_os = "macos"))]
    // SAFETY: `_exit` ends the process; nothing runs after it.
    unsafe {
        libc::_exit(code)
    }
    #[cfg(not(any(all(target_os = "linux", target_env = "gnu"), target_os = "macos")))]
    std::process::exit(code)
}

/// An MLX distributed backend, by the name MLX gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// TCP between the hosts of `MLX_HOSTFILE` (every MLX build has it).
    Ring,
    /// RDMA over Thunderbolt between Macs.
    Jaccl,
    Mpi,
    /// NVIDIA's collectives, between CUDA devices.
    Nccl,
}

impl Backend {
    pub fn mlx_name(self) -> &'static str {
        match self {
            Backend::Ring => "ring",
            Backend::Jaccl => "jaccl",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }

    /// The stream a collective of this backend runs on: NCCL's on the GPU, the others' on the
    /// CPU (MLX's GPU backends have no ring, JACCL or MPI kernels; MLX picks the same streams
    /// when a caller names none).
    fn stream(self) -> Stream {
        match self {
            Backend::Nccl => Stream::gpu(),
            Backend::Ring | Backend::Jaccl | Backend::Mpi => Stream::cpu(),
        }
    }

    /// Whether the MLX Perch links was built with this backend.
    pub fn is_available(self) -> bool {
        let name = CString::new(self.mlx_name()).expect("no NUL in a backend name");
        // SAFETY: a plain query taking a NUL-terminated string MLX does not keep.
        unsafe { mlx_sys::mlx_distributed_is_available(name.as_ptr()) }
    }
}

/// This process's group: its rank among `size` processes.
pub struct Group {
    raw: mlx_sys::mlx_distributed_group,
    backend: Backend,
    rank: usize,
    size: usize,
}

// SAFETY: the handle is a reference-counted MLX group that any thread may use; Perch uses a group
// from one thread at a time (the engine thread's).
unsafe impl Send for Group {}
// SAFETY: a group's handle does not change after `init` (its rank and size are read once); the
// collectives it makes are lazy operations, issued by the one thread that steps the model.
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: the handle came from `mlx_distributed_init` and is freed once (MLX keeps the
        // group itself until the process exits: see `exit_now`).
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.raw);
        }
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

/// The variable that, set to `1` beside `MLX_HOSTFILE` (ring) or `MLX_IBV_DEVICES` (JACCL), has
/// [`init`] remove that file once MLX has read it, or when it fails before (a temporary copy the
/// launcher wrote for this rank on a remote host).
pub const HOSTFILE_IS_TEMPORARY: &str = "PERCH_HOSTFILE_IS_TEMPORARY";

/// The words every rank sends with a broadcast from rank 0
/// ([`Group::broadcast_bytes_gathering`]): what the batch over ranks learns of each rank at
/// each call (its batch's digest and its memory).
pub const GATHERED_WORDS: usize = 4;

/// Joins this process's group on `backend`, configured from the environment as `mlx.launch`
/// configures each rank (see the module docs). Errors when the backend is not in this build of
/// MLX, when it is not configured (a group of one process is not a distributed run: MLX's
/// non-strict fallback is refused), and when every rank has not connected within `deadline`.
/// On that last error the attempt goes on in the background; the process should exit.
pub fn init(backend: Backend, deadline: Duration) -> Result<Group> {
    // A launcher's temporary files for this rank go once MLX has read them, which it does as it
    // starts, before it connects (or when this returns early).
    struct Temporary(Option<std::ffi::OsString>);
    impl Drop for Temporary {
        fn drop(&mut self) {
            if let Some(path) = self.0.take() {
                let _ = std::fs::remove_file(path);
            }
        }
    }
    let temporary = Temporary(match std::env::var(HOSTFILE_IS_TEMPORARY).as_deref() {
        Ok("1") => match backend {
            Backend::Ring => std::env::var_os("MLX_HOSTFILE"),
            Backend::Jaccl => std::env::var_os("MLX_IBV_DEVICES"),
            Backend::Nccl | Backend::Mpi => None,
        },
        _ => None,
    });
    let var = |name: &str| std::env::var(name).ok();
    match backend {
        Backend::Ring => {
            check_ring_environment(
                var("MLX_RANK").as_deref(),
                std::env::var_os("MLX_HOSTFILE").map(std::path::PathBuf::from),
            )?;
        }
        Backend::Nccl => {
            check_nccl_environment(
                var("MLX_RANK").as_deref(),
                var("MLX_WORLD_SIZE").as_deref(),
                var("NCCL_HOST_IP").as_deref(),
                var("NCCL_PORT").as_deref(),
            )?;
        }
        Backend::Jaccl => {
            // MLX reads JACCL's own names first.
            let either = |first: &str, then: &str| var(first).or_else(|| var(then));
            check_jaccl_environment(
                either("JACCL_RANK", "MLX_RANK").as_deref(),
                either("JACCL_IBV_DEVICES", "MLX_IBV_DEVICES").map(std::path::PathBuf::from),
                either("JACCL_COORDINATOR", "MLX_JACCL_COORDINATOR").as_deref(),
            )?;
        }
        Backend::Mpi => {}
    }
    // After the environment, so that a launcher's environment is checked on any build.
    if !backend.is_available() {
        return Err(EngineError::Distributed(format!(
            "this build of MLX has no {} backend",
            backend.mlx_name()
        )));
    }
    // NCCL's ranks run on GPUs: a rank that sees none (CUDA_VISIBLE_DEVICES naming a device
    // its host lacks) would fail inside MLX without a word.
    // (A CUDA build's default device is the GPU even when no GPU is visible; the count tells.
    // Neither call throws: `current` asks for the default device, which also installs mlx-rs's
    // error handler, and MLX's GPU count reads CUDA's count without checking its status.)
    if backend == Backend::Nccl
        && (crate::device::Backend::current() != crate::device::Backend::Cuda
            || crate::device::Backend::gpu_count() == 0)
    {
        return Err(EngineError::Distributed(format!(
            "the NCCL backend runs on CUDA GPUs, and this rank sees none (CUDA_VISIBLE_DEVICES is \
             {})",
            std::env::var("CUDA_VISIBLE_DEVICES")
                .map(|v| format!("{v:?}"))
                .unwrap_or_else(|_| "not set".into())
        )));
    }
    // An MLX error from here on is reported to mlx-rs's handler (which one call of a guarded
    // mlx-rs operation installs), not MLX's default one, which exits the process.
    Array::from_int(0).eval()?;
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("perch-distributed-init".into())
        .spawn(move || {
            let name = CString::new(backend.mlx_name()).expect("no NUL in a backend name");
            // SAFETY: `res` is an empty handle MLX fills; the name outlives the call.
            let result = unsafe {
                let mut res = mlx_sys::mlx_distributed_group_new();
                if mlx_sys::mlx_distributed_init(&mut res, true, name.as_ptr()) != 0 {
                    mlx_sys::mlx_distributed_group_free(res);
                    None
                } else {
                    Some(RawGroup(res))
                }
            };
            // The receiver may have given up (deadline): nothing to report then.
            let _ = sender.send(result);
        })
        .map_err(|e| EngineError::Distributed(format!("cannot start a thread: {e}")))?;
    let received = receiver.recv_timeout(deadline);
    drop(temporary);
    let raw = match received {
        Ok(Some(RawGroup(raw))) => raw,
        Ok(None) => {
            return Err(EngineError::Distributed(format!(
                "MLX could not start its {} backend: check the environment `mlx.launch` sets \
                 (for ring: MLX_RANK, and MLX_HOSTFILE listing every rank's address; for NCCL: \
                 MLX_RANK, MLX_WORLD_SIZE, NCCL_HOST_IP, NCCL_PORT, and a GPU of its own for \
                 each rank)",
                backend.mlx_name()
            )))
        }
        Err(_) => {
            return Err(EngineError::Distributed(format!(
                "not every rank connected within {} s (is each host's process running, and \
                 are the addresses in MLX_HOSTFILE reachable?)",
                deadline.as_secs_f32()
            )))
        }
    };
    // SAFETY: `raw` is a live group.
    let (rank, size) = unsafe {
        (
            mlx_sys::mlx_distributed_group_rank(raw),
            mlx_sys::mlx_distributed_group_size(raw),
        )
    };
    JOINED.store(true, Ordering::Relaxed);
    Ok(Group {
        raw,
        backend,
        rank: rank as usize,
        size: size as usize,
    })
}

/// The ranks of a tensor-parallel group (Shoeybi et al. 2019, "Megatron-LM"; mlx_lm's `shard`):
/// every rank holds a part of each layer's heads and feed-forward features
/// ([`crate::models::Model::shard`]), runs the same steps on the same tokens, and adds the ranks'
/// partial outputs of each attention and feed-forward part together ([`TensorParallel::all_sum`]).
/// Cloned by every model copy (one group).
#[derive(Clone, Debug)]
pub struct TensorParallel {
    group: Arc<Group>,
}

impl TensorParallel {
    pub fn new(group: Group) -> Self {
        Self {
            group: Arc::new(group),
        }
    }

    /// Each rank's share of `n` `what` (`"query heads"`): `n / size`, or an error saying why
    /// `n` cannot be divided.
    pub fn part(&self, what: &str, n: i32) -> Result<i32> {
        let size = self.size() as i32;
        match n % size {
            0 => Ok(n / size),
            _ => Err(EngineError::Distributed(format!(
                "{n} {what} cannot be divided over {size} ranks"
            ))),
        }
    }
}

/// The stages of a pipeline-parallel group (mlx_lm's `pipeline`): each rank holds a run of
/// consecutive layers ([`crate::models::Model::pipeline`]), the last rank the first layers and
/// rank 0 the last ones; a pass's hidden states go from rank `r` to rank `r - 1` (`send`,
/// `recv`), and rank 0's final states to every rank (`all_gather`), so that every rank computes
/// the same logits. For models whose weights do not fit one machine even divided by heads.
#[derive(Clone, Debug)]
pub struct PipelineParallel {
    group: Arc<Group>,
}

impl PipelineParallel {
    pub fn new(group: Group) -> Self {
        Self {
            group: Arc::new(group),
        }
    }

    /// The layers this rank holds of a model whose layers are of `kinds` (one a layer, e.g.
    /// sliding-window or not, linear attention or not): an even split in reverse rank order, the
    /// low ranks taking one more where it does not divide (mlx_lm's default split), in whole
    /// runs of the kinds' pattern ([`layer_period`]) where every stage gets at least one (so
    /// that each stage holds every kind in the model's proportions: the batch engine's stages
    /// then choose alike, see `engine::batch::lockstep`), else layer by layer. A stage may then
    /// hold a run more than another (Qwen3.5's 24 layers over 4 ranks: 8, 8, 4, 4), also where
    /// only one sequence runs. Errors when some rank would hold none.
    pub fn layers<T: PartialEq>(&self, kinds: &[T]) -> Result<std::ops::Range<usize>> {
        stage_layers(kinds.len(), self.rank(), self.size(), layer_period(kinds))
    }
}

/// The shortest run of layers whose kinds repeat through all of `kinds` (a whole number of
/// times): 1 when every layer is of one kind, 4 for Qwen3.5's three linear-attention layers and
/// one full-attention layer, `kinds.len()` when nothing repeats.
pub fn layer_period<T: PartialEq>(kinds: &[T]) -> usize {
    let n = kinds.len();
    (1..=n)
        .find(|&p| n.is_multiple_of(p) && (p..n).all(|i| kinds[i] == kinds[i % p]))
        .unwrap_or(n.max(1))
}

/// Each split is its group: rank, size and collectives (`all_sum` after a tensor-parallel part;
/// `send`, `recv_like` and `all_gather` between stages).
impl std::ops::Deref for TensorParallel {
    type Target = Group;

    fn deref(&self) -> &Group {
        &self.group
    }
}

impl std::ops::Deref for PipelineParallel {
    type Target = Group;

    fn deref(&self) -> &Group {
        &self.group
    }
}

/// [`PipelineParallel::layers`] of rank `rank` of `size`, in runs of `period` layers.
fn stage_layers(
    num_layers: usize,
    rank: usize,
    size: usize,
    period: usize,
) -> Result<std::ops::Range<usize>> {
    if num_layers < size {
        return Err(EngineError::Distributed(format!(
            "{num_layers} layers cannot be split into {size} stages"
        )));
    }
    let period =
        match period > 0 && num_layers.is_multiple_of(period) && num_layers / period >= size {
            true => period,
            false => 1,
        };
    let runs = num_layers / period;
    let (base, extra) = (runs / size, runs % size);
    let held = |r: usize| (base + usize::from(r < extra)) * period;
    let start: usize = (rank + 1..size).map(held).sum();
    Ok(start..start + held(rank))
}

/// How a model is divided over its group's ranks: each rank's part of every layer, or its stage
/// of layers.
#[derive(Clone, Debug)]
pub enum Division {
    Tensor(TensorParallel),
    Pipeline(PipelineParallel),
}

impl Division {
    pub fn rank(&self) -> usize {
        self.group().rank()
    }

    pub fn size(&self) -> usize {
        self.group().size()
    }

    /// The group the model is divided over.
    pub fn group(&self) -> &Group {
        match self {
            Division::Tensor(tp) => tp,
            Division::Pipeline(pp) => pp,
        }
    }
}

/// Checks what MLX's NCCL backend reads at start (`MLX_RANK`, `MLX_WORLD_SIZE`, and where the
/// ranks meet: `NCCL_HOST_IP`, `NCCL_PORT`) before MLX does, which would end the process on a
/// number it cannot parse. Returns the group's size; errors name the variable.
pub fn check_nccl_environment(
    rank: Option<&str>,
    world_size: Option<&str>,
    host: Option<&str>,
    port: Option<&str>,
) -> Result<usize> {
    let (Some(rank), Some(world_size), Some(host), Some(port)) = (rank, world_size, host, port)
    else {
        return Err(EngineError::Distributed(
            "the NCCL backend needs MLX_RANK (this process's rank), MLX_WORLD_SIZE (the number \
             of ranks), NCCL_HOST_IP and NCCL_PORT (rank 0's address and a port where the ranks \
             meet), as `mlx.launch` sets them"
                .into(),
        ));
    };
    let number = |name: &str, value: &str| -> Result<usize> {
        value.trim().parse().map_err(|_| {
            EngineError::Distributed(format!("{name} is {value:?}, not a whole number"))
        })
    };
    let (rank, size) = (
        number("MLX_RANK", rank)?,
        number("MLX_WORLD_SIZE", world_size)?,
    );
    if size < 2 {
        return Err(EngineError::Distributed(format!(
            "MLX_WORLD_SIZE is {size}: a group needs two or more ranks"
        )));
    }
    if rank >= size {
        return Err(EngineError::Distributed(format!(
            "MLX_RANK is {rank}, but MLX_WORLD_SIZE is {size} (ranks 0 to {})",
            size - 1
        )));
    }
    if host.trim().is_empty() || host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(EngineError::Distributed(format!(
            "NCCL_HOST_IP is {host:?}, not a host name or address"
        )));
    }
    if !matches!(port.trim().parse::<u16>(), Ok(p) if p != 0) {
        return Err(EngineError::Distributed(format!(
            "NCCL_PORT is {port:?}, not a port from 1 to 65535"
        )));
    }
    Ok(size)
}

/// `host:port` as MLX's backends read an address (split at the first colon, a port from 1 to
/// 65535): the port, or `None`.
fn address_port(address: &str) -> Option<u16> {
    address
        .split_once(':')
        .filter(|(host, _)| !host.is_empty())
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .filter(|&port| port != 0)
}

/// Checks a JACCL devices file's text as MLX 0.32 reads it (`jaccl::Config`): a list with a row
/// for each rank, each row an entry for every rank, each entry `null`, a device name or a list of
/// names (several cables), forming a mesh (every rank names the devices reaching every other, none
/// for itself) or a ring (every rank names as many for each of its two neighbours). Stricter than
/// MLX in one case: a ring of no devices at all, which MLX takes, is refused.
/// Returns the number of ranks; the error says what is wrong.
pub fn check_jaccl_devices(text: &str) -> std::result::Result<usize, String> {
    let rows: Vec<Vec<serde_json::Value>> = serde_json::from_str(text).map_err(|e| {
        format!("not a JSON list of each rank's devices ([[null, \"rdma_en2\"], …]): {e}")
    })?;
    let n = rows.len();
    if n < 2 {
        return Err(format!("{n} rank listed: a group needs two or more"));
    }
    let mut names = vec![vec![0usize; n]; n];
    for (r, row) in rows.iter().enumerate() {
        if row.len() != n {
            return Err(format!(
                "rank {r} lists {} entries: every rank needs one for each of the {n} ranks",
                row.len()
            ));
        }
        for (dst, entry) in row.iter().enumerate() {
            let count = match entry {
                serde_json::Value::Null => Some(0),
                serde_json::Value::String(_) => Some(1),
                serde_json::Value::Array(list) => {
                    list.iter().all(|v| v.is_string()).then_some(list.len())
                }
                _ => None,
            };
            names[r][dst] = count.ok_or_else(|| {
                format!(
                    "rank {r}'s entry for rank {dst} is not null, a device name or a list of names"
                )
            })?;
        }
    }
    let mesh = (0..n).all(|r| (0..n).all(|d| (names[r][d] == 0) == (r == d)));
    let cables = names[0][1];
    let ring = cables > 0
        && (0..n).all(|r| names[r][(r + n - 1) % n] == cables && names[r][(r + 1) % n] == cables);
    match mesh || ring {
        true => Ok(n),
        false => Err(
            "the devices form neither a mesh (each rank names the devices reaching every other \
             rank, and none for itself) nor a ring (each rank names as many for each of its two \
             neighbours)"
                .into(),
        ),
    }
}

/// Checks what MLX's JACCL backend reads at start (the rank, the devices file it names — see
/// [`check_jaccl_devices`] — and the coordinator, `host:port` of rank 0; MLX reads `JACCL_RANK`,
/// `JACCL_IBV_DEVICES` and `JACCL_COORDINATOR` before `MLX_RANK`, `MLX_IBV_DEVICES` and
/// `MLX_JACCL_COORDINATOR`) before MLX does. Returns the number of ranks; errors name the
/// variable or file.
pub fn check_jaccl_environment(
    rank: Option<&str>,
    devices: Option<std::path::PathBuf>,
    coordinator: Option<&str>,
) -> Result<usize> {
    let (Some(rank), Some(devices), Some(coordinator)) = (rank, devices, coordinator) else {
        return Err(EngineError::Distributed(
            "the JACCL backend needs MLX_RANK (this process's rank), MLX_IBV_DEVICES (a JSON \
             file of each rank's RDMA devices) and MLX_JACCL_COORDINATOR (rank 0's host:port), \
             as `mlx.launch` sets them"
                .into(),
        ));
    };
    if address_port(coordinator).is_none() {
        return Err(EngineError::Distributed(format!(
            "MLX_JACCL_COORDINATOR is {coordinator:?}, not \"host:port\" (a port from 1 to \
             65535)"
        )));
    }
    check_rank_file(rank, "MLX_IBV_DEVICES", &devices, check_jaccl_devices)
}

/// `rank` (MLX_RANK's text) as a number, and the file `variable` names read and checked by
/// `check` (which gives its number of ranks), the rank within them: the ring's and JACCL's
/// shared steps. Errors name the variable and the file.
fn check_rank_file(
    rank: &str,
    variable: &str,
    path: &std::path::Path,
    check: fn(&str) -> std::result::Result<usize, String>,
) -> Result<usize> {
    let rank: usize = rank.trim().parse().map_err(|_| {
        EngineError::Distributed(format!("MLX_RANK is {rank:?}, not a rank number (0, 1, …)"))
    })?;
    let bad = |message: String| {
        EngineError::Distributed(format!("{variable} {}: {message}", path.display()))
    };
    let text = crate::limits::read_text_capped(path, crate::limits::MAX_CONFIG_BYTES)
        .map_err(|e| bad(e.to_string()))?;
    let n = check(&text).map_err(bad)?;
    if rank >= n {
        return Err(bad(format!(
            "MLX_RANK is {rank}, but the file lists {n} ranks (0 to {})",
            n - 1
        )));
    }
    Ok(n)
}

/// Checks what MLX's ring backend reads at start (`MLX_RANK`, and the `MLX_HOSTFILE` it names)
/// before MLX does, which would take a rank that is not a number as rank 0 and report a bad
/// file only as a failed start. Returns the number of ranks the file lists; errors say what is
/// wrong, naming the file.
pub fn check_ring_environment(
    rank: Option<&str>,
    hostfile: Option<std::path::PathBuf>,
) -> Result<usize> {
    let (Some(rank), Some(hostfile)) = (rank, hostfile) else {
        return Err(EngineError::Distributed(
            "the ring backend needs MLX_RANK (this process's rank) and MLX_HOSTFILE (a JSON \
             list of each rank's [\"ip:port\"]), as `mlx.launch` sets them"
                .into(),
        ));
    };
    check_rank_file(rank, "MLX_HOSTFILE", &hostfile, check_ring_hostfile)
}

/// Checks a ring hostfile's text as MLX reads it: a JSON list of each rank's `"host:port"`
/// addresses (split at the first colon), as many for every rank (a connection to each
/// neighbour an address), no address twice, two ranks or more. Returns the number of ranks; the
/// error says what is wrong.
pub fn check_ring_hostfile(text: &str) -> std::result::Result<usize, String> {
    let hosts: Vec<Vec<String>> = serde_json::from_str(text).map_err(|e| {
        format!("not a JSON list of each rank's addresses ([[\"ip:port\"], …]): {e}")
    })?;
    let mut seen = std::collections::HashMap::new();
    for (r, addresses) in hosts.iter().enumerate() {
        if addresses.is_empty() {
            return Err(format!("rank {r} has no address"));
        }
        if addresses.len() != hosts[0].len() {
            return Err(format!(
                "rank {r} lists {} addresses and rank 0 {}: every rank needs as many",
                addresses.len(),
                hosts[0].len()
            ));
        }
        for address in addresses {
            // MLX splits at the first colon: a host holding one (an IPv6 address) cannot be
            // written here.
            if address_port(address).is_none() {
                return Err(format!(
                    "rank {r}'s address {address:?} is not \"host:port\" (a host name or IPv4 \
                     address, a port from 1 to 65535)"
                ));
            }
            match seen.insert(address.as_str(), r) {
                Some(other) if other == r => return Err(format!("rank {r} lists {address} twice")),
                Some(other) => {
                    return Err(format!("ranks {other} and {r} both listen on {address}"))
                }
                None => {}
            }
        }
    }
    if hosts.len() < 2 {
        return Err(format!(
            "{} rank listed: a group needs two or more",
            hosts.len()
        ));
    }
    Ok(hosts.len())
}

/// A group handle passed from the thread that made it.
struct RawGroup(mlx_sys::mlx_distributed_group);

// SAFETY: see `Group`.
unsafe impl Send for RawGroup {}

type Collective = unsafe extern "C" fn(
    *mut mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    mlx_sys::mlx_distributed_group,
    mlx_sys::mlx_stream,
) -> std::os::raw::c_int;

type PointToPoint = unsafe extern "C" fn(
    *mut mlx_sys::mlx_array,
    mlx_sys::mlx_array,
    std::os::raw::c_int,
    mlx_sys::mlx_distributed_group,
    mlx_sys::mlx_stream,
) -> std::os::raw::c_int;

impl Group {
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn collective(&self, name: &str, op: Collective, x: &Array) -> Result<Array> {
        let stream = self.backend.stream();
        // SAFETY: `res` is an empty handle the op fills; ownership passes to the Array.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            if op(&mut res, x.as_ptr(), self.raw, stream.as_ptr()) != 0 {
                mlx_sys::mlx_array_free(res);
                return Err(EngineError::Distributed(format!("MLX {name} failed")));
            }
            Ok(Array::from_ptr(res))
        }
    }

    /// The elementwise sum of every rank's `x` (same shape and dtype on every rank), on every
    /// rank. Lazy: it runs when evaluated.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.collective("all_sum", mlx_sys::mlx_distributed_all_sum, x)
    }

    /// Every rank's `x` concatenated along the first axis in rank order, on every rank. Lazy.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.collective("all_gather", mlx_sys::mlx_distributed_all_gather, x)
    }

    /// `x` sent to rank `peer`; the result stands for the send (evaluating it sends). Lazy.
    pub fn send(&self, x: &Array, peer: usize) -> Result<Array> {
        self.point_to_point("send", mlx_sys::mlx_distributed_send, x, peer)
    }

    /// What rank `peer` sends, shaped and typed as `like` (whose values are not read). Lazy.
    pub fn recv_like(&self, like: &Array, peer: usize) -> Result<Array> {
        self.point_to_point("recv", mlx_sys::mlx_distributed_recv_like, like, peer)
    }

    fn point_to_point(
        &self,
        name: &str,
        op: PointToPoint,
        x: &Array,
        peer: usize,
    ) -> Result<Array> {
        if peer >= self.size || peer == self.rank {
            return Err(EngineError::Distributed(format!(
                "rank {} cannot {name} with rank {peer} of {}",
                self.rank, self.size
            )));
        }
        let stream = self.backend.stream();
        // SAFETY: as `collective`; `peer` is a rank of the group.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            if op(&mut res, x.as_ptr(), peer as i32, self.raw, stream.as_ptr()) != 0 {
                mlx_sys::mlx_array_free(res);
                return Err(EngineError::Distributed(format!("MLX {name} failed")));
            }
            Ok(Array::from_ptr(res))
        }
    }

    /// Every rank's `bytes`, in rank order, on every rank (each rank passes as many bytes as
    /// the others). Evaluates; errors when a rank is gone.
    pub fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        if bytes.is_empty() || bytes.len() > i32::MAX as usize / self.size {
            return Err(EngineError::Distributed(format!(
                "{} bytes cannot be gathered from every rank",
                bytes.len()
            )));
        }
        let gathered = self.all_gather(&Array::from_slice(bytes, &[bytes.len() as i32]))?;
        gathered.eval()?;
        Ok(gathered
            .as_slice::<u8>()
            .chunks(bytes.len())
            .map(<[u8]>::to_vec)
            .collect())
    }

    /// Every rank's `words`, in rank order, on every rank ([`Group::all_gather_bytes`] of their
    /// little-endian bytes).
    pub fn all_gather_words<const N: usize>(&self, words: [u64; N]) -> Result<Vec<[u64; N]>> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        Ok(self
            .all_gather_bytes(&bytes)?
            .iter()
            .map(|b| {
                std::array::from_fn(|i| {
                    u64::from_le_bytes(b[8 * i..8 * (i + 1)].try_into().expect("8 bytes"))
                })
            })
            .collect())
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`). Evaluates; errors when a rank
    /// is gone or when rank 0 passes nothing.
    pub fn broadcast_bytes(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
        Ok(self
            .broadcast_bytes_gathering(bytes, [0; GATHERED_WORDS])?
            .0)
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`), and every rank's `words` in
    /// rank order: a gather of each rank's header (rank 0's length, then every rank's words,
    /// 8 bytes each), then rank 0's bytes summed with zeros from the others. Evaluates; errors
    /// when a rank is gone or when rank 0 passes nothing.
    pub fn broadcast_bytes_gathering(
        &self,
        bytes: Option<&[u8]>,
        words: [u64; GATHERED_WORDS],
    ) -> Result<(Vec<u8>, Vec<[u64; GATHERED_WORDS]>)> {
        let root = self.rank == 0;
        if root != bytes.is_some() {
            return Err(EngineError::Distributed(format!(
                "rank {} of a broadcast from rank 0 {} bytes",
                self.rank,
                if root { "has no" } else { "passed" }
            )));
        }
        let len = bytes.map_or(0, <[u8]>::len);
        if len > i32::MAX as usize {
            return Err(EngineError::Distributed(format!(
                "{len} bytes are too many"
            )));
        }
        let mut header = [0u64; 1 + GATHERED_WORDS];
        header[0] = len as u64;
        header[1..].copy_from_slice(&words);
        let headers = self.all_gather_words(header)?;
        let words = headers
            .iter()
            .map(|h| std::array::from_fn(|i| h[1 + i]))
            .collect();
        let len = headers[0][0] as usize;
        if len == 0 {
            return Ok((Vec::new(), words));
        }
        let data = match bytes {
            Some(bytes) => Array::from_slice(bytes, &[len as i32]),
            None => mlx_rs::ops::zeros_dtype(&[len as i32], Dtype::Uint8)?,
        };
        let data = self.all_sum(&data)?;
        data.eval()?;
        Ok((data.as_slice::<u8>().to_vec(), words))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variable MLX's NCCL backend parses is checked first, each error naming it.
    #[test]
    fn an_nccl_environment_is_checked_before_mlx_reads_it() {
        let good = (Some("1"), Some("2"), Some("10.0.0.1"), Some("6000"));
        assert_eq!(
            check_nccl_environment(good.0, good.1, good.2, good.3).unwrap(),
            2
        );
        let error = |rank, size, host, port| {
            check_nccl_environment(rank, size, host, port)
                .unwrap_err()
                .to_string()
        };
        assert!(error(None, good.1, good.2, good.3).contains("needs MLX_RANK"));
        assert!(error(good.0, good.1, None, good.3).contains("NCCL_HOST_IP"));
        assert!(error(Some("x"), good.1, good.2, good.3).contains("MLX_RANK is \"x\""));
        assert!(error(good.0, Some("two"), good.2, good.3).contains("MLX_WORLD_SIZE is \"two\""));
        assert!(error(good.0, Some("1"), good.2, good.3).contains("two or more ranks"));
        assert!(error(Some("2"), good.1, good.2, good.3).contains("ranks 0 to 1"));
        assert!(error(good.0, good.1, Some(" "), good.3).contains("not a host name"));
        assert!(error(good.0, good.1, Some("a/b"), good.3).contains("not a host name"));
        for port in ["0", "70000", "p"] {
            assert!(error(good.0, good.1, good.2, Some(port)).contains("port from 1 to 65535"));
        }
    }

    /// `text` written to `name` in `dir`: the path an environment variable would name.
    fn written(dir: &std::path::Path, name: &str, text: &str) -> Option<std::path::PathBuf> {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        Some(path)
    }

    /// The JACCL device file is a square with nulls on its diagonal; each error names the
    /// variable or the file.
    #[test]
    fn a_jaccl_environment_is_checked_before_mlx_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| written(dir.path(), name, text);
        let good = file("good.json", r#"[[null, "rdma_en3"], ["rdma_en3", null]]"#);
        let at = Some("10.0.0.1:5000");
        assert_eq!(
            check_jaccl_environment(Some("1"), good.clone(), at).unwrap(),
            2
        );
        let error = |rank, devices, coordinator| {
            check_jaccl_environment(rank, devices, coordinator)
                .unwrap_err()
                .to_string()
        };
        assert!(error(None, good.clone(), at).contains("needs MLX_RANK"));
        assert!(error(Some("x"), good.clone(), at).contains("not a rank number"));
        assert!(error(Some("2"), good.clone(), at).contains("lists 2 ranks (0 to 1)"));
        for coordinator in ["10.0.0.1", ":5000", "h:0", "h:p", "fe80::1:5000"] {
            assert!(error(Some("0"), good.clone(), Some(coordinator)).contains("not \"host:port\""));
        }
        // Several cables between two ranks, and a ring of four (neighbours only).
        let cables = file(
            "cables.json",
            r#"[[null, ["rdma_en3", "rdma_en4"]], [["a", "b"], null]]"#,
        );
        assert_eq!(check_jaccl_environment(Some("0"), cables, at).unwrap(), 2);
        let ring = r#"[[null, "a", null, "b"], ["a", null, "c", null],
                       [null, "c", null, "d"], ["b", null, "d", null]]"#;
        assert_eq!(check_jaccl_devices(ring), Ok(4));
        for (text, expected) in [
            ("{}", "not a JSON list"),
            (r#"[[null]]"#, "1 rank listed"),
            (r#"[[null, null], [null, null]]"#, "neither a mesh"),
            (r#"[[null, "a"], ["a"]]"#, "rank 1 lists 1 entries"),
            (r#"[[null, 3], ["a", null]]"#, "rank 0's entry for rank 1"),
            (
                r#"[[null, "a", null], ["a", null, null], [null, null, null]]"#,
                "neither a mesh",
            ),
        ] {
            let got = error(Some("0"), file("bad.json", text), at);
            assert!(
                got.contains(expected) && got.contains("bad.json"),
                "{text}: {got}"
            );
        }
    }

    #[test]
    fn a_ring_environment_is_checked_before_mlx_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = |name: &str, text: &str| written(dir.path(), name, text);
        let good = file(
            "good.json",
            r#"[["127.0.0.1:5000", "127.0.0.1:5002"], ["10.0.0.2:5000", "10.0.1.2:5001"]]"#,
        );
        assert_eq!(check_ring_environment(Some("1"), good.clone()).unwrap(), 2);
        let error = |rank: Option<&str>, hostfile: Option<std::path::PathBuf>| {
            check_ring_environment(rank, hostfile)
                .unwrap_err()
                .to_string()
        };
        assert!(error(None, good.clone()).contains("needs MLX_RANK"));
        assert!(error(Some("0"), None).contains("MLX_HOSTFILE"));
        assert!(error(Some("one"), good.clone()).contains("\"one\", not a rank number"));
        assert!(error(Some("2"), good.clone()).contains("lists 2 ranks (0 to 1)"));
        let missing = Some(dir.path().join("missing.json"));
        assert!(error(Some("0"), missing).contains("missing.json"));
        for (text, expected) in [
            ("{\"hosts\": []}", "not a JSON list"),
            (
                "[[\"127.0.0.1\"], [\"127.0.0.1:5001\"]]",
                "\"127.0.0.1\" is not \"host:port\"",
            ),
            (
                "[[\":5000\"], [\"127.0.0.1:5001\"]]",
                "is not \"host:port\"",
            ),
            (
                "[[\"127.0.0.1:70000\"], [\"127.0.0.1:5001\"]]",
                "port from 1 to 65535",
            ),
            ("[[], [\"127.0.0.1:5001\"]]", "rank 0 has no address"),
            (
                "[[\"127.0.0.1:5000\"], [\"127.0.0.1:5000\"]]",
                "ranks 0 and 1 both listen on",
            ),
            ("[[\"127.0.0.1:5000\"]]", "1 rank listed"),
            (
                "[[\"a:5000\", \"a:5000\"], [\"b:1\", \"b:2\"]]",
                "rank 0 lists a:5000 twice",
            ),
            (
                "[[\"a:5000\"], [\"b:1\", \"b:2\"]]",
                "rank 1 lists 2 addresses and rank 0 1",
            ),
            (
                "[[\"fe80::1:5000\"], [\"b:1\"]]",
                "\"fe80::1:5000\" is not \"host:port\"",
            ),
        ] {
            let message = error(Some("0"), file("bad.json", text));
            assert!(message.contains(expected), "{text}: {message}");
            assert!(message.contains("bad.json"), "{text}: {message}");
        }
    }

    #[test]
    fn stages_hold_every_layer_once_the_last_rank_the_first_layers() {
        let stages = |layers, size| -> Vec<std::ops::Range<usize>> {
            (0..size)
                .map(|r| stage_layers(layers, r, size, 1).unwrap())
                .collect()
        };
        // mlx_lm's split of 5 over 2: [3, 2], rank 1 first.
        assert_eq!(stages(5, 2), [2..5, 0..2]);
        assert_eq!(stages(4, 2), [2..4, 0..2]);
        assert_eq!(stages(10, 4), [7..10, 4..7, 2..4, 0..2]);
        let error = stage_layers(2, 0, 3, 1).unwrap_err().to_string();
        assert!(
            error.contains("2 layers cannot be split into 3 stages"),
            "{error}"
        );
    }

    /// A model of layers of several kinds is split in whole runs of their pattern where each
    /// stage gets one (Qwen3.5's 3 linear : 1 full attention), else layer by layer.
    #[test]
    fn stages_hold_whole_runs_of_the_layers_pattern() {
        let qwen3_5 = |n: usize| -> Vec<bool> { (0..n).map(|i| (i + 1) % 4 != 0).collect() };
        assert_eq!(layer_period(&qwen3_5(24)), 4);
        assert_eq!(layer_period(&[true; 5]), 1);
        assert_eq!(
            layer_period(&qwen3_5(6)),
            6,
            "nothing repeats a whole number of times"
        );
        assert_eq!(layer_period::<bool>(&[]), 1);
        let stages = |kinds: &[bool], size| -> Vec<std::ops::Range<usize>> {
            (0..size)
                .map(|r| stage_layers(kinds.len(), r, size, layer_period(kinds)).unwrap())
                .collect()
        };
        // 15 runs of 4 over 2 ranks: rank 0 8 runs, rank 1 7 (an even split: 30 and 30 layers).
        assert_eq!(stages(&qwen3_5(60), 2), [28..60, 0..28]);
        assert_eq!(stages(&qwen3_5(24), 4), [16..24, 8..16, 4..8, 0..4]);
        // Fewer runs than ranks: layer by layer.
        assert_eq!(stages(&qwen3_5(4), 2), [2..4, 0..2]);
    }
}
