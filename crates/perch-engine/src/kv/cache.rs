//! The per-layer KV cache of one sequence (mlx-lm's `KVCache`, or `QuantizedKVCache` when
//! [`KvQuantization`] is set): buffers grown in steps of [`KvCache::STEP`] tokens and written in
//! place, never re-concatenated every token.
//!
//! A float cache holds two buffers, keys and values `[batch, kv_heads, capacity, head_dim]`. A
//! quantized one holds MLX affine-quantized keys and values (`mx.quantize` over the head
//! dimension), three buffers each: packed `[.., capacity, head_dim * bits / 32]` uint32, scales
//! and biases `[.., capacity, head_dim / group_size]`. Every buffer has the token axis at 2, so
//! growing, writing and slicing are the same code for both; "parts" below means these buffers'
//! contents in this order.

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::{ops, Array};

use crate::attention::{cached_attention, window_mask, AttentionSpec, KvMask};
pub use crate::attention::{CachedKv, KvQuantization};
use crate::error::{EngineError, Result};
use crate::nn::mlx_ext::{owned_copy, slice, slice_update};

/// A mask [`KvCache::attend`] chose: causal, or an array it made.
enum KvMaskOwned {
    Causal,
    Array(Array),
}

/// Keys and values `[batch, kv_heads, new, head_dim]` as a cache of format `quantization` stores
/// them: the two arrays, or their MLX-quantized parts (see the module docs).
pub(crate) fn kv_parts(
    quantization: Option<KvQuantization>,
    keys: &Array,
    values: &Array,
) -> Result<Vec<Array>> {
    Ok(match quantization {
        None => vec![keys.clone(), values.clone()],
        Some(q) => {
            let (kw, ks, kb) = ops::quantize(keys, q.group_size, q.bits)?;
            let (vw, vs, vb) = ops::quantize(values, q.group_size, q.bits)?;
            vec![kw, ks, kb, vw, vs, vb]
        }
    })
}

/// `x` through MLX's affine quantization and back, in `x`'s dtype: the values attention over a
/// cache quantized as `quantization` multiplies with.
pub(crate) fn quantize_round_trip(x: &Array, quantization: KvQuantization) -> Result<Array> {
    let (w, scales, biases) = ops::quantize(x, quantization.group_size, quantization.bits)?;
    Ok(ops::dequantize(
        &w,
        &scales,
        &biases,
        quantization.group_size,
        quantization.bits,
    )?)
}

/// The cache of one layer of one sequence. An attention layer's: the first `offset` positions of
/// its key and value buffers are filled. A linear-attention layer's (Gated DeltaNet, see
/// [`KvCache::recurrent`]): the recurrent state after `offset` tokens, with no positions to read
/// (mlx_lm's `ArraysCache`).
#[derive(Default)]
pub struct KvCache {
    quantization: Option<KvQuantization>,
    /// Keys' parts then values' parts (2 or 6 buffers); empty until the first update.
    buffers: Vec<Array>,
    offset: i32,
    /// Absolute position of the buffers' first entry (positions before it were dropped).
    base: i32,
    /// A sliding layer's window: queries see their last `window` positions only.
    window: Option<i32>,
    /// Positions before this one may be dropped (see [`KvCache::release_before`]).
    releasable: i32,
    /// A recurrent layer's state, `None` before its first token; `None` for attention layers.
    recurrent: Option<RecurrentState>,
    is_recurrent: bool,
    /// A recurrent layer's state shapes for one sequence (conv, ssm), when the model gave them.
    state_shapes: Option<[Vec<i32>; 2]>,
    /// An attention layer's `[kv_heads, head_dim]`, when the model gave them (layers of one
    /// model may differ: Gemma 4's global layers have heads of their own size).
    head_shape: Option<[i32; 2]>,
    /// A bound on the positions attention reads ([`KvCache::limit_to`]), `None` for none.
    limit: Option<KvLimit>,
    /// With a limit: the parts of positions `[0, keep)`, copied before the buffers drop them.
    sinks: Option<Vec<Array>>,
}

/// mlx_lm's `RotatingKVCache(max_size, keep)` (what `--max-kv-size` makes): attention reads the
/// first `keep` positions and the most recent ones, `max_size` positions in all, so a sequence's
/// cache stays bounded however long it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLimit {
    pub max_size: i32,
    pub keep: i32,
}

impl KvLimit {
    /// The positions mlx_lm keeps at the front (`make_prompt_cache`'s `keep=4`).
    pub const KEEP: i32 = 4;
    /// The largest bound the batch engine's bounded rows take (their ring arithmetic is int32).
    pub const MAX_SIZE: i32 = 1 << 28;

