//! `--distributed`: this process as one rank of a group that divides a model over several
//! processes or machines (MLX's distributed backends; `perch_engine::distributed`). Start one
//! process per rank as `mlx.launch` does (for ring: `MLX_RANK` and `MLX_HOSTFILE`), each with the
//! same command: every rank computes the same tokens, and rank 0 prints them.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

use std::path::Path;

use anyhow::Context;
use perch_engine::distributed::{self, Backend, Division, PipelineParallel, TensorParallel};
use perch_engine::models::{self, Model};

/// How the ranks divide the model.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Split {
    /// Every layer's heads and features over the ranks (tensor parallelism).
    Tensor,
    /// The layers into consecutive stages, one a rank (pipeline parallelism).
    Pipeline,
}

/// MLX's distributed backend the group runs on.
#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
pub enum BackendArg {
    /// TCP between the hosts of `MLX_HOSTFILE`.
    Ring,
    /// RDMA over Thunderbolt between Macs.
    Jaccl,
    /// JACCL preferring a ring of its connections to a mesh (`MLX_JACCL_RING`).
    JacclRing,
    Mpi,
    /// NVIDIA's collectives, between CUDA devices.
    Nccl,
}

impl From<BackendArg> for Backend {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Ring => Backend::Ring,
            BackendArg::Jaccl | BackendArg::JacclRing => Backend::Jaccl,
            BackendArg::Mpi => Backend::Mpi,
            BackendArg::Nccl => Backend::Nccl,
        }
    }
}

/// The flags of a command that runs as one rank of a group (`generate`, `serve`).
#[derive(clap::Args)]
pub struct DistributedArgs {
    /// Run as one rank of a group that divides the model over processes or machines (MLX's
    /// distributed backends; start each rank as `mlx.launch` does, for ring with `MLX_RANK`
    /// and `MLX_HOSTFILE`, or with --hosts): `tensor` divides every layer's heads and
    /// features, `pipeline` the layers into stages. Every rank runs the same command; rank 0
    /// prints (`generate`) or serves (`serve`).
    #[arg(long, value_enum)]
    pub distributed: Option<Split>,
    /// The backend `--distributed` runs on (default: a --hostfile's, else ring).
    #[arg(long, value_enum, requires = "distributed")]
    pub backend: Option<BackendArg>,
    /// With --distributed: start every rank from here, one a host of this comma-separated list
    /// (rank 0 first; a host may be named twice), as `mlx.launch --hosts` does for the ring and
    /// NCCL backends (JACCL needs --hostfile's RDMA devices): on this machine for `localhost` and
    /// `127.0.0.1`, over `ssh` (key-based, the same `perch` path on every host) elsewhere. With
    /// NCCL the ranks of a host take its GPUs in order.
    #[arg(
        long,
        value_delimiter = ',',
        requires = "distributed",
        group = "launch"
    )]
    pub hosts: Vec<String>,
    /// With --distributed: start every rank from here, one a host of this hostfile in
    /// mlx.launch's format (what `mlx.distributed_config` writes: `{"backend": …, "envs": […],
    /// "hosts": [{"ssh": …, "ips": […], "rdma": […]}, …]}`), as `mlx.launch --hostfile` does for
    /// the ring, JACCL and NCCL backends.
    #[arg(long, requires = "distributed", group = "launch")]
    pub hostfile: Option<std::path::PathBuf>,
    /// With --hosts or --hostfile: rank r listens on this port plus r (ring; each address of a
    /// hostfile's on the next port); the ranks meet at this port on rank 0's host (JACCL, NCCL).
    #[arg(long, default_value_t = 32323, requires = "launch")]
    pub starting_port: u16,
    /// With --distributed: how long each rank waits for every rank of its group to connect, in
    /// seconds (ranks started by hand, one host after another, may need longer than the
    /// default). A launch passes it to every rank.
    #[arg(
        long,
        default_value_t = 60,
        requires = "distributed",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub join_timeout: u64,
}

impl DistributedArgs {
    /// Whether this command starts the group's ranks (`--hosts`, `--hostfile`) rather than
    /// being one.
    pub fn launches(&self) -> bool {
        !self.hosts.is_empty() || self.hostfile.is_some()
    }

    /// The backend a rank runs on (a launch passes its own choice to every rank).
    pub fn backend(&self) -> BackendArg {
        self.backend.unwrap_or(BackendArg::Ring)
    }

    /// Starts the group's ranks and waits for them ([`crate::launch::launch`]).
    pub fn launch(&self) -> anyhow::Result<()> {
        let group = crate::launch::GroupSpec::new(self.hostfile.as_deref(), &self.hosts);
        crate::launch::launch(group, self.starting_port, self.backend)
    }
}

