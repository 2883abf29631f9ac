//! How a KV cache budget is spent: on the block pool, and on the prefix cache's copies of the
//! layers whose cache per sequence is bounded (sliding-window KV, linear-attention states).

use crate::kv_cache_manager::WindowCost;
use crate::shapes::CAPACITY_STEP;

/// Prompt tokens per forward pass unless a request says otherwise (mlx-lm's
/// `prefill_step_size`).
pub const DEFAULT_PREFILL_STEP_SIZE: usize = 2048;

/// How the batch engine spends a KV budget (the engine's `BatchConfig::for_budget`): on the block pool, whose
/// blocks cost the KV of the layers that keep every position, and on the prefix cache's copies
/// of the bounded layers' parts (the engine's `BatchConfig::bounded_layer_bytes`, see its
/// `kv::block_store`).
/// - Full attention only: the pool takes the whole budget.
/// - Hybrid (linear-attention layers): half each; the pool's blocks cost every attention layer.
/// - Sliding-window layers beside global ones (Gemma 3: 5 of 6 sliding; gpt-oss: 1 of 2): the
///   pool takes the whole budget, and a block costs the global layers only. A running sequence
///   holds its sliding layers' KV too, for at most [`KvBudget::window_tokens`] positions (window,
///   one default prefill chunk and a cache growth step, see `KvCache::with_window`): it is
///   charged that in extra pool blocks ([`crate::KvCacheManager::with_window_cost`]), and only its
///   decode ring's positions once it decodes in the decode slot cache
///   ([`crate::KvCacheManager::bound_window`]). The prefix
///   cache's copies of sliding layers' blocks take pool blocks too, and give them up, least
///   recently used first, when the pool is short (the engine's `BlockStore::with_pool_charge`). A long
///   conversation then takes pool memory at the global layers' rate, not every layer's; a
///   sequence shorter than the window's bound costs what it did when blocks counted every
///   layer.
/// - Every layer sliding: the pool counts every layer, as if they kept every position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvBudget {
    /// Bytes of the pool's blocks.
    pub pool_bytes: usize,
    /// What a token of a block costs.
    pub block_bytes_per_token: usize,
    /// The prefix cache's bytes for bounded layers' parts (the engine's
    /// `BatchConfig::bounded_layer_bytes`).
    pub bounded_bytes: usize,
    /// What a running sequence's sliding layers hold per position, charged apart from its
    /// blocks (0 when blocks count them).
    pub window_bytes_per_token: usize,
    /// Positions a running sequence's sliding layers hold at most.
    pub window_tokens: usize,
}

impl KvBudget {
    /// The split of `budget` for a model whose caches take `full` bytes per position in layers
    /// that keep every position and `sliding` in sliding-window layers (the widest window
    /// `window`), with or without `recurrent` layers.
    pub fn split(
        budget: usize,
        full: usize,
        sliding: usize,
        window: Option<usize>,
        recurrent: bool,
    ) -> Self {
        let every_layer = Self {
            pool_bytes: budget,
            block_bytes_per_token: full + sliding,
            bounded_bytes: 0,
            window_bytes_per_token: 0,
            window_tokens: 0,
        };
        match window {
            _ if recurrent => Self {
                pool_bytes: budget / 2,
                bounded_bytes: budget / 2,
                ..every_layer
            },
            Some(window) if full > 0 => Self {
                pool_bytes: budget,
                block_bytes_per_token: full,
                bounded_bytes: budget,
                window_bytes_per_token: sliding,
                window_tokens: window + DEFAULT_PREFILL_STEP_SIZE + CAPACITY_STEP,
            },
            Some(_) => Self {
                bounded_bytes: budget,
                ..every_layer
            },
            None => every_layer,
        }
    }

    /// What a running sequence's sliding layers cost in pool blocks; `None` when blocks count
    /// every layer.
    pub fn window_cost(&self) -> Option<WindowCost> {
        (self.window_bytes_per_token > 0).then_some(WindowCost {
            tokens: self.window_tokens,
            bytes_per_token: self.window_bytes_per_token,
            block_bytes_per_token: self.block_bytes_per_token,
        })
    }

    /// The longest sequence `pool_bytes` hold (one alone), ignoring block rounding.
    pub fn max_tokens(&self) -> usize {
        let all = self.block_bytes_per_token + self.window_bytes_per_token;
        if self.pool_bytes <= self.window_tokens * all {
            self.pool_bytes / all.max(1)
        } else {
            (self.pool_bytes - self.window_tokens * self.window_bytes_per_token)
                / self.block_bytes_per_token.max(1)
        }
    }
}