    /// Errors unless `max_size` leaves room for one recent position beside the `keep` ones.
    pub fn new(max_size: usize, keep: i32) -> Result<Self> {
        let max_size = i32::try_from(max_size).unwrap_or(i32::MAX);
        if max_size <= keep {
            return Err(EngineError::Request(format!(
                "max_kv_size {max_size} must be more than the {keep} positions kept at the start"
            )));
        }
        Ok(Self { max_size, keep })
    }

    /// Recent positions read by one new token: `max_size - keep`.
    fn recent(&self) -> i32 {
        self.max_size - self.keep
    }

    /// What an update of new tokens at position `start` reads besides them, as mlx_lm's
    /// `RotatingKVCache` holds it then: positions `[0, keep_end)` and `[recent_from, start)`,
    /// `max_size - 1` at most (so each new token sees at least `max_size` positions with its
    /// own). Returns `(keep_end, recent_from)`; `keep_end == recent_from` when nothing between
    /// them is left out.
    pub fn held_before(&self, start: i32) -> (i32, i32) {
        let keep_end = self.keep.min(start);
        let recent_from = (start + 1 - self.recent())
            .max(self.keep)
            .min(start)
            .max(keep_end);
        (keep_end, recent_from)
    }
}

/// What attention reads from a cache with a [`KvLimit`] for `new` queries (see
/// [`KvCache::limited_fetch`]).
pub struct LimitedKv {
    pub keys: Array,
    pub values: Array,
    /// `[1, 1, new, positions]`, true where a query may look; `None` for causal attention over
    /// everything (one query, or nothing out of reach yet).
    pub mask: Option<Array>,
}

/// A linear-attention layer's state for one or more sequences (rows on axis 0).
#[derive(Clone)]
pub struct RecurrentState {
    /// The last `kernel - 1` inputs of the short convolution, `[rows, kernel - 1, channels]`.
    pub conv: Array,
    /// The recurrence's state, `[rows, value_heads, value_dim, key_dim]`, float32.
    pub ssm: Array,
}

impl KvCache {
    /// Growth step in tokens: the buffers are reallocated once per this many tokens.
    pub const STEP: i32 = perch_sched::shapes::CAPACITY_STEP as i32;

    /// A float cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A float cache, or a quantized one.
    pub fn with_quantization(quantization: Option<KvQuantization>) -> Self {
        Self {
            quantization,
            ..Self::default()
        }
    }

    /// The cache of a sliding-window layer, which drops the positions its queries can no longer
    /// see (once allowed to, see [`KvCache::release_before`]). `window` must be at least 1.
    pub fn with_window(mut self, window: i32) -> Self {
        debug_assert!(window >= 1, "a window of {window} positions");
        self.window = Some(window);
        self
    }

    /// A sliding layer's window; `None` for a global attention layer.
    pub fn window(&self) -> Option<i32> {
        self.window
    }

    /// Bounds what attention reads as mlx_lm's `RotatingKVCache(max_size, keep)` does, and lets
    /// the cache drop what it will not read again (for a cache nothing copies positions from:
    /// [`crate::sequence::generate`]'s). Attention must then read through [`KvCache::limited_fetch`].
    pub fn limit_to(&mut self, limit: KvLimit) {
        self.limit = Some(limit);
        self.releasable = i32::MAX;
    }

    /// The bound set by [`KvCache::limit_to`].
    pub fn limit(&self) -> Option<KvLimit> {
        self.limit
    }

