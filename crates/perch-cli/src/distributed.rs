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
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum BackendArg {
    /// TCP between the hosts of `MLX_HOSTFILE`.
    Ring,
    /// RDMA over Thunderbolt between Macs.
    Jaccl,
    Mpi,
    /// NVIDIA's collectives, between CUDA devices.
    Nccl,
}

impl From<BackendArg> for Backend {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Ring => Backend::Ring,
            BackendArg::Jaccl => Backend::Jaccl,
            BackendArg::Mpi => Backend::Mpi,
            BackendArg::Nccl => Backend::Nccl,
        }
    }
}

/// How long a rank waits for every rank of its group to connect.
const JOIN_DEADLINE: Duration = Duration::from_secs(60);

/// Joins the group on `backend`, takes rank 0's sampling seed (`seed`, or one it draws), and
/// loads this rank's part of the model in `dir` (`split`; `models::load_divided`: no more of
/// the weights is read or kept than the part needs). Returns the model, this rank and the
/// group's seed: every rank must sample alike to stay on the same tokens.
pub fn load(
    dir: &Path,
    split: Split,
    backend: BackendArg,
    seed: Option<u64>,
) -> anyhow::Result<(Box<dyn Model>, usize, u64)> {
    let group = distributed::init(backend.into(), JOIN_DEADLINE)?;
    let rank = group.rank();
    let mine = seed.unwrap_or_else(|| {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    });
    let shared = group.broadcast_bytes((rank == 0).then_some(&mine.to_le_bytes()[..]))?;
    let seed = u64::from_le_bytes(
        shared
            .try_into()
            .map_err(|_| anyhow::anyhow!("rank 0 sent a seed of the wrong size"))?,
    );
    let division = match split {
        Split::Tensor => Division::Tensor(TensorParallel::new(group)),
        Split::Pipeline => Division::Pipeline(PipelineParallel::new(group)),
    };
    let model = models::load_divided(dir, &division).with_context(|| {
        format!(
            "rank {rank} loading its part of the model in {}",
            dir.display()
        )
    })?;
    Ok((model, rank, seed))
}
