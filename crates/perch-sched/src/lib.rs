//! Perch's batch scheduling, in the vocabulary of vLLM v1's `core/`: the KV block pool with
//! prefix caching ([`block_pool`]), per-request block tables ([`kv_cache_manager`]), the
//! prefixes clients pinned ([`prefix_pins`]) and why a prompt missed the cache
//! ([`cache_miss`]), how a KV budget is split between them and the prefix cache's bounded
//! layers ([`budget`]), the scheduler's decisions ([`scheduler`]), a step's plan built from them ([`plan`], vLLM's
//! `SchedulerOutput`) and the shapes its steps are bucketed to ([`shapes`]).
//!
//! Nothing here touches MLX or a model: every decision is a plain function or a data structure,
//! tested without one. The engine (`perch-engine`) owns the model, the KV content and the
//! forward passes, and asks this crate what to run.

pub mod block_pool;
pub mod budget;
pub mod cache_miss;
pub mod kv_cache_manager;
pub mod plan;
pub mod prefix_pins;
pub mod scheduler;
pub mod shapes;
pub mod throughput;

pub use block_pool::{BlockId, BlockPool};
pub use kv_cache_manager::{KvCacheManager, RequestId};