    /// For a cache with a [`KvLimit`], after `new` positions were appended (or, for a layer
    /// sharing this cache, for its `new` queries at the last positions): the keys and values
    /// attention reads and its mask, as mlx_lm's `RotatingKVCache` gives them. mlx_lm's cache
    /// holds, before an update of `new` tokens at position `t`, the first `keep` positions and
    /// the most recent ones: `max_size - 1` in all for more than one new token (so each sees at
    /// least `max_size` positions), `max_size - 1 - keep` recent ones for one new token; its
    /// mask for several tokens is over that list's indices, each query seeing the `max_size`
    /// entries up to its own (so the kept first positions leave the view first, then the
    /// oldest recent ones), and one token sees every held entry.
    pub fn limited_fetch(&self, new: i32) -> Result<LimitedKv> {
        let limit = self.limit.expect("a cache with a limit");
        let end = self.offset;
        let start = end - new;
        let (keep_end, recent_from) = limit.held_before(start);
        let mut keys = Vec::with_capacity(3);
        let mut values = Vec::with_capacity(3);
        let dense = |parts: Vec<Array>| -> Result<(Array, Array)> {
            match (self.quantization, parts.as_slice()) {
                (None, [k, v]) => Ok((k.clone(), v.clone())),
                _ => Err(EngineError::Request(
                    "a KV cache with max_kv_size cannot be quantized (mlx_lm's neither)".into(),
                )),
            }
        };
        // The kept first positions apart from the recent ones: when positions between them are
        // out of reach, or the buffers dropped them (then the copy made before holds them).
        let split = self.base > 0 || keep_end < recent_from;
        if split {
            let (k, v) = if self.base == 0 {
                dense(self.parts(0, keep_end)?)?
            } else {
                let sinks = self
                    .sinks
                    .as_ref()
                    .expect("kept positions copied before dropping");
                // Dropping happens only once all `keep` positions are held (see append_parts).
                dense(sinks.clone())?
            };
            keys.push(k);
            values.push(v);
        }
        let from = if split { recent_from } else { 0 };
        let (k, v) = dense(self.parts(from, end)?)?;
        keys.push(k);
        values.push(v);
        let (keys, values) = if keys.len() == 1 {
            (keys.pop().unwrap(), values.pop().unwrap())
        } else {
            (ops::concatenate(&keys, 2)?, ops::concatenate(&values, 2)?)
        };
        // Entries before the new ones, and whether a query cannot see them all.
        let held = if split {
            keep_end + start - recent_from
        } else {
            start
        };
        let mask = (new > 1 && held + new > limit.max_size)
            .then(|| -> Result<Array> {
                let q = ops::arange::<_, i32>(held, held + new, None)?.reshape(&[1, 1, new, 1])?;
                let k = ops::arange::<_, i32>(0, held + new, None)?.reshape(&[1, 1, 1, -1])?;
                let size = Array::from_int(limit.max_size);
                Ok(ops::logical_and(
                    &ops::ge(&q, &k)?,
                    &ops::lt(&q, &ops::add(&k, &size)?)?,
                )?)
            })
            .transpose()?;
        Ok(LimitedKv { keys, values, mask })
    }

    /// Quantizes what the cache holds and everything appended after (mlx_lm's
    /// `KVCache.to_quantized`, which `--quantized-kv-start` applies once a cache holds that many
    /// positions). No effect on a quantized or recurrent cache, or an empty one but its format.
    pub fn quantize(&mut self, quantization: KvQuantization) -> Result<()> {
        if self.quantization.is_some() || self.is_recurrent {
            return Ok(());
        }
        if self.limit.is_some() {
            return Err(EngineError::Request(
                "a KV cache with max_kv_size cannot be quantized (mlx_lm's neither)".into(),
            ));
        }
        let buffers = std::mem::take(&mut self.buffers);
        if let [keys, values] = buffers.as_slice() {
            self.buffers = kv_parts(Some(quantization), keys, values)?;
        }
        self.quantization = Some(quantization);
        Ok(())
    }

    /// Lets a sliding-window cache drop positions before `position` once no query can see them
    /// (a query at position `p` sees `p - window + 1 ..= p`). The batch engine raises it as
    /// blocks are copied out; a cache that is never shared allows `i32::MAX`. No effect on a
    /// global layer's cache. Dropping happens when the buffers next grow.
    pub fn release_before(&mut self, position: i32) {
        self.releasable = self.releasable.max(position);
    }

    /// How many leading positions of a prefix a cache of this layer need not hold before a
    /// query at position `next`: those out of a sliding window's reach (and allowed to be
    /// dropped, see [`KvCache::release_before`]), rounded down to a multiple of `align` (a
    /// block). 0 for a global layer.
    pub fn positions_to_skip(&self, next: i32, align: i32) -> i32 {
        match self.window {
            Some(window) => {
                let skip = (next + 1 - window).min(self.releasable).max(0);
                skip / align.max(1) * align.max(1)
            }
            None => 0,
        }
    }

    /// Starts an empty cache at `position`, as if the positions before it had been dropped (a
    /// sliding layer loading only the part of a prefix its window reaches).
    pub fn start_at(&mut self, position: i32) {
        debug_assert!(self.offset == 0 && self.buffers.is_empty(), "not empty");
        self.base = position;
        self.offset = position;
    }

    /// The first position still held (0 unless a sliding window dropped earlier ones): reads
    /// ([`KvCache::parts`]) start at or after it, and [`KvCache::update_and_fetch`] returns the
    /// positions from it on.
    pub fn first_position(&self) -> i32 {
        self.base
    }

    /// The cache of a linear-attention layer: a recurrent state, no positions.
    pub fn recurrent() -> Self {
        Self {
            is_recurrent: true,
            ..Self::default()
        }
    }

    /// Records one sequence's state shapes (`[conv, ssm]`), for checking states read from files.
    pub fn with_state_shapes(mut self, shapes: [Vec<i32>; 2]) -> Self {
        self.state_shapes = Some(shapes);
        self
    }

