//! What one forward pass reads and writes: the caches of every layer for the rows it runs, as
//! mlx-lm hands a model its list of per-layer cache objects. A model has one forward
//! ([`crate::models::Model::forward`]); the caches decide where each row's tokens sit (their
//! positions, for RoPE) and what attention reads ([`LayerCaches::attend`]): one sequence's own
//! caches (float, quantized, bounded by `max_kv_size`, sliding, recurrent: [`KvCache`]), or the
//! rows of a batch in slot-major buffers ([`SlotKvCache`], for the step its [`SlotStep`]
//! describes).

pub(crate) mod block_store;
pub mod cache;
pub mod slot_cache;
pub(crate) mod tail_cache;

use mlx_rs::{ops, Array};

use crate::attention::AttentionSpec;
use crate::error::Result;
use crate::kv::cache::{KvCache, RecurrentState};
use crate::kv::slot_cache::{RealTokens, SlotKvCache, SlotStep};
use crate::nn::layers::Rope;

/// The caches of one forward pass; see the module docs.
pub enum LayerCaches<'a> {
    /// One sequence (one row): a cache per layer, at the sequence's position.
    Sequence(&'a mut [KvCache]),
    /// The rows of a batch in slot caches, for the step `step` began
    /// ([`SlotKvCache::begin_step`]).
    Slots {
        cache: &'a mut SlotKvCache,
        step: &'a SlotStep,
    },
}

/// Where a pass's tokens sit, read before any layer writes: what RoPE rotates by.
pub enum Positions {
    /// One sequence's tokens from this position on.
    Offset(i32),
    /// Each row's tokens from its own position: `offsets` `[rows]` int32, and every query's
    /// position `queries` `[rows, 1, tokens, 1]` int32.
    Rows { offsets: Array, queries: Array },
    /// Each token rotated by its own angles (Qwen's multimodal RoPE over a pass holding image
    /// tokens): `cos` and `sin` `[rows, 1, tokens, dims]` float32 over the first `dims` features
    /// of each head, and every query's position `queries` `[rows, 1, tokens, 1]` int32 (for masks).
    Rotated {
        cos: Array,
        sin: Array,
        queries: Array,
    },
}

impl Positions {
    /// `a` `[rows, heads, tokens, dims]` rotated by RoPE at these positions.
    pub fn rope(&self, rope: &Rope, a: &Array) -> Result<Array> {
        Ok(match self {
            Positions::Offset(offset) => rope.forward(a, *offset)?,
            Positions::Rows { offsets, .. } => rope.forward_at(a, offsets)?,
            Positions::Rotated { cos, sin, .. } => rotate(a, cos, sin)?,
        })
    }

    /// Every query's position `[rows, 1, tokens, 1]` int32, for a pass of `tokens` per row.
    pub fn queries(&self, tokens: i32) -> Result<Array> {
        Ok(match self {
            Positions::Offset(offset) => ops::arange::<_, i32>(*offset, *offset + tokens, None)?
                .reshape(&[1, 1, tokens, 1])?,
            Positions::Rows { queries, .. } | Positions::Rotated { queries, .. } => queries.clone(),
        })
    }

    /// The last position a query of a pass of `tokens` per row sits at, when one sequence runs;
    /// `None` for rows (each has its own).
    pub fn last(&self, tokens: i32) -> Option<i32> {
        match self {
            Positions::Offset(offset) => Some(offset + tokens - 1),
            Positions::Rows { .. } | Positions::Rotated { .. } => None,
        }
    }

    /// These positions with every token rotated by `cos`, `sin` instead ([`Positions::Rotated`]).
    pub fn rotated(self, cos: Array, sin: Array, tokens: i32) -> Result<Self> {
        let queries = self.queries(tokens)?;
        Ok(Positions::Rotated { cos, sin, queries })
    }
}

