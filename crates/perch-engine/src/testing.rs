//! The engine's internals that integration tests, benchmarks and fuzz targets drive directly
//! (the batch without the engine thread, caches and attention kernels against mlx_lm's, the
//! scheduler's shapes). Not a stable API.

pub use crate::attention::{
    additive_mask, explicit_scaled_dot_product_attention, masked_attention,
    quantized_scaled_dot_product_attention, CachedKv, KvMask, SlotRead,
};
pub use crate::engine::batch::lockstep::{follow_reading_memory, least_available};
pub use crate::engine::batch::{
    kv_budget_for_model, kv_bytes_per_token, step_activation_bytes, BatchConfig, BatchEvent,
    BatchGenerator,
};
pub use crate::kv::cache::{KvCache, KvLimit, RecurrentState};
pub use crate::kv::slot_cache::{RowKv, SlotKvCache, SlotStep};
pub use crate::kv::LayerCaches;
pub use crate::nn::layers::loading_dense_weights;
pub use crate::worker::draft::{DraftRow, DraftRunner};
pub use crate::worker::runner::Proposed;
pub use perch_sched::budget::KvBudget;
pub use perch_sched::scheduler::{decode_warm_up_positions, prefill_warm_up_shapes};