    /// Records an attention layer's keys' and values' shape, `kv_heads` heads of `head_dim`.
    pub fn with_head_shape(mut self, kv_heads: i32, head_dim: i32) -> Self {
        self.head_shape = Some([kv_heads, head_dim]);
        self
    }

    /// An attention layer's `[kv_heads, head_dim]`, when known.
    pub fn head_shape(&self) -> Option<[i32; 2]> {
        self.head_shape
    }

    /// One sequence's state shapes (`[conv, ssm]`) of a recurrent layer, when known.
    pub fn state_shapes(&self) -> Option<&[Vec<i32>; 2]> {
        self.state_shapes.as_ref()
    }

    /// Whether this is a linear-attention layer's cache ([`KvCache::recurrent`]).
    pub fn is_recurrent(&self) -> bool {
        self.is_recurrent
    }

    /// The recurrent state after [`KvCache::offset`] tokens; `None` before the first.
    pub fn recurrent_state(&self) -> Option<&RecurrentState> {
        self.recurrent.as_ref()
    }

    /// Replaces the recurrent state with the one after `new_tokens` more tokens.
    pub fn set_recurrent_state(&mut self, state: RecurrentState, new_tokens: i32) {
        debug_assert!(self.is_recurrent, "a recurrent state in an attention cache");
        self.recurrent = Some(state);
        self.offset += new_tokens;
    }

    pub fn quantization(&self) -> Option<KvQuantization> {
        self.quantization
    }

    /// Number of cached positions.
    pub fn offset(&self) -> i32 {
        self.offset
    }