/// Joins the group on `group`'s backend within its `--join-timeout`, divided as `split` says.
pub fn join(split: Split, group: &DistributedArgs) -> anyhow::Result<Division> {
    let deadline = Duration::from_secs(group.join_timeout);
    let group = distributed::init(group.backend().into(), deadline)?;
    Ok(match split {
        Split::Tensor => Division::Tensor(TensorParallel::new(group)),
        Split::Pipeline => Division::Pipeline(PipelineParallel::new(group)),
    })
}

/// Joins the group ([`join`]), loads this rank's part of the model in `dir` (`split`;
/// `models::load_divided`: no more of the weights is read or kept than the part needs), then
/// takes rank 0's sampling seed (`seed`, or one it draws). Returns the model, this rank and the
/// group's seed: every rank must sample alike to stay on the same tokens.
pub fn load(
    dir: &Path,
    split: Split,
    group: &DistributedArgs,
    seed: Option<u64>,
) -> anyhow::Result<(Box<dyn Model>, usize, u64)> {
    let division = join(split, group)?;
    let rank = division.rank();
    let model = load_part(dir, &division)?;
    // Every rank has loaded its part (`load_divided` ends with the ranks meeting), so no rank's
    // watchdog counts another's slower load as a stall once generation starts.
    let mine = seed.unwrap_or_else(|| {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    });
    // The ranks met as `load_divided` ended, nothing of note between: no watch of its own.
    let shared = division
        .group()
        .broadcast_bytes((rank == 0).then_some(&mine.to_le_bytes()[..]))?;
    let seed = u64::from_le_bytes(
        shared
            .try_into()
            .map_err(|_| anyhow::anyhow!("rank 0 sent a seed of the wrong size"))?,
    );
    Ok((model, rank, seed))
}

/// This rank's part of the model in `dir` (`models::load_divided`).
pub fn load_part(dir: &Path, division: &Division) -> anyhow::Result<Box<dyn Model>> {
    models::load_divided(dir, division).with_context(|| {
        format!(
            "rank {} loading its part of the model in {}",
            division.rank(),
            dir.display()
        )
    })
}

/// The batch engine over ranks (`perch serve --distributed`, `perch generate --distributed`
/// with images): joins the group ([`join`]), divided as `split` says. Rank 0 gets an engine
/// over its part of the model in `dir`, whose batch every call of the other ranks follows. Any
/// other rank loads its part (and the whole draft model of `config`, which every rank runs
/// alike), follows rank 0's batch (`perch_engine::engine::follow`) until rank 0 stops, and gets
/// `None`.
pub fn engine(
    dir: &Path,
    split: Split,
    group: &DistributedArgs,
    config: perch_engine::EngineConfig,
) -> anyhow::Result<Option<perch_engine::EngineHandle>> {
    use perch_engine::EngineHandle;
    let division = join(split, group)?;
    if division.rank() > 0 {
        follow(dir, config.draft_model.as_deref(), &division)?;
        return Ok(None);
    }
    let (load_dir, id) = (dir.to_path_buf(), EngineHandle::model_id(dir));
    let engine = EngineHandle::spawn_with(config, id, move |_| {
        let model = load_part(&load_dir, &division)
            .map_err(|e| perch_engine::EngineError::Distributed(format!("{e:#}")))?;
        let tokenizer = EngineHandle::tokenizer_for(&load_dir, model.as_ref())?;
        Ok((model, tokenizer))
    })
    .with_context(|| format!("loading {}", dir.display()))?;
    Ok(Some(engine))
}

/// A rank other than 0 of the batch engine over ranks ([`engine`]): its part of the model (and
/// the whole `draft` model), making every call rank 0's batch makes until rank 0 stops.
fn follow(dir: &Path, draft: Option<&Path>, division: &Division) -> anyhow::Result<()> {
    let model = load_part(dir, division)?;
    let tokenizer = perch_engine::Tokenizer::load(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    // A draft that fails to load fails every rank at load (each naming this one).
    let (draft, prepared) = match draft.map(|d| (d, models::load(d))) {
        None => (None, Ok(())),
        Some((_, Ok(draft))) => (Some(draft), Ok(())),
        Some((d, Err(e))) => (
            None,
            Err(perch_engine::EngineError::Distributed(format!(
                "loading the draft model {}: {e}",
                d.display()
            ))),
        ),
    };
    eprintln!("rank {}: following rank 0's batch", division.rank());
    let _wired = perch_engine::device::WiredLimit::raise();
    perch_engine::engine::follow(
        model.as_ref(),
        prepared.map(|()| draft.as_deref()),
        &tokenizer,
    )
    .with_context(|| format!("rank {}", division.rank()))
}