/// `a` `[rows, heads, tokens, head_dim]` with its first `dims` features turned by `cos`, `sin`
/// `[rows, 1, tokens, dims]` in the non-interleaved layout (`x cos + rotate_half(x) sin`), the
/// angles in `a`'s dtype and the result back in it, the other features passed through (mlx-vlm's
/// `apply_multimodal_rotary_pos_emb`).
fn rotate(a: &Array, cos: &Array, sin: &Array) -> Result<Array> {
    use crate::nn::mlx_ext::slice;
    let shape = a.shape();
    let (rows, heads, tokens, head_dim) = (shape[0], shape[1], shape[2], shape[3]);
    let dims = cos.shape()[3];
    let half = dims / 2;
    let part = |from: i32, to: i32| slice(a, &[0, 0, 0, from], &[rows, heads, tokens, to]);
    let turned = part(0, dims)?;
    let rotated_half = ops::concatenate(&[ops::negative(&part(half, dims)?)?, part(0, half)?], -1)?;
    let (cos, sin) = (cos.as_dtype(a.dtype())?, sin.as_dtype(a.dtype())?);
    let out = ops::add(
        &ops::multiply(&turned, &cos)?,
        &ops::multiply(&rotated_half, &sin)?,
    )?
    .as_dtype(a.dtype())?;
    if dims == head_dim {
        return Ok(out);
    }
    Ok(ops::concatenate(&[out, part(dims, head_dim)?], -1)?)
}

impl LayerCaches<'_> {
    /// The positions of this pass's tokens (call before any layer writes).
    pub fn positions(&self) -> Positions {
        match self {
            // Every layer of a sequence holds as many tokens (a recurrent one counts them too).
            LayerCaches::Sequence(cache) => {
                Positions::Offset(cache.first().map_or(0, KvCache::offset))
            }
            LayerCaches::Slots { step, .. } => Positions::Rows {
                offsets: step.positions.clone(),
                queries: step.query_positions().clone(),
            },
        }
    }

    /// Attention over cache layer `layer` after it takes `kv`; see [`KvCache::attend`] and
    /// [`SlotKvCache::attend`]. `queries` `[rows, heads, tokens, head_dim]` → `[rows, tokens,
    /// heads * head_dim]` (each position's heads side by side, as the output projection reads
    /// them).
    pub fn attend(
        &mut self,
        layer: usize,
        queries: &Array,
        kv: Option<(Array, Array)>,
        spec: &AttentionSpec<'_>,
    ) -> Result<Array> {
        match self {
            LayerCaches::Sequence(cache) => {
                crate::attention::merge_heads(&cache[layer].attend(queries, kv, spec)?)
            }
            LayerCaches::Slots { cache, step } => cache.attend(layer, step, queries, kv, spec),
        }
    }

    /// Recurrent layer `layer`'s state of every row before this pass (`[rows, ..]`); `None`
    /// before its first token (zeros).
    pub fn recurrent_state(&self, layer: usize) -> Option<RecurrentState> {
        match self {
            LayerCaches::Sequence(cache) => cache[layer].recurrent_state().cloned(),
            LayerCaches::Slots { cache, .. } => cache.recurrent_state(layer),
        }
    }

    /// Replaces recurrent layer `layer`'s state with `state`, the one after this pass's
    /// `tokens` tokens (per row, its real ones).
    pub fn set_recurrent_state(&mut self, layer: usize, state: RecurrentState, tokens: i32) {
        match self {
            LayerCaches::Sequence(cache) => cache[layer].set_recurrent_state(state, tokens),
            LayerCaches::Slots { cache, .. } => cache.set_recurrent_state(layer, state),
        }
    }

    /// Keeps recurrent layer `layer`'s replay (made by `make`) when the slot caches record
    /// this step to rewind it ([`SlotKvCache::keep_replay`]); one sequence's caches never do.
    pub fn keep_replay(
        &mut self,
        layer: usize,
        make: impl FnOnce() -> Box<dyn slot_cache::StateReplay>,
    ) {
        if let LayerCaches::Slots { cache, .. } = self {
            cache.keep_replay(layer, make);
        }
    }

    /// Which tokens of each row are real, when some row pads its chunk or feeds nothing
    /// ([`RealTokens`]); `None` when every token is.
    pub fn real_tokens(&self) -> Option<&RealTokens> {
        match self {
            LayerCaches::Sequence(_) => None,
            LayerCaches::Slots { step, .. } => step.real_tokens(),
        }
    }

    /// The slot caches, when the pass runs a batch's rows.
    pub fn slots(&mut self) -> Option<&mut SlotKvCache> {
        match self {
            LayerCaches::Sequence(_) => None,
            LayerCaches::Slots { cache, .. } => Some(cache),
        }
    }
}