    /// Appends `keys`/`values` `[batch, kv_heads, new, head_dim]` (quantizing them first when
    /// this cache is quantized) and returns every held position, from
    /// [`KvCache::first_position`] (as it is after the append, which may drop positions) to the
    /// end.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<CachedKv> {
        self.append_parts(&kv_parts(self.quantization, keys, values)?)?;
        Ok(CachedKv::from_parts(
            self.quantization,
            self.parts(self.base, self.offset)?,
        ))
    }

    /// Attention of `queries` `[1, heads, seq, head_dim]` (rotated, at the `seq` positions after
    /// those held before this pass) over this layer's cache, after appending `kv` (rotated keys
    /// and values `[1, kv_heads, seq, head_dim]`; `None` for a layer that reads this cache as an
    /// earlier layer left it in the same pass: Gemma 4's KV-shared layers) → `[1, heads, seq,
    /// head_dim]`. How it reads is the cache's business, as mlx_lm's caches decide it: causal
    /// over every position (fused, or quantized as mlx_lm's
    /// `quantized_scaled_dot_product_attention`), a bounded cache's first and recent positions
    /// ([`KvCache::limited_fetch`]), a sliding window's last positions.
    pub fn attend(
        &mut self,
        queries: &Array,
        kv: Option<(Array, Array)>,
        spec: &AttentionSpec<'_>,
    ) -> Result<Array> {
        let seq = queries.shape()[2];
        let offset = match kv {
            Some(_) => self.offset,
            None => self.offset - seq,
        };
        // One new token attends to everything cached: no mask (as mlx-lm passes None).
        let causal = seq > 1;
        let cached = match kv {
            Some((keys, values)) => self.update_and_fetch(&keys, &values)?,
            None => self.fetch()?,
        };
        // A cache bounded by max_kv_size reads its first and its recent positions.
        if self.limit.is_some() && spec.window.is_none() {
            let limited = self.limited_fetch(seq)?;
            let mask = match &limited.mask {
                Some(mask) => Some(ScaledDotProductAttentionMask::Array(mask)),
                None => causal.then_some(ScaledDotProductAttentionMask::Causal),
            };
            return Ok(scaled_dot_product_attention(
                queries,
                &limited.keys,
                &limited.values,
                spec.scale,
                mask,
                spec.sinks,
            )?);
        }
        // A sliding layer whose window leaves positions out reads from the first position its
        // first query sees, masked by distance for more than one query. (The cache may have
        // dropped positions before that one: what it returns starts at its first position.)
        let (cached, mask) = match spec.window.filter(|&w| offset + seq > w) {
            Some(window) => {
                let start = (offset + 1 - window).max(0);
                let mask = causal
                    .then(|| window_mask(offset, seq, start, window))
                    .transpose()?;
                let skip = start - self.base;
                let cached = cached.map(|a| {
                    let s = a.shape();
                    Ok(slice(&a, &[0, 0, skip, 0], &[s[0], s[1], s[2], s[3]])?)
                })?;
                (cached, mask.map(KvMaskOwned::Array))
            }
            None => (cached, causal.then_some(KvMaskOwned::Causal)),
        };
        let mask = match &mask {
            Some(KvMaskOwned::Array(mask)) => KvMask::Array(mask),
            Some(KvMaskOwned::Causal) => KvMask::Causal,
            None => KvMask::None,
        };
        cached_attention(queries, cached, spec.scale, mask, spec.sinks)
    }

    /// Every held position, as [`KvCache::update_and_fetch`] returns them, without appending
    /// (a layer reading another layer's cache: Gemma 4's KV-shared layers).
    pub fn fetch(&self) -> Result<CachedKv> {
        Ok(CachedKv::from_parts(
            self.quantization,
            self.parts(self.base, self.offset)?,
        ))
    }

    /// Appends parts in this cache's own format (from [`KvCache::parts`] of a cache with the
    /// same quantization), all with the same number of new positions on axis 2.
    pub fn append_parts(&mut self, parts: &[Array]) -> Result<()> {
        if self.is_recurrent {
            return Err(mlx_rs::error::Exception::from(
                "KV positions given to a linear-attention layer's cache",
            )
            .into());
        }
        let expected = if self.quantization.is_some() { 6 } else { 2 };
        if parts.len() != expected {
            return Err(mlx_rs::error::Exception::from(
                format!("{} KV parts given to a cache of {expected}", parts.len()).as_str(),
            )
            .into());
        }
        let new = parts[0].shape()[2];
        // Buffer indices: absolute positions less `base`.
        let start = self.offset - self.base;
        let end = start + new;
        let capacity = self.buffers.first().map_or(0, |b| b.shape()[2]);
        if end > capacity {
            // The first new query (at `offset`) sees from `offset - window + 1` on; a sliding
            // cache drops what is before that, as far as it is allowed to.
            let window = self.window.or(self.limit.map(|l| l.recent()));
            let mut drop = match window {
                Some(window) => (self.offset + 1 - window).min(self.releasable) - self.base,
                None => 0,
            }
            .clamp(0, start);
            // A limited cache keeps its first positions apart before the buffers drop them
            // (and drops nothing until it has them all).
            if let Some(limit) = self.limit.filter(|_| drop > 0 && self.sinks.is_none()) {
                if self.offset < limit.keep {
                    drop = 0;
                } else {
                    self.sinks = Some(self.copy_parts(0, limit.keep)?);
                }
            }
            let grow = (new + Self::STEP - 1) / Self::STEP * Self::STEP;
            let old = std::mem::take(&mut self.buffers);
            for (i, part) in parts.iter().enumerate() {
                let s = part.shape();
                let fresh = ops::zeros_dtype(&[s[0], s[1], grow, s[3]], part.dtype())?;
                self.buffers.push(match old.get(i) {
                    // Drop the unused tail before growing, as mlx-lm does, so sizes stay step
                    // multiples (plus what a window keeps).
                    Some(buffer) => ops::concatenate(
                        &[
                            slice(buffer, &[0, 0, drop, 0], &[s[0], s[1], start, s[3]])?,
                            fresh,
                        ],
                        2,
                    )?,
                    None => fresh,
                });
            }
            self.base += drop;
        }
        let (start, end) = (self.offset - self.base, self.offset - self.base + new);
        for (buffer, part) in self.buffers.iter_mut().zip(parts) {
            let s = part.shape();
            *buffer = slice_update(buffer, part, &[0, 0, start, 0], &[s[0], s[1], end, s[3]])?;
        }
        self.offset += new;
        Ok(())
    }

    /// Forgets the last `n` positions (at most those held); returns how many were removed.
    pub fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset - self.base);
        self.offset -= n;
        n
    }

    /// Positions `[start, end)` (`first_position <= start <= end <= offset`) of every buffer, in
    /// this cache's own format: views, valid for reading until the cache is written again (lazy).
    /// Errors for positions a sliding window dropped.
    pub fn parts(&self, start: i32, end: i32) -> Result<Vec<Array>> {
        if self.is_recurrent {
            return Err(mlx_rs::error::Exception::from(
                "a linear-attention layer's cache has no positions to read",
            )
            .into());
        }
        if self.buffers.is_empty() {
            return Err(mlx_rs::error::Exception::from("positions of an empty KV cache").into());
        }
        if start < self.base {
            return Err(mlx_rs::error::Exception::from(
                format!(
                    "positions {start}.. of a sliding-window cache that holds {}.. only",
                    self.base
                )
                .as_str(),
            )
            .into());
        }
        debug_assert!(
            start <= end && end <= self.offset,
            "range {start}..{end} outside {}..{}",
            self.base,
            self.offset
        );
        let (start, end) = (start - self.base, end - self.base);
        let capacity = self.buffers[0].shape()[2];
        self.buffers
            .iter()
            .map(|b| {
                if start == 0 && end == capacity {
                    return Ok(b.clone());
                }
                let s = b.shape();
                Ok(slice(b, &[0, 0, start, 0], &[s[0], s[1], end, s[3]])?)
            })
            .collect()
    }

    /// [`KvCache::parts`] in buffers of their own, which outlive this cache's buffers (lazy).
    pub fn copy_parts(&self, start: i32, end: i32) -> Result<Vec<Array>> {
        self.parts(start, end)?
            .iter()
            .map(|p| Ok(owned_copy(p)?))
            .collect()
    }

    /// What a block of positions `[start, end)` keeps of this layer for the prefix cache: an
    /// attention layer's [`KvCache::copy_parts`]; a recurrent layer's state `[conv, ssm]` when it
    /// is the state after `end` (`end == offset`), else nothing (a recurrent state exists only
    /// after the last token computed, see [`crate::kv::block_store`]).
    pub fn block_parts(&self, start: i32, end: i32) -> Result<Vec<Array>> {
        if !self.is_recurrent {
            return self.copy_parts(start, end);
        }
        Ok(match &self.recurrent {
            Some(state) if end == self.offset => vec![state.conv.clone(), state.ssm.clone()],
            _ => Vec::new(),
        })
    }

    /// Appends what [`KvCache::block_parts`] gave for `new` positions: an attention layer's
    /// parts, or a recurrent layer's state after them (`[conv, ssm]`, which replaces the state).
    pub fn append_block_parts(&mut self, parts: &[Array], new: i32) -> Result<()> {
        if !self.is_recurrent {
            return self.append_parts(parts);
        }
        match parts {
            [conv, ssm] => {
                self.set_recurrent_state(
                    RecurrentState {
                        conv: conv.clone(),
                        ssm: ssm.clone(),
                    },
                    new,
                );
                Ok(())
            }
            _ => Err(mlx_rs::error::Exception::from(
                format!(
                    "{} arrays given as a linear-attention layer's state (conv, ssm expected)",
                    parts.len()
                )
                .as_str(),
            )
            .into()),
        }
    }

    /// Positions `[start, end)` as float keys and values `[batch, kv_heads, end - start,
    /// head_dim]`, dequantized when the cache is quantized (lazy).
    pub fn positions(&self, start: i32, end: i32) -> Result<(Array, Array)> {
        let parts = self.parts(start, end)?;
        Ok(match (self.quantization, parts.as_slice()) {
            (None, [keys, values]) => (keys.clone(), values.clone()),
            (Some(q), [kw, ks, kb, vw, vs, vb]) => (
                ops::dequantize(kw, ks, kb, q.group_size, q.bits)?,
                ops::dequantize(vw, vs, vb, q.group_size, q.bits)?,
            ),
            _ => unreachable!("a cache holds 2 or 6 buffers"),
        })
    }

    /// Appends positions `offset()..end` of `other`, converting between float and quantized
    /// when the two caches differ. An empty cache starts where `other` does (a sliding layer
    /// that holds only its window's positions, see [`KvCache::start_at`]). A recurrent layer's
    /// cache takes `other`'s state, which must be the state after `end` tokens.
    pub fn extend_from(&mut self, other: &KvCache, end: i32) -> Result<()> {
        if self.is_recurrent {
            // A recurrent state exists after its last token only.
            let new = end - self.offset;
            return match other.recurrent_state() {
                Some(state) if other.is_recurrent && other.offset == end && new >= 0 => {
                    self.set_recurrent_state(state.clone(), new);
                    Ok(())
                }
                _ => Err(mlx_rs::error::Exception::from(
                    format!(
                        "a linear-attention layer's state after {end} tokens, from a cache after {}",
                        other.offset
                    )
                    .as_str(),
                )
                .into()),
            };
        }
        if self.offset == 0 && self.buffers.is_empty() {
            self.start_at(other.first_position().min(end));
        }
        let start = self.offset;
        if start >= end {
            return Ok(());
        }
        if other.quantization == self.quantization {
            return self.append_parts(&other.parts(start, end)?);
        }
        let (keys, values) = other.positions(start, end)?;
        self.update_and_fetch(&keys, &values).map(drop)
    }

    /// Bytes held by the buffers (capacity, not only the filled part).
    pub fn nbytes(&self) -> usize {
        self.state().into_iter().map(Array::nbytes).sum()
    }

    /// The arrays to evaluate so that the cache holds computed data rather than a lazy graph.
    pub fn state(&self) -> Vec<&Array> {
        let recurrent = self.recurrent.iter().flat_map(|r| [&r.conv, &r.ssm]);
        self.buffers.iter().chain(recurrent).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys and values `[1, 1, n, dim]` whose every element is its absolute position.
    fn positions_of(from: i32, n: i32, dim: i32) -> Array {
        let values: Vec<f32> = (from..from + n)
            .flat_map(|p| vec![p as f32; dim as usize])
            .collect();
        Array::from_slice(&values, &[1, 1, n, dim])
    }

    fn positions(from: i32, n: i32) -> Array {
        positions_of(from, n, 4)
    }

    fn held(cache: &KvCache) -> Vec<f32> {
        let (keys, _) = cache
            .positions(cache.first_position(), cache.offset())
            .unwrap();
        keys.as_slice::<f32>().iter().step_by(4).copied().collect()
    }

    #[test]
    fn a_sliding_cache_holds_about_its_window() {
        let window = 40;
        for quantization in [None, Some(KvQuantization::new(8, 32, 64).unwrap())] {
            let dim = if quantization.is_some() { 64 } else { 4 };
            let mut bounded = KvCache::with_quantization(quantization).with_window(window);
            bounded.release_before(i32::MAX);
            let mut kept = KvCache::with_quantization(quantization).with_window(window);
            let mut offset = 0;
            // Prefill chunks, then single tokens, past several growth steps.
            for n in [100, 100, 100]
                .into_iter()
                .chain(std::iter::repeat_n(1, 700))
            {
                let kv = positions_of(offset, n, dim);
                bounded.update_and_fetch(&kv, &kv).unwrap();
                kept.update_and_fetch(&kv, &kv).unwrap();
                offset += n;
                let capacity = bounded.buffers[0].shape()[2];
                assert!(
                    capacity <= window - 1 + KvCache::STEP + 100,
                    "{capacity} positions held at {offset}"
                );
            }
            assert_eq!(bounded.offset(), 1000);
            let first = bounded.first_position();
            assert!(
                first > 0 && first <= 1000 - window,
                "first position {first}"
            );
            let expected: Vec<f32> = (first..1000).map(|p| p as f32).collect();
            if quantization.is_none() {
                assert_eq!(held(&bounded), expected);
            }
            // What a query at the end sees is the same with and without dropping.
            let (a, _) = bounded.positions(1000 - window, 1000).unwrap();
            let (b, _) = kept.positions(1000 - window, 1000).unwrap();
            assert_eq!(a.as_slice::<f32>(), b.as_slice::<f32>());
            assert!(bounded.nbytes() * 2 < kept.nbytes());
            assert_eq!(
                kept.first_position(),
                0,
                "no release allowed: nothing dropped"
            );
            // Dropped positions are an error, not a wrong read.
            assert!(bounded.parts(0, 10).is_err());
        }
    }

    /// What a limited cache gives attention: the positions (each key holds its position) and
    /// the mask rows as the positions each query sees.
    fn limited(cache: &KvCache, new: i32) -> (Vec<i32>, Option<Vec<Vec<i32>>>) {
        let view = cache.limited_fetch(new).unwrap();
        let keys: Vec<i32> = view
            .keys
            .as_slice::<f32>()
            .iter()
            .step_by(4)
            .map(|&p| p as i32)
            .collect();
        let mask = view.mask.map(|m| {
            let m = m.as_slice::<bool>().to_vec();
            m.chunks(keys.len())
                .map(|row| {
                    row.iter()
                        .zip(&keys)
                        .filter(|(&seen, _)| seen)
                        .map(|(_, &p)| p)
                        .collect()
                })
                .collect()
        });
        (keys, mask)
    }

    #[test]
    fn a_limited_cache_reads_its_first_and_recent_positions_as_mlx_lm_rotates_them() {
        let limit = KvLimit::new(10, KvLimit::KEEP).unwrap();
        let mut cache = KvCache::new();
        cache.limit_to(limit);
        let append = |cache: &mut KvCache, from: i32, n: i32| {
            let kv = positions(from, n);
            cache.update_and_fetch(&kv, &kv).unwrap();
        };
        // Within the bound: everything, causal.
        append(&mut cache, 0, 6);
        assert_eq!(limited(&cache, 6), ((0..6).collect(), None));
        // A chunk that crosses it: 9 held before (the bound less one), then each query sees the
        // 10 entries up to its own, so the first positions leave the view first.
        append(&mut cache, 6, 5);
        let (keys, mask) = limited(&cache, 5);
        assert_eq!(keys, (0..11).collect::<Vec<_>>());
        let mask = mask.expect("a mask past the bound");
        assert_eq!(mask[0], (0..7).collect::<Vec<_>>());
        assert_eq!(mask[4], (1..11).collect::<Vec<_>>());
        // One token: the 4 first positions and the 6 most recent, itself included.
        append(&mut cache, 11, 1);
        assert_eq!(
            limited(&cache, 1),
            (vec![0, 1, 2, 3, 6, 7, 8, 9, 10, 11], None)
        );
        // A chunk after decoding: 4 first + 5 recent held, then the new ones.
        append(&mut cache, 12, 3);
        let (keys, mask) = limited(&cache, 3);
        assert_eq!(keys, vec![0, 1, 2, 3, 7, 8, 9, 10, 11, 12, 13, 14]);
        let mask = mask.unwrap();
        assert_eq!(mask[0], vec![0, 1, 2, 3, 7, 8, 9, 10, 11, 12]);
        assert_eq!(mask[2], vec![2, 3, 7, 8, 9, 10, 11, 12, 13, 14]);
        // Far past a growth step the buffers have dropped the middle; the first positions stay.
        for p in 15..700 {
            append(&mut cache, p, 1);
        }
        assert!(cache.first_position() > 4, "nothing dropped");
        let (keys, _) = limited(&cache, 1);
        assert_eq!(
            keys,
            [0, 1, 2, 3].into_iter().chain(694..700).collect::<Vec<_>>()
        );
        assert!(cache.buffers[0].shape()[2] <= 10 + KvCache::STEP);
        append(&mut cache, 700, 2);
        let (keys, mask) = limited(&cache, 2);
        assert_eq!(
            keys,
            [0, 1, 2, 3].into_iter().chain(695..702).collect::<Vec<_>>()
        );
        assert_eq!(
            mask.unwrap()[1],
            [1, 2, 3].into_iter().chain(695..702).collect::<Vec<_>>()
        );

        assert!(KvLimit::new(4, KvLimit::KEEP).is_err());
        let q = KvQuantization::new(8, 32, 64).unwrap();
        assert!(
            cache.quantize(q).is_err(),
            "a rotating cache is not quantized"
        );
    }

    #[test]
    fn quantizing_a_cache_keeps_its_positions() {
        let q = KvQuantization::new(8, 32, 64).unwrap();
        let mut cache = KvCache::new();
        let kv = positions_of(0, 20, 64);
        cache.update_and_fetch(&kv, &kv).unwrap();
        cache.quantize(q).unwrap();
        assert_eq!(cache.quantization(), Some(q));
        let one = positions_of(20, 1, 64);
        let CachedKv::Quantized { keys, .. } = cache.update_and_fetch(&one, &one).unwrap() else {
            panic!("quantized parts after quantize")
        };
        assert_eq!(keys[0].shape()[2], 21);
        let (keys, _) = cache.positions(0, 21).unwrap();
        let firsts: Vec<f32> = keys.as_slice::<f32>().iter().step_by(64).copied().collect();
        let expected: Vec<f32> = (0..21).map(|p| p as f32).collect();
        for (a, b) in firsts.iter().zip(&expected) {
            assert!((a - b).abs() <= b * 0.01 + 0.01, "{firsts:?}");
        }
    }

    #[test]
    fn release_is_bounded_by_what_was_allowed_and_global_layers_keep_all() {
        let kv = positions(0, 600);
        let mut sliding = KvCache::new().with_window(16);
        sliding.release_before(300);
        sliding.update_and_fetch(&kv, &kv).unwrap();
        let one = positions(600, 1);
        for _ in 0..300 {
            sliding.update_and_fetch(&one, &one).unwrap();
        }
        assert_eq!(sliding.first_position(), 300);
        assert_eq!(held(&sliding)[0], 300.0);

        let mut global = KvCache::new();
        global.release_before(i32::MAX);
        global.update_and_fetch(&kv, &kv).unwrap();
        for _ in 0..300 {
            global.update_and_fetch(&one, &one).unwrap();
        }
        assert_eq!(global.first_position(), 0);
        assert_eq!(global.offset(), 900);
    }

    #[test]
    fn a_cache_started_later_reads_from_there() {
        let mut cache = KvCache::new().with_window(8);
        cache.release_before(i32::MAX);
        assert_eq!(cache.positions_to_skip(100, 16), 80);
        cache.start_at(80);
        let kv = positions(80, 20);
        cache.update_and_fetch(&kv, &kv).unwrap();
        assert_eq!(cache.offset(), 100);
        assert_eq!(
            held(&cache),
            (80..100).map(|p| p as f32).collect::<Vec<_>>()
        );
        assert_eq!(KvCache::new().positions_to_skip(100, 16), 0);
        assert_eq!(
            KvCache::new().with_window(8).positions_to_skip(100, 16),
            0,
            "not allowed"
        );
    }
}
